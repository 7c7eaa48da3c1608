"""ComfyUI's own LATENT and CONDITIONING keys, with the meaning ComfyUI gives them, turned into
what the sampler takes (pipeline/contracts.py lists the keys); what has no such meaning for a
Wan model is refused by name.

- LATENT "noise_mask" (Wan22ImageToVideoLatent: 0 on the encoded start image's latent frames,
  1 elsewhere). For Wan2.2 TI2V-5B ComfyUI keeps those frames as they are and gives them t = 0
  (model_base.WAN22): the same as our fixed first frames. A mask that is all ones changes
  nothing. Other masks (partial frames, regions, soft values) and masks for the models that
  take one timestep for all frames are refused.
- LATENT "batch_index": the items are these indices of a larger batch, so each gets the noise
  that index gets from the seed (ComfyUI's prepare_noise).
- CONDITIONING "concat_latent_image" / "concat_mask" (WanImageToVideo): the image-to-video
  models' 20 extra input channels, as model_base.WAN21.concat_cond builds them: 4 channels of
  1 - concat_mask, then the image latent normalised.
- CONDITIONING "clip_vision_output" (WanImageToVideo, from CLIPVisionEncode): its
  penultimate_hidden_states are the CLIP tokens Wan2.1 I2V-14B attends to.
- CONDITIONING "pooled_output": None from CLIPTextEncode with umT5; Wan takes no pooled vector.
- CONDITIONING "attention_mask" [1, L]: the rows outside it are set to zero, the padding the
  official models were trained with (Wan's cross-attention takes no mask).
"""

from __future__ import annotations

import torch

from ..sampling.noise import make_noise
from . import contracts as c
from .errors import InputError
from .handles import WanModelHandle

IMAGE_MASK_CHANNELS = 4


# -- CONDITIONING ------------------------------------------------------------------------------

def conditioning_parts(conditioning, field: str, width: int) -> tuple[torch.Tensor, dict]:
    """(text rows [1, L, width], the entry's dict) of a CONDITIONING of one entry; InputError
    for another form, several entries, or a key this sampler does not apply."""
    try:
        rows, extra = conditioning[0][0], conditioning[0][1]
    except (TypeError, IndexError, KeyError):
        raise InputError(f"{field}: expected CONDITIONING ([[tensor, dict]]), got "
                         f"{type(conditioning).__name__}") from None
    if len(conditioning) != 1:
        raise InputError(f"{field}: {len(conditioning)} conditionings (Conditioning Combine?); "
                         f"the Wan Sampler takes one per input")
    if not isinstance(rows, torch.Tensor) or rows.dim() != 3:
        raise InputError(f"{field}: expected conditioning rows [1, L, {width}], got "
                         f"{getattr(rows, 'shape', type(rows).__name__)}")
    if rows.shape[-1] != width:
        raise InputError(f"{field}: conditioning of width {rows.shape[-1]}; this model takes "
                         f"text rows of width {width} (umT5-xxl; was another text encoder used?)")
    extra = extra if isinstance(extra, dict) else {}
    for key, value in extra.items():
        if key in c.HONOURED_CONDITIONING_KEYS or value is None:
            continue
        source = c.KNOWN_CONDITIONING_KEYS.get(key)
        raise InputError(f"{field}: carries {key!r}" + (f" (set by {source})" if source else "")
                         + ", which the Wan Sampler does not apply; use ComfyUI's own sampler "
                           "for it, or leave that node out")
    if extra.get(c.POOLED_OUTPUT) is not None:
        raise InputError(f"{field}: carries a pooled_output; Wan models take no pooled text "
                         f"vector (umT5 makes none: was another text encoder used?)")
    return _masked_rows(rows, extra.get(c.ATTENTION_MASK), field), extra


