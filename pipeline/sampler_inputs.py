"""What the sampler takes from its LATENT and its two CONDITIONINGs, checked against the model:
the samples, the text rows, and the start image in whichever form it came (our LATENT keys from
Wan Image to Video Latent, or ComfyUI's from Wan22ImageToVideoLatent / WanImageToVideo; see
pipeline/contracts.py and pipeline/native_keys.py). Each form is checked as the denoise loop and
the model will take it; two forms of the same thing at once are refused."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.loop import checked_first_frame
from . import contracts as c
from . import native_keys as native
from .errors import InputError
from .handles import WanModelHandle


@dataclass(frozen=True)
class SamplerInputs:
    samples: torch.Tensor  # [B, C, T, H, W] raw VAE space
    cond: torch.Tensor  # [1, L, text_dim]
    uncond: torch.Tensor | None  # None when guidance does not need it
    fixed_frames: torch.Tensor | None  # [B or 1, C, k, H, W] raw, kept as they are (TI2V-5B)
    image_condition: torch.Tensor | None  # [B, 20, T, H, W] (I2V models)
    clip_tokens: torch.Tensor | None  # [B, tokens, 1280] (Wan2.1 I2V)


def gather_inputs(model: WanModelHandle, positive, negative, latent, needs_uncond: bool) \
        -> SamplerInputs:
    samples = c.check_latent(latent, model.latent_channels, model.name, model.vae_kind)
    fixed_frames = _fixed_frames(latent, samples, model)
    width = model.config.text_dim
    cond, cond_extra = native.conditioning_parts(positive, "positive", width)
    uncond, uncond_extra = (native.conditioning_parts(negative, "negative", width)
                            if needs_uncond else (None, None))
    native_condition, native_tokens = native.image_inputs(cond_extra, uncond_extra, samples,
                                                          model)
    return SamplerInputs(
        samples=samples, cond=cond, uncond=uncond,
        fixed_frames=fixed_frames,
        image_condition=_image_condition(latent, samples, model, native_condition),
        clip_tokens=_clip_tokens(latent, samples, model, native_tokens))


def _fixed_frames(latent: dict, samples: torch.Tensor, model: WanModelHandle):
    """Our first_frame, or the frames ComfyUI's noise_mask keeps; never both."""
    first = latent.get(c.FIRST_FRAME)
    from_mask = native.fixed_frames_from_mask(latent, samples, model)
    if first is None:
        return from_mask
    if latent.get(c.NOISE_MASK) is not None:
        raise InputError("latent: carries both a first_frame (Wan Image to Video Latent) and a "
                         "noise_mask (ComfyUI's latent nodes); give the start image once")
    try:
        return checked_first_frame(first, samples)
    except ValueError as error:
        raise InputError(f"latent: its {error}") from None


def _image_condition(latent: dict, samples: torch.Tensor, model: WanModelHandle,
                     from_conditioning: torch.Tensor | None) -> torch.Tensor | None:
    """The image-to-video models' extra channels: present exactly when the model has them."""
    wanted = model.config.in_dim - samples.shape[1]
    condition = latent.get(c.IMAGE_CONDITION)
    if condition is not None and from_conditioning is not None:
        raise InputError("latent: carries a start image (image_condition) and the positive "
                         "conditioning another one (concat_latent_image); give it once")
    if condition is None:
        condition = from_conditioning
    if wanted == 0:
        if condition is not None:
            raise InputError(f"latent: it carries a start image for an image-to-video model; "
                             f"{model.name} takes none")
        return None
    if condition is None:
        raise InputError(f"latent: {model.name} is an image-to-video model; give it the LATENT "
                         f"of Wan Image to Video Latent, or the conditioning of WanImageToVideo "
                         f"(its start image)")
    b, _, t, h, w = samples.shape
    if not isinstance(condition, torch.Tensor) or condition.dim() != 5 \
            or tuple(condition.shape[1:]) != (wanted, t, h, w) or condition.shape[0] not in (1, b):
        shape = list(condition.shape) if isinstance(condition, torch.Tensor) else \
            type(condition).__name__
        raise InputError(f"latent: its image_condition {shape} does not fit {model.name}; "
                         f"expected [{b}, {wanted}, {t}, {h}, {w}]")
    return c.batch_items(condition, b)


def _clip_tokens(latent: dict, samples: torch.Tensor, model: WanModelHandle,
                 from_conditioning: torch.Tensor | None) -> torch.Tensor | None:
    """The start image's CLIP tokens, present exactly when the model attends to them."""
    tokens = latent.get(c.CLIP_TOKENS)
    if tokens is not None and from_conditioning is not None:
        raise InputError("latent: carries clip_tokens and the positive conditioning a "
                         "clip_vision_output; give the image's CLIP encoding once")
    if tokens is None:
        tokens = from_conditioning
    if not model.config.image_embedding:
        if tokens is not None:
            raise InputError(f"latent: it carries CLIP image tokens; {model.name} does not "
                             f"attend to them (only Wan2.1 I2V-14B does)")
        return None
    b = samples.shape[0]
    if tokens is None:
        raise InputError(f"latent: {model.name} also attends to the start image's CLIP tokens; "
                         f"give Wan Image to Video Latent a clip_vision input (or "
                         f"WanImageToVideo a clip_vision_output)")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 3 \
            or tokens.shape[2] != model.config.image_dim or tokens.shape[0] not in (1, b):
        shape = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise InputError(f"latent: its clip_tokens {shape} do not fit {model.name}; expected "
                         f"[{b}, tokens, {model.config.image_dim}]")
    return c.batch_items(tokens, b)
