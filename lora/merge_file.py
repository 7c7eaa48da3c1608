"""A DiT checkpoint with LoRAs merged in, written as a new file in the checkpoint's own layout.

Every tensor keeps its key, dtype and shape (a ComfyUI-prefixed float32 file stays a
ComfyUI-prefixed float32 file; fp8-scaled files keep their scales and markers) and the file's
metadata is kept. The tensors stream one at a time: read, merged in float32 when a LoRA
touches them (checkpoints/loader.read_float: exactly the merge the model loader does), converted
back to the stored dtype and written to their place. The output appears complete or not at all.

fp8 weights are encoded again with their scale, raised where the merged weight would exceed
the fp8 range (a per-tensor `scale_weight` becomes max(old, amax / 448)); fp8 weights without a
scale are clipped to the fp8 range, as such files are made.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..atomic_files import atomic_target
from ..checkpoints.loader import prepare, read_float
from ..checkpoints.reader import CheckpointError, open_checkpoint
from ..checkpoints.writer import SafetensorsWriter
from .file import LoraFile, open_lora
from .keymap import dit_shapes
from .merge import Merge

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class MergeReport:
    out: Path
    tensors: int = 0
    changed: list[str] = field(default_factory=list)  # file keys rewritten
    rescaled: list[str] = field(default_factory=list)  # fp8 scales raised
    loras: list[str] = field(default_factory=list)  # each LoRA's summary


def merge_file(model: str | Path, loras: list[tuple[Path, float]], out: str | Path
               ) -> MergeReport:
    """Write `model` with `loras` [(file, strength), ...] merged to `out` (.safetensors)."""
    model, out = Path(model), Path(out)
    if out.suffix != ".safetensors":
        raise CheckpointError(f"{out}: the merged model is written as .safetensors; give --out a "
                              f"name ending in .safetensors")
    if out.exists() and model.exists() and os.path.samefile(out, model):
        raise CheckpointError(f"{out}: is the model being read; write the merged model to "
                              f"another file")
    plan, _ = prepare(open_checkpoint(model), ("dit",), "`lora merge` command")
    opened: list[LoraFile] = []
    try:
        shapes = dit_shapes(plan.info.config)
        for path, strength in loras:
            opened.append(open_lora(path, shapes))
        merge = Merge.of(list(zip(opened, [s for _, s in loras])))
        report = MergeReport(out, loras=[lora.summary() for lora in opened])
        applied = [{"file": Path(path).name, "strength": s} for path, s in loras]
        with atomic_target(out, f"the merged model {out.name}") as temp:
            with open(temp, "wb") as file:
                _write(plan, merge, file, report, {"lora_merged": json.dumps(applied)})
                file.flush()
                os.fsync(file.fileno())
        return report
    finally:
        for lora in opened:
            lora.close()
        plan.source.close()


def _write(plan, merge: Merge, file, report: MergeReport, note: dict[str, str]) -> None:
    source = plan.source
    keys = source.keys()
    ours_of = {file_key: ours for ours, file_key in plan.key_map.items()}
    touched_scales = {plan.scales[o]: o for o in plan.scales if merge.touches(o)}
    _check_encodable(plan, merge)
    entries = [(k, source.dtype(k), tuple(source.shape(k))) for k in keys]
    writer = SafetensorsWriter(file, entries, {**source.metadata, **note})
    for key in keys:
        if key in touched_scales:
            continue  # written with its weight
        ours = ours_of.get(key)
        if ours is None or not merge.touches(ours):
            writer.write(key, source.read(key))
        else:
            _write_merged(plan, merge, writer, key, ours, report)
        report.tensors += 1
    writer.finish()
    report.tensors += len(touched_scales)


def _check_encodable(plan, merge: Merge) -> None:
    """Refuse, before writing, a merge into weights this command cannot encode again: ComfyUI's
    block-scaled (mxfp8, nvfp4) and int8 layers."""
    for ours, key in plan.key_map.items():
        if not merge.touches(ours):
            continue
        layer = plan.dequantized.get(ours)
        dtype = plan.source.dtype(key)
        if layer is not None or not dtype.is_floating_point:
            stored = layer.label if layer is not None else str(dtype).removeprefix("torch.")
            raise CheckpointError(
                f"{plan.info.path}: a LoRA changes {key}, stored as {stored}; `lora merge` "
                f"writes float and fp8-scaled weights only: load the LoRA with the model instead "
                f"(the loader merges it before quantizing)")


def _write_merged(plan, merge: Merge, writer: SafetensorsWriter, key: str, ours: str,
                  report: MergeReport) -> None:
    source = plan.source
    dtype = source.dtype(key)
    weight = read_float(plan, ours, key, merge)
    report.changed.append(key)
    if dtype not in FP8:
        writer.write(key, weight.to(dtype))
        return
    limit = torch.finfo(dtype).max
    scale_key = plan.scales.get(ours)
    if scale_key is None:
        writer.write(key, weight.clamp_(-limit, limit).to(dtype))
        return
    old = source.read(scale_key)
    rows = old.float().reshape(-1, *([1] * (weight.dim() - 1)))
    needed = (weight.abs().amax() if rows.numel() == 1 else
              weight.abs().flatten(1).amax(1).reshape(rows.shape)) / limit
    scale = torch.maximum(rows, needed)
    if not torch.equal(scale, rows):
        report.rescaled.append(scale_key)
    writer.write(key, (weight / scale).clamp_(-limit, limit).to(dtype))
    writer.write(scale_key, scale.reshape(old.shape).to(old.dtype))
