"""The LoRA loader node: a model handle with one more LoRA (chainable)."""

from __future__ import annotations

from .. import host
from ..lora.apply import MODES
from ..pipeline.lora import with_lora
from ..pipeline.model_files import loader_file_problem
from .checks import constant_problems, verdict
from .common import CATEGORY, memory_event, node_errors
from .loaders import HIDDEN, _file_choice

MODE = ("merge: the LoRA is added into the weights when the model next computes, before any "
        "fp8/int8 quantization: no cost per step. unmerged: kept apart and added by the "
        "transformer blocks at run time (a few percent per step): another strength or LoRA "
        "costs no reload of the weights, and fp8 files stay as stored")


class WanLoRALoader:
    DISPLAY = "Wan LoRA Loader"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("WANMODEL", {"tooltip": "a Wan model, or the output of another LoRA "
                                              "loader (for Wan2.2 A14B: one chain per expert)"}),
            "lora_name": _file_choice("loras"),
            "strength": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01,
                                   "tooltip": "0 skips the LoRA"}),
            "mode": (list(MODES), {"default": "merge", "tooltip": MODE}),
        }, "hidden": HIDDEN}

    RETURN_TYPES = ("WANMODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name, strength):
        # `mode` is left to ComfyUI's choice check, which files its error under `mode`: a
        # verdict is filed under every input named here
        return verdict([loader_file_problem("loras", lora_name, "lora_name"),
                        *constant_problems(cls, strength=strength)])

    def load(self, model, lora_name, strength, mode="merge", unique_id=None):
        with node_errors(self.DISPLAY):
            handle = with_lora(model, host.resolve_model("loras", lora_name), strength, mode)
        label = (f"LoRA {lora_name} skipped (strength 0)" if handle is model else
                 f"LoRA {lora_name} at {strength} ({mode})")
        # (no component size: the weights change when the model computes, not here)
        memory_event(label, "load", unique_id, lora=lora_name, strength=strength, mode=mode)
        return (handle,)
