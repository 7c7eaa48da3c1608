"""Our attention kernels for ComfyUI's own Wan models: MODEL in, MODEL out."""

from __future__ import annotations

from .. import host
from ..pipeline.errors import InputError
from ..pipeline.native_attention import MODES, NativeAttention
from .common import CATEGORY, node_errors

MODE = ("auto: our fp8 attention kernel where the GPU runs it, else our exact Hopper kernel, "
        "else ComfyUI's own; fp8: our fp8 kernel (lossy; its error bound: docs/measured.md); "
        "bf16: our exact Hopper kernel. Calls a kernel cannot take exactly (a mask, another "
        "head size, text cross-attention, a CPU) go to ComfyUI's own attention, said once in "
        "the log")


class WanAttentionPatch:
    DISPLAY = "Wan Enhanced Attention"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "one of ComfyUI's own Wan models (from Load "
                                           "Diffusion Model, after its LoRA loaders or not)"}),
            "mode": (list(MODES), {"default": "auto", "tooltip": MODE}),
        }}

    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Routes a native Wan model's attention (self, cross, image, VACE, S2V) to "
                   "this package's kernels; composes with ComfyUI's LoRAs, caches, offloading "
                   "and compile nodes")

    def patch(self, model, mode="auto"):
        with node_errors(self.DISPLAY):
            problem = host.native_wan_problem(model)
            if problem is not None:
                raise InputError(f"model: expected one of ComfyUI's Wan models, got {problem}")
            if mode not in MODES:
                raise InputError(f"mode: {mode!r} is not one of {list(MODES)}")
            patched = host.with_attention_override(
                model, lambda inner: NativeAttention(mode, inner))
        return (patched,)
