"""Empty video latent node."""

from __future__ import annotations

from ..pipeline.latents import empty_latent
from .common import CATEGORY, node_errors


class WanEmptyLatent:
    DISPLAY = "Wan Empty Latent"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("WANMODEL",),
            "width": ("INT", {"default": 832, "min": 16, "max": 8192, "step": 16}),
            "height": ("INT", {"default": 480, "min": 16, "max": 8192, "step": 16}),
            "frames": ("INT", {"default": 81, "min": 1, "max": 4097, "step": 4,
                               "tooltip": "4n+1 frames"}),
            "batch": ("INT", {"default": 1, "min": 1, "max": 64}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = CATEGORY

    def make(self, model, width, height, frames, batch):
        with node_errors(self.DISPLAY):
            return (empty_latent(model, width, height, frames, batch),)
