"""LoRA module names resolved to the model's own parameter names (the official Wan names).

A module name as a LoRA file writes it is resolved in this order:
  kohya / musubi   `lora_unet_blocks_0_self_attn_q` (Wan Fun: `lora_unet__blocks_...`): the
                   official name with dots written as underscores, looked up among the model's
                   weights, as ComfyUI does;
  LyCORIS          `lycoris_blocks_0_self_attn_q` (SimpleTuner, ai-toolkit): the official or
                   diffusers' name (`lycoris_blocks_0_attn1_to_q`) with underscores;
  generic / PEFT   the official name (`blocks.0.self_attn.q`), after one known prefix
                   (`diffusion_model.`, `model.diffusion_model.`, `base_model.model.`,
                   `transformer.`) if present;
  diffusers        diffusers' names (`blocks.0.attn1.to_q`, `blocks.0.ffn.net.0.proj`,
                   `proj_out`, `condition_embedder.*`, `scale_shift_table`), through the DiT
                   key map the checkpoint loader uses (checkpoints/keymaps.py).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch

from ..checkpoints.keymaps import dit_diffusers_to_ours, dit_ours_to_diffusers
from ..wan.configs import DiTConfig

KOHYA_PREFIX = "lora_unet_"
LYCORIS_PREFIX = "lycoris_"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.")


@functools.lru_cache(maxsize=8)
def dit_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a WanDiT of `config` with its shape (built on the meta device)."""
    from ..wan.dit import WanDiT

    with torch.device("meta"):
        model = WanDiT(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class ModelNames:
    """Resolves LoRA module names against one model's parameter names."""

    def __init__(self, keys: Iterable[str]):
        self.keys = frozenset(keys)
        modules = [k[:-len(".weight")] for k in self.keys if k.endswith(".weight")]
        self._kohya = {m.replace(".", "_"): m for m in modules}
        self._lycoris = dict(self._kohya)
        for module in modules:
            theirs = dit_ours_to_diffusers(f"{module}.weight")
            if theirs is not None:
                self._lycoris.setdefault(theirs[:-len(".weight")].replace(".", "_"), module)

    def module(self, name: str) -> tuple[str, str] | None:
        """(our module or parameter name, the naming style) for a LoRA module name, or None
        when it names nothing of this model."""
        if name.startswith(KOHYA_PREFIX):
            rest = name[len(KOHYA_PREFIX):]
            found = self._kohya.get(rest[1:] if rest.startswith("_") else rest)
            return None if found is None else (found, "kohya")
        if name.startswith(LYCORIS_PREFIX):
            found = self._lycoris.get(name[len(LYCORIS_PREFIX):])
            return None if found is None else (found, "lycoris")
        bare = next((name[len(p):] for p in PREFIXES if name.startswith(p)), name)
        if f"{bare}.weight" in self.keys or bare in self.keys:
            return bare, "generic"
        mapped = dit_diffusers_to_ours(f"{bare}.weight")
        if mapped is not None and mapped in self.keys:
            return mapped[:-len(".weight")], "diffusers"
        mapped = dit_diffusers_to_ours(bare)
        if mapped is not None and mapped in self.keys:
            return mapped, "diffusers"
        return None

    def target(self, module: str, role: str) -> str | None:
        """The parameter a key of `role` on our `module` changes: its weight (a plain parameter
        such as `blocks.0.modulation` for full differences), or its bias for `.diff_b`."""
        if role == "diff_b":
            return f"{module}.bias" if f"{module}.bias" in self.keys else None
        if f"{module}.weight" in self.keys:
            return f"{module}.weight"
        return module if role == "diff" and module in self.keys else None
