"""Text encoding node: positive and negative prompts to ComfyUI CONDITIONING."""

from __future__ import annotations

from ..pipeline.text import as_conditioning, encode_prompts
from .common import CATEGORY, memory_event, node_errors

# The negative prompt the official Wan pipelines use when none is given.
DEFAULT_NEGATIVE = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
    "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，"
    "形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")


class WanTextEncode:
    DISPLAY = "Wan Text Encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text_encoder": ("WANTEXTENCODER",),
            "positive": ("STRING", {"multiline": True, "default": ""}),
            "negative": ("STRING", {"multiline": True, "default": DEFAULT_NEGATIVE}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("positive", "negative")
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, text_encoder, positive, negative, unique_id=None):
        with node_errors(self.DISPLAY):
            pos, neg = encode_prompts(text_encoder, [positive, negative])
        memory_event("text encoded", "text_encode", unique_id)
        return (as_conditioning(pos), as_conditioning(neg))
