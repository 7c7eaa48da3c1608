"""Empty video latents of the right shape for a model, with sizes checked up front."""

from __future__ import annotations

import torch

from .handles import WanModelHandle
from ..wan.configs import TEMPORAL_STRIDE
from .errors import InputError



def _nearest_multiples(value: int, step: int) -> str:
    low = max(step, value // step * step)
    high = low + step if low < value else low
    return f"{low}" if low == high else f"{low} or {high}"


def check_video_size(width: int, height: int, frames: int, stride: int) -> None:
    """Frames must be 4n+1 and width/height multiples of the model's pixel stride."""
    problems = []
    for name, value in (("width", width), ("height", height)):
        if value < stride or value % stride:
            problems.append(f"{name} {value} is not a multiple of {stride} "
                            f"(nearest valid: {_nearest_multiples(value, stride)})")
    if frames < 1 or (frames - 1) % TEMPORAL_STRIDE:
        below = max(1, (frames - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1)
        above = below + TEMPORAL_STRIDE
        problems.append(f"frames {frames} is not of the form 4n+1 (nearest valid: "
                        f"{below if frames < 1 else f'{below} or {above}'})")
    if problems:
        raise InputError("; ".join(problems))


def empty_latent(model: WanModelHandle, width: int, height: int, frames: int,
                 batch: int = 1) -> dict:
    """A zero LATENT (raw VAE space, float32, CPU) for a video of the given pixel size."""
    stride = model.spatial_stride
    check_video_size(width, height, frames, stride)
    if batch < 1:
        raise InputError(f"batch {batch} must be at least 1")
    from .memory_guard import VideoSize, check_latent
    check_latent(VideoSize(width, height, frames, batch), model.vae_kind, stride)
    vae_stride = stride // model.config.patch_size[1]
    shape = (batch, model.latent_channels, (frames - 1) // TEMPORAL_STRIDE + 1,
             height // vae_stride, width // vae_stride)
    return {"samples": torch.zeros(shape, dtype=torch.float32)}
