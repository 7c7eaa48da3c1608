"""Image-to-video: a start image as the video's first frame, in the form each model takes it.

The image is scaled to cover the video size and centre-cropped (as ComfyUI's "center" crop
does), then
- for Wan2.2 TI2V-5B, encoded by the Wan2.2 VAE as a one-frame video and carried in the LATENT as
  "first_frame" (raw VAE space, like "samples"). The sampler keeps that frame fixed: it is
  written into latent frame 0 before every model call and the model sees t = 0 for it
  (sampling/loop.py, `first_frame`);
- for the Wan2.2 I2V-A14B experts (36 input channels, no CLIP image tokens), made into a video of
  the image followed by mid-grey frames, encoded by the Wan2.1 VAE and normalised, and carried as
  "image_condition" [B, 20, T, h, w]: 4 mask channels (1 on latent frame 0, the frames the image
  gives) then the 16 latent channels. The sampler concatenates it to the model input at every
  step, as the official pipeline does.
Wan2.1 I2V-14B takes the same conditioning channels and also attends to the image's CLIP tokens
(wan/clip_vision.py), carried as "clip_tokens" [B, 257, 1280].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import host
from .decode import VAE_NAMES
from .handles import WanCLIPVisionHandle, WanModelHandle, WanVAEHandle
from .latents import empty_latent
from .placement import DevicePlacement
from .contracts import CLIP_TOKENS, FIRST_FRAME, IMAGE_CONDITION
from .errors import InputError

IMAGE_CONDITION_CHANNELS = 20  # 4 mask channels and 16 latent channels


def fit_image(image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """IMAGE [N, H, W, 3] in 0..1 -> [N, 3, height, width] in -1..1: scaled (bilinear, with
    antialiasing when shrinking) so that it covers the size, then centre-cropped."""
    h, w = image.shape[1:3]
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
                          height: int, frames: int, batch: int = 1, device=None,
                          clip_vision: WanCLIPVisionHandle | None = None) -> dict:
    """A LATENT for a video that starts with `image`: zero "samples" as empty_latent makes
    them, plus "first_frame" (TI2V-5B) or "image_condition" (the I2V models), and for Wan2.1
    I2V "clip_tokens"; see the module text."""
    config = model.config
    if config.image_embedding and clip_vision is None:
        raise InputError(f"clip_vision: {model.name} is a Wan2.1 image-to-video model, which "
                         f"also attends to the image's CLIP tokens: connect a Wan CLIP Vision "
                         f"Loader (clip_vision_h)")
    conditioned = config.in_dim - model.latent_channels == IMAGE_CONDITION_CHANNELS
    first_frame = model.keeps_first_frames  # TI2V-5B
    if not (first_frame or conditioned):
        raise InputError(f"model: {model.name} is a text-to-video model; a start image needs "
                         f"Wan2.2 TI2V-5B, a Wan2.2 I2V-A14B expert or Wan2.1 I2V-14B")
    if vae.kind != model.vae_kind:
        raise InputError(f"vae: {vae.name} is a {VAE_NAMES[vae.kind]}; {model.name} works with "
                         f"the {VAE_NAMES[model.vae_kind]}")
    latent = empty_latent(model, width, height, frames, batch)
    image = check_start_image(image, batch)
    pixels = fit_image(image, width, height).unsqueeze(2)  # [N, 3, 1, height, width]
    if conditioned:
        # the image, then mid-grey (0 in -1..1) for every frame still to be made
        pixels = torch.cat([pixels, pixels.new_zeros(*pixels.shape[:2], frames - 1,
                                                     *pixels.shape[3:])], dim=2)
    device = torch.device(device) if device is not None else host.compute_device()
    encoded = _per_item(_encode(vae, pixels, device), batch)
    samples = latent["samples"]
    expected = (batch, samples.shape[1], samples.shape[2] if conditioned else 1,
                *samples.shape[3:])
    if tuple(encoded.shape) != expected:
        raise InputError(f"vae: {vae.name} encodes {width}x{height} to {list(encoded.shape)}, "
                         f"which does not fit the model's latent {list(samples.shape)}")
    if first_frame:
        latent[FIRST_FRAME] = encoded
    else:
        latent[IMAGE_CONDITION] = torch.cat(
            [first_frame_mask(encoded), model.latent_format.normalise(encoded)], dim=1)
    if config.image_embedding:
        latent[CLIP_TOKENS] = _per_item(
            clip_image_tokens(clip_vision, image, config.image_dim, device), batch)
    return latent


def clip_image_tokens(clip_vision: WanCLIPVisionHandle, image: torch.Tensor, width: int,
                      device: torch.device) -> torch.Tensor:
    """[N, tokens, width] CLIP tokens of the start images (float32, CPU)."""
    encoder = clip_vision.model
    if encoder.config.hidden != width:
        raise InputError(f"clip_vision: {clip_vision.name} makes {encoder.config.hidden}-wide "
                         f"tokens; the model takes {width}-wide ones (ViT-H/14, clip_vision_h)")
    with DevicePlacement(device) as placement:
        placement.place(encoder)
        return encoder(encoder.preprocess(image).to(device)).to("cpu", torch.float32)


def _per_item(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """One entry per batch item: a single image's result repeated."""
    return tensor if tensor.shape[0] == batch else tensor.expand(batch, *tensor.shape[1:]).clone()


def first_frame_mask(latent: torch.Tensor) -> torch.Tensor:
    """[B, 4, T, h, w]: 1 on latent frame 0 (the four channels stand for the up to four video
    frames a latent frame covers; frame 0 covers the image alone), 0 on the frames to make."""
    b, _, t, h, w = latent.shape
    mask = torch.zeros(b, 4, t, h, w, dtype=torch.float32)
    mask[:, :, 0] = 1.0
    return mask


def _encode(vae: WanVAEHandle, pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Raw mu of a [N, 3, F, H, W] video in -1..1, float32 on the CPU."""
    with DevicePlacement(device) as placement:
        placement.place(vae.model)
        weight = next(vae.model.parameters())
        return vae.model.encode(pixels.to(device=weight.device, dtype=weight.dtype)).to(
            "cpu", torch.float32)
