"""Reading some of a loaded DiT's tensors again from its checkpoint, in place.

A LoRA merged into a model, taken out again or merged at another strength (lora/apply.py): the
tensors it changes are read again from the file the model came from, changed by the merge in
float32 and converted (or quantized) exactly as the loader does, then copied into the model's
own tensors. The model is never held twice: one tensor is in transit at a time, and the tensors
keep their identity (and so their place in a block swap buffer).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterable

import torch

from ..wan.dit import is_block_linear
from .loader import WeightMerge, prepare, read_float, read_quantized
from .reader import CheckpointError, open_checkpoint


def reload_tensors(path: str | Path, tensors: dict[str, torch.Tensor], config,
                   keys: Iterable[str], quantization: str | None = None,
                   merge: WeightMerge | None = None,
                   device: torch.device | None = None) -> None:
    """Read `keys` (our names) again from the DiT checkpoint `path` into `tensors` (the
    model's own tensors by our names, e.g. lora.layers.official_tensors), with `merge` added.
    `quantization`: the weight_dtype that quantized the model's block matrices, or None.
    `config` is the model's: a file that no longer holds that model is refused first.
    `device`: where the block matrices are merged and quantized (read_quantized)."""
    from ..quant.schemes import SCHEMES

    plan, _ = prepare(open_checkpoint(path), ("dit",), "model loader")
    try:
        found = plan.info.config
        if replace(found, name=config.name) != config:
            raise CheckpointError(f"{path}: the file no longer holds the model loaded from it "
                                  f"(its shapes changed); load the model again")
        chosen = None if quantization is None else SCHEMES[quantization]
        with torch.no_grad():
            for key in keys:
                file_key = plan.key_map[key]
                if chosen is not None and is_block_linear(key) and key.endswith(".weight"):
                    stored = read_quantized(plan, key, file_key, chosen, merge, device)
                    tensors[key].copy_(stored.codes)
                    tensors[key[:-len("weight")] + "weight_scale"].copy_(stored.scales)
                    del stored
                else:
                    tensors[key].copy_(read_float(plan, key, file_key, merge))
    finally:
        plan.source.close()