def _masked_rows(rows: torch.Tensor, mask, field: str) -> torch.Tensor:
    if mask is None:
        return rows
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or \
            tuple(mask.shape) != tuple(rows.shape[:2]):
        raise InputError(f"{field}: its attention_mask {_shape(mask)} does not fit its rows "
                         f"{list(rows.shape)}")
    return rows * (mask.to(rows.device) != 0).to(rows.dtype)[..., None]


def image_inputs(positive: dict, negative: dict | None, samples: torch.Tensor,
                 model: WanModelHandle) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(image_condition, clip_tokens) from WanImageToVideo's conditioning keys, or Nones. The
    negative conditioning must carry the same (WanImageToVideo sets both alike)."""
    condition = _concat_channels(positive, samples, model)
    tokens = _clip_tokens(positive, samples, model)
    if negative is not None:
        for key in (c.CONCAT_LATENT_IMAGE, c.CONCAT_MASK, c.CLIP_VISION_OUTPUT):
            if not _same(positive.get(key), negative.get(key)):
                raise InputError(f"negative: its {key} differs from the positive one's; the Wan "
                                 f"Sampler takes one start image for both (connect both from "
                                 f"the same WanImageToVideo)")
    return condition, tokens


def _concat_channels(extra: dict, samples: torch.Tensor, model: WanModelHandle):
    image, mask = extra.get(c.CONCAT_LATENT_IMAGE), extra.get(c.CONCAT_MASK)
    if image is None:
        if mask is not None:
            raise InputError("positive: carries a concat_mask without a concat_latent_image")
        return None
    wanted = model.config.in_dim - samples.shape[1]
    if wanted != IMAGE_MASK_CHANNELS + model.latent_channels:
        raise InputError(f"positive: carries a start image (concat_latent_image, from "
                         f"WanImageToVideo), but {model.name} has no image input channels "
                         f"(Wan2.2 TI2V-5B takes its start image through the LATENT: "
                         f"Wan22ImageToVideoLatent or Wan Image to Video Latent)")
    if extra.get(c.CONCAT_MASK_INDEX, 0) not in (0, None):
        raise InputError("positive: a concat_mask_index other than 0 is not a Wan "
                         "image-to-video layout")
    b, _, t, h, w = samples.shape
    if not isinstance(image, torch.Tensor) or image.dim() != 5 or \
            tuple(image.shape[1:]) != (model.latent_channels, t, h, w) or image.shape[0] not in (1, b):
        raise InputError(f"positive: its concat_latent_image {_shape(image)} does not fit the "
                         f"latent {list(samples.shape)}: expected [{b}, {model.latent_channels}, "
                         f"{t}, {h}, {w}] (the same width, height and length in WanImageToVideo)")
    latent = model.latent_format.normalise(image.to(torch.float32).cpu())
    return c.batch_items(torch.cat([_mask_channels(mask, image), latent], dim=1), b)


def _mask_channels(mask, image: torch.Tensor) -> torch.Tensor:
    """4 channels of 1 - concat_mask (1 where the image is given), frames past the mask 0;
    no mask: zeros, as in ComfyUI."""
    n, _, t, h, w = image.shape
    if mask is None:
        return torch.zeros(n, IMAGE_MASK_CHANNELS, t, h, w)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 5 or tuple(mask.shape[3:]) != (h, w) \
            or mask.shape[2] > t or mask.shape[0] not in (1, n):
        raise InputError(f"positive: its concat_mask {_shape(mask)} does not fit its "
                         f"concat_latent_image {list(image.shape)}")
    mask = mask.to(torch.float32).cpu()
    if mask.shape[1] != IMAGE_MASK_CHANNELS:
        mask = mask.mean(dim=1, keepdim=True).expand(-1, IMAGE_MASK_CHANNELS, -1, -1, -1)
    given = 1.0 - mask
    if given.shape[2] < t:
        given = torch.nn.functional.pad(given, (0, 0, 0, 0, 0, t - given.shape[2]))
    return c.batch_items(given, n)


def _clip_tokens(extra: dict, samples: torch.Tensor, model: WanModelHandle):
    output = extra.get(c.CLIP_VISION_OUTPUT)
    if output is None:
        return None
    if not model.config.image_embedding:
        raise InputError(f"positive: carries a clip_vision_output; {model.name} does not attend "
                         f"to CLIP image tokens (only Wan2.1 I2V-14B does)")
    tokens = getattr(output, c.PENULTIMATE, None)
    if tokens is None and isinstance(output, dict):
        tokens = output.get(c.PENULTIMATE)
    b = samples.shape[0]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 3 or \
            tokens.shape[2] != model.config.image_dim or tokens.shape[0] not in (1, b):
        raise InputError(f"positive: its clip_vision_output's penultimate_hidden_states "
                         f"{_shape(tokens)} do not fit {model.name}: expected [{b}, tokens, "
                         f"{model.config.image_dim}] (CLIP ViT-H/14, clip_vision_h)")
    return c.batch_items(tokens.to(torch.float32).cpu(), b)


# -- LATENT ------------------------------------------------------------------------------------

def fixed_frames_from_mask(latent: dict, samples: torch.Tensor,
                           model: WanModelHandle) -> torch.Tensor | None:
    """The leading latent frames a noise_mask keeps (raw space, [B, C, k, H, W]), None when it
    keeps none; InputError for a mask of another meaning."""
    mask = latent.get(c.NOISE_MASK)
    if mask is None:
        return None
    b, _, t, h, w = samples.shape
    if not isinstance(mask, torch.Tensor) or mask.dim() != 5 or mask.shape[2] != t \
            or tuple(mask.shape[3:]) != (h, w) or mask.shape[0] not in (1, b):
        raise InputError(f"latent: its noise_mask {_shape(mask)} is not a mask per latent frame "
                         f"[{b}, 1, {t}, {h}, {w}] (the Wan Sampler takes the start-frame mask "
                         f"of Wan22ImageToVideoLatent, not region masks)")
    per_frame = mask.to(torch.float32).amax(dim=(1, 3, 4))
    if not torch.equal(per_frame, mask.to(torch.float32).amin(dim=(1, 3, 4))) or \
            not bool(((per_frame == 0) | (per_frame == 1)).all()):
        raise InputError("latent: its noise_mask is not 0 or 1 over whole latent frames; the "
                         "Wan Sampler keeps whole frames (Wan22ImageToVideoLatent's start "
                         "image), it does not inpaint regions")
    kept = per_frame[0] == 0
    count = int(kept.sum())
    if not torch.equal(per_frame, per_frame[:1].expand_as(per_frame)) or \
            bool(kept[count:].any()) or count == t:
        raise InputError("latent: its noise_mask must keep the same leading latent frames of "
                         "every item and leave at least one frame to generate")
    if count == 0:
        return None
    if not model.keeps_first_frames:
        raise InputError(f"latent: its noise_mask keeps the first {count} latent frame(s); "
                         f"{model.name} takes one timestep for all frames, so it cannot keep "
                         f"frames as ComfyUI does for Wan2.2 TI2V-5B: give it the start image "
                         f"through Wan Image to Video Latent or WanImageToVideo")
    return samples[:, :, :count].clone()


def noise_for(latent: dict, shape, seed: int) -> torch.Tensor:
    """The starting noise: of the batch items the LATENT's batch_index names when it has one
    (ComfyUI's prepare_noise), else of items 0..B-1."""
    index = latent.get(c.BATCH_INDEX)
    if index is None:
        return make_noise(shape, seed)
    if not isinstance(index, (list, tuple)) or len(index) != shape[0] or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in index):
        raise InputError(f"latent: its batch_index {index!r} is not one index >= 0 per batch "
                         f"item ({shape[0]})")
    whole = make_noise((max(index) + 1, *shape[1:]), seed)
    return whole[list(index)].clone()


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a is b


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
