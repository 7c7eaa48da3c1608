"""The LATENT and CONDITIONING contracts between nodes, in one place.

LATENT is ComfyUI's dict: "samples" [B, C, T, H, W] float32 on the CPU, raw VAE space (not
normalised). This package adds optional keys for image-to-video (pipeline/start_image.py):

    first_frame      [B or 1, C, k, H, W]   leading latent frames kept fixed (TI2V-5B), raw space
    image_condition  [B or 1, 20, T, H, W]  4 first-frame mask channels + 16 normalised latent
                                            channels (the I2V models' extra input channels)
    clip_tokens      [B or 1, 257, 1280]    the start image's CLIP tokens (Wan2.1 I2V-14B)

ComfyUI's own nodes add other keys: "noise_mask" (Wan22ImageToVideoLatent keeps its encoded
start image with it; Set Latent Noise Mask), "batch_index" (a slice of a larger batch: the noise
of those batch items), "type" (non-video latents, e.g. audio) and a few more. CONDITIONING is
ComfyUI's list of [rows [1, L, 4096], dict]; WanImageToVideo puts "concat_latent_image",
"concat_mask" and "clip_vision_output" into the dict, CLIPTextEncode "pooled_output" (None for
umT5) and, with encoders that return them, "attention_mask". pipeline/native_keys.py honours those with their ComfyUI meaning or refuses them by name;
`check_latent` refuses every key nobody honours, so nothing is ignored silently.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from .errors import InputError

__all__ = ["InputError", "Latent", "check_latent", "unknown_keys"]

# -- LATENT keys: ours -------------------------------------------------------------------------
SAMPLES = "samples"
FIRST_FRAME = "first_frame"
IMAGE_CONDITION = "image_condition"
CLIP_TOKENS = "clip_tokens"
OUR_LATENT_KEYS = (SAMPLES, FIRST_FRAME, IMAGE_CONDITION, CLIP_TOKENS)

# -- LATENT keys: ComfyUI's --------------------------------------------------------------------
NOISE_MASK = "noise_mask"
BATCH_INDEX = "batch_index"
LATENT_TYPE = "type"
DOWNSCALE_RATIO = "downscale_ratio_spacial"  # sic, ComfyUI's spelling
COMFY_LATENT_KEYS = (NOISE_MASK, BATCH_INDEX, LATENT_TYPE, DOWNSCALE_RATIO)

# -- CONDITIONING dict keys: ComfyUI's ---------------------------------------------------------
POOLED_OUTPUT = "pooled_output"
CONCAT_LATENT_IMAGE = "concat_latent_image"
CONCAT_MASK = "concat_mask"
CONCAT_MASK_INDEX = "concat_mask_index"
CLIP_VISION_OUTPUT = "clip_vision_output"
PENULTIMATE = "penultimate_hidden_states"  # the field of a clip_vision_output Wan reads
ATTENTION_MASK = "attention_mask"  # [1, L]: 1 on the prompt's rows
HONOURED_CONDITIONING_KEYS = (POOLED_OUTPUT, CONCAT_LATENT_IMAGE, CONCAT_MASK, CONCAT_MASK_INDEX,
                              CLIP_VISION_OUTPUT, ATTENTION_MASK)
# What ComfyUI's other conditioning nodes set, with the node that sets it: named when refused.
KNOWN_CONDITIONING_KEYS = {
    "area": "ConditioningSetArea", "strength": "ConditioningSetAreaStrength",
    "mask": "ConditioningSetMask", "set_area_to_bounds": "ConditioningSetMask",
    "mask_strength": "ConditioningSetMask", "start_percent": "ConditioningSetTimestepRange",
    "end_percent": "ConditioningSetTimestepRange", "control": "ControlNetApply",
    "gligen": "GLIGENTextBoxApply", "hooks": "hook nodes", "reference_latents":
    "ReferenceLatent", "time_dim_concat": "Wan video-to-video nodes", "guidance":
    "FluxGuidance", "vace_frames":
    "WanVaceToVideo", "camera_conditions": "WanCameraImageToVideo",
}


class Latent(TypedDict, total=False):
    """A LATENT as this package makes and reads it (see the module text)."""

    samples: torch.Tensor
    first_frame: torch.Tensor
    image_condition: torch.Tensor
    clip_tokens: torch.Tensor
    noise_mask: torch.Tensor
    batch_index: list[int]


def check_latent(latent: Any, channels: int, model_name: str, vae_name: str,
                 field: str = "latent") -> torch.Tensor:
    """The LATENT's samples [B, C, T, H, W] with `channels` channels; InputError naming the
    field otherwise, and for a key no stage of this package knows."""
    samples = latent.get(SAMPLES) if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.dim() != 5:
        raise InputError(f"{field}: expected a video LATENT {{'samples': [B, C, T, H, W]}}")
    kind = latent.get(LATENT_TYPE)
    if kind is not None:
        raise InputError(f"{field}: a LATENT of type {kind!r} is not a video latent of a Wan "
                         f"model")
    unknown = unknown_keys(latent)
    if unknown:
        raise InputError(f"{field}: carries {', '.join(map(repr, unknown))}, which no Wan "
                         f"Enhanced node knows; the keys it takes: "
                         f"{', '.join(OUR_LATENT_KEYS + (NOISE_MASK, BATCH_INDEX))}")
    if latent.get(DOWNSCALE_RATIO) not in (None, 8, 16):
        raise InputError(f"{field}: its {DOWNSCALE_RATIO} {latent[DOWNSCALE_RATIO]} is not a "
                         f"Wan VAE's (8 or 16)")
    if samples.shape[1] != channels:
        raise InputError(f"{field}: the latent has {samples.shape[1]} channels; {model_name} "
                         f"works on {channels}-channel latents ({vae_name} VAE)")
    return samples


def unknown_keys(latent: dict) -> list[str]:
    return sorted(str(k) for k in latent if k not in OUR_LATENT_KEYS + COMFY_LATENT_KEYS)


def batch_items(value: torch.Tensor, batch: int) -> torch.Tensor:
    """A per-item tensor given once (batch 1) or once per item, as [batch, ...]."""
    return value if value.shape[0] == batch else value.expand(batch, *value.shape[1:])
