"""Loading the CLIP image encoder of Wan2.1 image-to-video (wan/clip_vision.py).

Two layouts of the same ViT-H/14 tower are read:
- ComfyUI's `clip_vision_h.safetensors` (transformers' CLIPVisionModel names, `vision_model.*`,
  or the same names without that prefix); the projection head is not read;
- the official `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (`visual.*`, Wan's own
  module names: packed query/key/value, `[1, 1, D]` class and `[1, N, D]` position embeddings),
  whose text tower is not read.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..wan.clip_vision import CLIPVisionEncoder, config_from_state
from .comfy_quant import METADATA_KEY
from .loader import _WEIGHT_SCALE_SUFFIXES
from .reader import CheckpointError, TensorSource, open_checkpoint

PREFIX = "vision_model."
OFFICIAL_PREFIX = "visual."

# official name (after "visual.") -> ours (after "vision_model."), for the unpacked tensors
_OFFICIAL_NAMES = {
    "patch_embedding.weight": "embeddings.patch_embedding.weight",
    "pre_norm.weight": "pre_layrnorm.weight", "pre_norm.bias": "pre_layrnorm.bias",
    "post_norm.weight": "post_layernorm.weight", "post_norm.bias": "post_layernorm.bias",
}
_OFFICIAL_LAYER_NAMES = {
    "norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
    "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2",
}
_OFFICIAL_LAYER = re.compile(r"transformer\.(\d+)\.(.+)\.(weight|bias)$")


def load_clip_vision(path: str | Path, dtype: torch.dtype = torch.float16) -> CLIPVisionEncoder:
    """The encoder on the CPU in `dtype` (norms and embeddings included)."""
    with open_checkpoint(path) as source:
        keys = source.keys()
        _refuse_quantized(Path(path), source, keys)
        if any(k.startswith(OFFICIAL_PREFIX) for k in keys):
            state = _official_state(source, dtype)
        else:
            state = {ours: source.read(theirs).to(dtype)
                     for ours, theirs in _comfy_names(Path(path), keys).items()}
    try:
        config = config_from_state(state)
    except (KeyError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a complete CLIP vision tower (no {exc})") from None
    with torch.device("meta"):
        model = CLIPVisionEncoder(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: the CLIP vision tower lacks {len(missing)} tensors, "
                              f"e.g. {missing[:3]}")
    wrong = [k for k in expected if tuple(expected[k].shape) != tuple(state[k].shape)]
    if wrong:
        raise CheckpointError(f"{path}: tensor {wrong[0]} has shape {list(state[wrong[0]].shape)}, "
                              f"expected {list(expected[wrong[0]].shape)} for a "
                              f"{config.layers}-layer tower of width {config.hidden}")
    model.load_state_dict({k: state[k] for k in expected}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def check_clip_vision_keys(path: str | Path) -> None:
    """Raise CheckpointError unless the file's keys are a CLIP vision tower's (header only)."""
    with open_checkpoint(path) as source:
        keys = source.keys()
        _refuse_quantized(Path(path), source, keys)
    if not any(k.startswith(OFFICIAL_PREFIX) for k in keys):
        _comfy_names(Path(path), keys)


# keys of quantized layers (ComfyUI's mixed-precision and fp8-scaled files): the tower's tensors
# are read as plain floats, so such a file is refused rather than read without its scales
_QUANTIZED_SUFFIXES = (".comfy_quant", *_WEIGHT_SCALE_SUFFIXES)


def _refuse_quantized(path: Path, source: TensorSource, keys: list[str]) -> None:
    quantized = next((k for k in keys if k.endswith(_QUANTIZED_SUFFIXES)), None)
    if quantized is not None or METADATA_KEY in source.metadata:
        where = quantized if quantized is not None else f"the {METADATA_KEY} entry"
        raise CheckpointError(f"{path}: a quantized CLIP vision file ({where}); the CLIP "
                              f"vision loader reads float weights only (clip_vision_h "
                              f"in fp16, bf16 or fp32)")


def _comfy_names(path: Path, keys: list[str]) -> dict[str, str]:
    """Our parameter name -> the file's key, for the vision tower's tensors."""
    if any(k.startswith(PREFIX) for k in keys):
        return {k: k for k in keys if k.startswith(PREFIX)}
    if any(k.startswith("embeddings.patch_embedding") for k in keys):
        return {PREFIX + k: k for k in keys if k.startswith(("embeddings.", "encoder.",
                                                             "pre_layrnorm.", "post_layernorm."))}
    raise CheckpointError(f"{path}: not a CLIP vision checkpoint: expected vision_model.* "
                          f"tensors (ComfyUI's clip_vision_h.safetensors) or visual.* tensors "
                          f"(the official Wan2.1 CLIP .pth)")


def _official_state(source: TensorSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The official file's vision tower under our names (query/key/value unpacked)."""
    state = {}
    for key in source.keys():
        if not key.startswith(OFFICIAL_PREFIX):
            continue  # the text tower and the logit scale
        name = key[len(OFFICIAL_PREFIX):]
        if name == "head":
            continue  # the projection to the joint space: not used
        tensor = source.read(key).to(dtype)
        if name == "cls_embedding":
            state[PREFIX + "embeddings.class_embedding"] = tensor.reshape(-1)
        elif name == "pos_embedding":
            state[PREFIX + "embeddings.position_embedding.weight"] = tensor.reshape(
                -1, tensor.shape[-1])
        elif name in _OFFICIAL_NAMES:
            state[PREFIX + _OFFICIAL_NAMES[name]] = tensor
        elif match := _OFFICIAL_LAYER.match(name):
            index, module, kind = match.groups()
            layer = f"{PREFIX}encoder.layers.{index}."
            if module == "attn.to_qkv":  # rows: all queries, then all keys, then all values
                for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    state[f"{layer}self_attn.{part}.{kind}"] = chunk.clone()
            elif module in _OFFICIAL_LAYER_NAMES:
                state[f"{layer}{_OFFICIAL_LAYER_NAMES[module]}.{kind}"] = tensor
    return state


def official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict in the official file's names (the inverse of _official_state), for
    writing test checkpoints in that layout."""
    inverse = {ours: theirs for theirs, ours in _OFFICIAL_NAMES.items()}
    inverse_layer = {ours: theirs for theirs, ours in _OFFICIAL_LAYER_NAMES.items()}
    out = {}
    layers = re.compile(rf"{re.escape(PREFIX)}encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    for key, tensor in state.items():
        name = key[len(PREFIX):]
        if name == "embeddings.class_embedding":
            out[OFFICIAL_PREFIX + "cls_embedding"] = tensor.reshape(1, 1, -1)
        elif name == "embeddings.position_embedding.weight":
            out[OFFICIAL_PREFIX + "pos_embedding"] = tensor.unsqueeze(0)
        elif name in inverse:
            out[OFFICIAL_PREFIX + inverse[name]] = tensor
        elif match := layers.match(key):
            index, module, kind = match.groups()
            prefix = f"{OFFICIAL_PREFIX}transformer.{index}."
            if module == "self_attn.q_proj":
                parts = [state[f"{PREFIX}encoder.layers.{index}.self_attn.{p}.{kind}"]
                         for p in ("q_proj", "k_proj", "v_proj")]
                out[f"{prefix}attn.to_qkv.{kind}"] = torch.cat(parts, dim=0)
            elif module in inverse_layer:
                out[f"{prefix}{inverse_layer[module]}.{kind}"] = tensor
    return out
