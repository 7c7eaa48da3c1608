"""A seeded random umT5 text encoder in the layout of ComfyUI's
`umt5_xxl_fp8_e4m3fn_scaled.safetensors`, the file most ComfyUI users have: UMT5 key names,
the blocks' attention and feed-forward matrices as float8_e4m3fn codes with a per-tensor
`scale_weight`, everything else bf16, an empty `scaled_fp8` marker (the shape ComfyUI's text
encoders load) and the sentencepiece model as a uint8 tensor `spiece_model`.

The sentencepiece model is this package's small one (wan/tiny_tokenizer.py, the real format):
both encoders tokenize with it, so both see the same ids, all inside the real vocabulary.

Values are drawn one tensor at a time (checkpoints/tiny.random_tensors) and the matrices are
quantized as they come, so memory holds the written file plus one float32 tensor. A file that
exists with the same size, seed and drawing device (safetensors metadata) is kept.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SIZES = ("xxl", "tiny")
_FP8_MAX = 448.0
_STAMP = "wan_enhanced_random_umt5"


def t5_config(size: str):
    from wan_enhanced.checkpoints.tiny import TINY_T5
    from wan_enhanced.wan.configs import KNOWN_T5

    if size not in SIZES:
        raise ValueError(f"umT5 size {size!r}: expected one of {', '.join(SIZES)}")
    return KNOWN_T5["umt5-xxl"] if size == "xxl" else TINY_T5


def stamp(size: str, seed: int, device: str | torch.device) -> str:
    return f"umt5 {size} seed {seed} drawn on {torch.device(device).type}, marker v2"


def existing_stamp(path: Path) -> str | None:
    try:
        with safe_open(str(path), "pt") as file:
            return (file.metadata() or {}).get(_STAMP)
    except Exception:  # a missing, partial or foreign file is written again
        return None


def comfy_fp8_tensors(size: str, seed: int, device: str | torch.device = "cpu"
                      ) -> dict[str, torch.Tensor]:
    """The file's tensors, under ComfyUI's names."""
    from wan_enhanced.checkpoints.tiny import random_tensors
    from wan_enhanced.wan.t5 import UMT5Encoder, is_block_matrix, wan_key_to_hf
    from wan_enhanced.wan.tiny_tokenizer import build_spiece_model

    with torch.device("meta"):
        model = UMT5Encoder.from_config(t5_config(size))
    out: dict[str, torch.Tensor] = {}
    for name, value in random_tensors(model, seed, device):
        key = wan_key_to_hf(name)
        if key is None:
            raise KeyError(f"umT5 tensor {name!r} has no name in ComfyUI's layout")
        if is_block_matrix(name):
            scale = value.abs().amax() / _FP8_MAX
            out[key] = (value / scale).to(torch.float8_e4m3fn).cpu()
            out[key.removesuffix("weight") + "scale_weight"] = scale.reshape(()).cpu()
        else:
            out[key] = value.to(torch.bfloat16).cpu()
        del value
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)  # as ComfyUI's text encoders
    out["spiece_model"] = torch.frombuffer(bytearray(build_spiece_model()), dtype=torch.uint8)
    return out


def write_random_umt5(path: str | Path, size: str = "xxl", seed: int = 0,
                      device: str | torch.device = "cpu") -> Path:
    """Write (atomically) the random encoder to `path` unless it is already there."""
    from wan_enhanced.atomic_files import atomic_target

    path = Path(path)
    mark = stamp(size, seed, device)
    if existing_stamp(path) == mark:
        return path
    tensors = comfy_fp8_tensors(size, seed, device)
    with atomic_target(path, path.name) as temp:
        save_file(tensors, str(temp), metadata={_STAMP: mark})
    return path
