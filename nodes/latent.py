"""Latent nodes: an empty video latent, and one that starts from an image."""

from __future__ import annotations

from ..pipeline.latents import empty_latent
from ..pipeline.start_image import image_to_video_latent
from .checks import constant_problems, verdict, video_memory_problem, video_size_problems
from .common import CATEGORY, memory_event, node_errors

VIDEO_SIZE = {
    "width": ("INT", {"default": 1280, "min": 16, "max": 8192, "step": 16}),
    "height": ("INT", {"default": 704, "min": 16, "max": 8192, "step": 16}),
    "frames": ("INT", {"default": 121, "min": 1, "max": 4097, "step": 4, "tooltip": "4n+1 frames"}),
    "batch": ("INT", {"default": 1, "min": 1, "max": 64}),
}


def _video_size_verdict(cls, width, height, frames, batch):
    """In range, frames 4n+1, sides multiples of 16, and frames that fit this machine's memory,
    decided before any model loads."""
    problems = constant_problems(cls, width=width, height=height, frames=frames, batch=batch)
    problems = problems or video_size_problems(width, height, frames)
    return verdict(problems or [video_memory_problem(width, height, frames, batch)])


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

    @classmethod
    def VALIDATE_INPUTS(cls, width, height, frames, batch):
        return _video_size_verdict(cls, width, height, frames, batch)

    def make(self, model, width, height, frames, batch):
        with node_errors(self.DISPLAY):
            return (empty_latent(model, width, height, frames, batch),)


class WanImageToVideoLatent:
    DISPLAY = "Wan Image to Video Latent"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("WANMODEL", {"tooltip": "Wan2.2 TI2V-5B, a Wan2.2 I2V-A14B expert or "
                                              "Wan2.1 I2V-14B"}),
            "vae": ("WANVAE", {"tooltip": "the model's VAE (Wan2.2 for TI2V-5B, else Wan2.1)"}),
            "start_image": ("IMAGE", {"tooltip": "the video's first frame: scaled to cover the "
                                                 "size and centre-cropped"}),
            **VIDEO_SIZE,
        }, "optional": {
            "clip_vision": ("WANCLIPVISION", {"tooltip": "Wan2.1 image-to-video models: the CLIP "
                                                         "image encoder (clip_vision_h)"}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, width, height, frames, batch):
        return _video_size_verdict(cls, width, height, frames, batch)

    def make(self, model, vae, start_image, width, height, frames, batch, clip_vision=None,
             unique_id=None):
        with node_errors(self.DISPLAY):
            latent = image_to_video_latent(model, vae, start_image, width, height, frames, batch,
                                           clip_vision=clip_vision)
        memory_event("start image encoded", "image_encode", unique_id)
        return (latent,)
