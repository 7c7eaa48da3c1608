"""Loading the CLIP image encoder of Wan2.1 image-to-video (wan/clip_vision.py).

ComfyUI's `clip_vision_h.safetensors` (and transformers' CLIPVisionModel files) name the tower's
tensors `vision_model.*`; files that carry only the tower without that prefix (`embeddings.*`,
`encoder.*`) are read the same way. The projection head and any text tower are not read. The
official `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` stores open-clip names
(`visual.*`); it is refused with a message pointing to the converted file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..wan.clip_vision import CLIPVisionEncoder, config_from_state
from .reader import CheckpointError, open_checkpoint

PREFIX = "vision_model."


def load_clip_vision(path: str | Path, dtype: torch.dtype = torch.float16) -> CLIPVisionEncoder:
    """The encoder on the CPU in `dtype` (norms and embeddings included)."""
    with open_checkpoint(path) as source:
        keys = source.keys()
        names = _tower_names(Path(path), keys)
        shapes = {ours: source.shape(theirs) for ours, theirs in names.items()}
        try:
            config = config_from_state({k: torch.empty(s, device="meta")
                                        for k, s in shapes.items()})
        except (KeyError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{path}: not a complete CLIP vision tower ({exc})") from None
        with torch.device("meta"):
            model = CLIPVisionEncoder(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(names))
        if missing:
            raise CheckpointError(f"{path}: the CLIP vision tower lacks {len(missing)} tensors, "
                                  f"e.g. {missing[:3]}")
        wrong = [k for k in expected if tuple(expected[k].shape) != tuple(shapes[k])]
        if wrong:
            raise CheckpointError(f"{path}: tensor {wrong[0]} has shape {list(shapes[wrong[0]])}, "
                                  f"expected {list(expected[wrong[0]].shape)} for a "
                                  f"{config.layers}-layer tower of width {config.hidden}")
        state = {k: source.read(names[k]).to(dtype) for k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _tower_names(path: Path, keys: list[str]) -> dict[str, str]:
    """Our parameter name -> the file's key, for the vision tower's tensors."""
    if any(k.startswith(PREFIX) for k in keys):
        return {k: k for k in keys if k.startswith(PREFIX)}
    if any(k.startswith("embeddings.patch_embedding") for k in keys):
        return {PREFIX + k: k for k in keys if k.startswith(("embeddings.", "encoder.",
                                                             "pre_layrnorm.", "post_layernorm."))}
    if any(k.startswith("visual.") for k in keys):
        raise CheckpointError(f"{path}: an open-clip checkpoint (visual.* names, as the official "
                              f"Wan2.1 .pth); use ComfyUI's clip_vision_h.safetensors, the same "
                              f"tower under vision_model.* names")
    raise CheckpointError(f"{path}: not a CLIP vision checkpoint: expected vision_model.* tensors "
                          f"(ComfyUI's clip_vision_h.safetensors)")
