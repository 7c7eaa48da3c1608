"""Image-to-video with Wan2.2 TI2V-5B: a start image as the video's fixed first latent frame.

The image is scaled to cover the video size and centre-cropped (as ComfyUI's "center" crop
does), encoded by the Wan2.2 VAE as a one-frame video, and carried in the LATENT as
"first_frame" (raw VAE space, like "samples"). The sampler keeps that frame fixed: it is written
into latent frame 0 before every model call and the model sees t = 0 for it, which is how the
model was trained to take an image (sampling/loop.py, `first_frame`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import host
from .handles import WanModelHandle, WanVAEHandle
from .latents import empty_latent
from .placement import DevicePlacement
from .sample import InputError


def fit_image(image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """IMAGE [N, H, W, 3] in 0..1 -> [N, 3, height, width] in -1..1: scaled (bilinear, with
    antialiasing when shrinking) so that it covers the size, then centre-cropped."""
    n, h, w, _ = image.shape
    scale = max(width / w, height / h)
    covered = (max(height, round(h * scale)), max(width, round(w * scale)))
    x = image.permute(0, 3, 1, 2).to(torch.float32)
    if covered != (h, w):
        x = F.interpolate(x, size=covered, mode="bilinear", align_corners=False,
                          antialias=scale < 1)
    top, left = (covered[0] - height) // 2, (covered[1] - width) // 2
    x = x[:, :, top:top + height, left:left + width]
    return x.clamp(0, 1).mul(2).sub(1)


def check_start_image(image, batch: int) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] != 3:
        shape = list(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise InputError(f"start_image: expected an IMAGE [N, H, W, 3], got {shape}")
    if image.shape[0] not in (1, batch):
        raise InputError(f"start_image: {image.shape[0]} images for a batch of {batch}; give "
                         f"one image, or one per batch item")
    if min(image.shape[1:3]) < 1:
        raise InputError(f"start_image: is empty ({list(image.shape)})")
    return image


def image_to_video_latent(model: WanModelHandle, vae: WanVAEHandle, image, width: int,
                          height: int, frames: int, batch: int = 1, device=None) -> dict:
    """A LATENT for a video whose first frame is `image`: zero "samples" as empty_latent makes
    them, plus "first_frame" [batch, 48, 1, h, w], the encoded image (raw VAE space, CPU)."""
    if model.latent_channels != 48:
        raise InputError(f"model: {model.name} is not a Wan2.2 TI2V model; a start image as the "
                         f"first frame is how TI2V-5B takes an image (Wan2.1 and A14B models "
                         f"have image-to-video checkpoints of their own)")
    if vae.kind != "vae22":
        raise InputError(f"vae: {vae.name} is a Wan2.1 VAE; TI2V-5B latents come from the "
                         f"Wan2.2 VAE")
    latent = empty_latent(model, width, height, frames, batch)
    image = check_start_image(image, batch)
    pixels = fit_image(image, width, height)  # [N, 3, height, width]
    device = torch.device(device) if device is not None else host.compute_device()
    with DevicePlacement(device) as placement:
        placement.place(vae.model)
        weight = next(vae.model.parameters())
        video = pixels.unsqueeze(2).to(device=weight.device, dtype=weight.dtype)
        first = vae.model.encode(video).to("cpu", torch.float32)
    if first.shape[0] != batch:
        first = first.expand(batch, -1, -1, -1, -1).clone()
    expected = (batch, 48, 1, *latent["samples"].shape[3:])
    if tuple(first.shape) != expected:  # a VAE of another stride than the model's
        raise InputError(f"vae: {vae.name} encodes {width}x{height} to {list(first.shape)}, "
                         f"not the model's latent {list(expected)}")
    latent["first_frame"] = first
    return latent
