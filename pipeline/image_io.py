"""Reading a start image from a file, as ComfyUI's LoadImage reads it: every frame of the file
that has the first frame's size, as IMAGE [N, H, W, 3] float32 in 0..1, and a MASK [N, H, W]
that is 1 - alpha (a 64x64 zero mask when the image has no alpha)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .errors import InputError

EXCLUDED_FORMATS = ("MPO",)  # multi-picture JPEGs: the first picture only, as in ComfyUI


def load_image(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

    try:
        picture = Image.open(path)
    except FileNotFoundError:
        raise InputError(f"image: {path.name!r} not found") from None
    except (UnidentifiedImageError, OSError) as error:
        raise InputError(f"image: {path.name!r} is not an image ({error})") from None
    images, masks, size = [], [], None
    with picture:
        for frame in ImageSequence.Iterator(picture):
            frame = ImageOps.exif_transpose(frame)
            if frame.mode == "I":
                frame = frame.point(lambda value: value * (1 / 255))
            rgb = frame.convert("RGB")
            size = size or rgb.size
            if rgb.size != size:
                continue
            images.append(torch.from_numpy(np.array(rgb).astype(np.float32) / 255.0)[None])
            masks.append(_mask(frame)[None])
        several = len(images) > 1 and picture.format not in EXCLUDED_FORMATS
    if not several:
        return images[0], masks[0]
    return torch.cat(images), torch.cat(masks)


def _mask(frame) -> torch.Tensor:
    if "A" in frame.getbands():
        alpha = frame.getchannel("A")
    elif frame.mode == "P" and "transparency" in frame.info:
        alpha = frame.convert("RGBA").getchannel("A")
    else:
        return torch.zeros(64, 64, dtype=torch.float32)
    return 1.0 - torch.from_numpy(np.array(alpha).astype(np.float32) / 255.0)
