"""A checkpoint's block matrix turned into a quantized layer's state, one tensor at a time.

Files can already be quantized: ComfyUI's "scaled fp8" files store float8_e4m3fn weights with a
per-tensor `scale_weight` (newer ones `weight_scale`), and plain fp8 files (such as
`*_fp8_e4m3fn.safetensors`) store float8_e4m3fn weights with no scale at all; its mixed-precision
files store float8_e4m3fn or int8 weights with a per-tensor `weight_scale`
(checkpoints/comfy_quant.py). When the chosen scheme stores the same codes (fp8 e4m3fn, int8)
those weights are kept bit for bit — a dequantize-requantize round trip would only add rounding.
Everything else is dequantized with its scale (if any) and quantized per output channel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .rowwise import quantize_weight
from .schemes import QuantScheme


# Stored codes a scheme of the same storage keeps: fp8 e4m3fn (ComfyUI's fp8-scaled and plain fp8
# files, float8_e4m3fn layers of its mixed-precision files) and int8 (its int8_tensorwise layers,
# whose per-tensor scale is a per-row scale repeated).
_KEPT = (torch.float8_e4m3fn, torch.int8)


class StoredWeight(NamedTuple):
    codes: torch.Tensor  # [out, in] in the scheme's storage dtype
    scales: torch.Tensor  # float32 [out]
    kept_as_stored: bool  # the file's codes, unchanged


def per_row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A file's weight scale as float32 [rows]: a per-tensor scale is repeated for every row
    (the same value, so the products are the same)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).contiguous()
    if scale.numel() == rows:
        return scale.float().reshape(rows)
    raise ValueError(f"{scale.numel()} scale values for {rows} rows; expected 1 (per tensor) "
                     f"or {rows} (per output channel)")


def dequantize_stored(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A file's quantized tensor times its scale (per tensor, or per output channel), float32."""
    if weight.dim() == 0:
        raise ValueError("a scale for a 0-dimensional tensor")
    rows = per_row_scales(scale, weight.shape[0])
    return weight.float() * rows.reshape(-1, *([1] * (weight.dim() - 1)))


def keeps_stored(chosen: QuantScheme, weight: torch.Tensor) -> bool:
    """Whether `chosen` keeps a file's matrix `weight` as stored (its fp8 or int8 codes,
    unchanged): the file's codes are in the format `chosen` stores."""
    return weight.dtype == chosen.storage_dtype and weight.dtype in _KEPT


def stored_weight(chosen: QuantScheme, weight: torch.Tensor,
                  scale: torch.Tensor | None) -> StoredWeight:
    """The codes and per-row scales `chosen` stores for a file's block matrix `weight`
    ([out, in], any dtype) with its scale (None when the file has none)."""
    if weight.dim() != 2:
        raise ValueError(f"a block matrix of shape {list(weight.shape)}; expected 2 dimensions")
    rows = weight.shape[0]
    scales = None if scale is None else per_row_scales(scale, rows)
    if keeps_stored(chosen, weight):
        if scales is None:
            scales = torch.ones(rows, dtype=torch.float32)
        return StoredWeight(weight, scales, True)
    codes, new_scales = quantize_weight(weight, chosen.layer.fmt, scales)
    return StoredWeight(codes, new_scales, False)
