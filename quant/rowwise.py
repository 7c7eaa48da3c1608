"""Symmetric per-row quantization: one float32 scale per row, value = code * scale.

Rows are a weight's output channels (scales fixed at load) or an activation's tokens (scales
computed at every call, "dynamic"). A row's scale maps its largest magnitude onto the format's
largest code, so each row uses the whole code range whatever the spread between rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Smallest scale kept: an all-zero row gets this instead of 0, so 0 / scale stays 0 (not NaN).
# A normal float32 number, which GPUs do not flush to zero.
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny

# Weights are quantized this many elements at a time, so the float32 working copy of even the
# largest matrix (14B FFN: 70M elements) stays small next to the model while it loads.
_LOAD_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class RowFormat:
    dtype: torch.dtype
    max_code: float
    rounds: bool  # integer codes are rounded; the fp8 cast rounds by itself (to nearest even)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [..., 1]: each row's largest magnitude over the largest code."""
        amax = rows.abs().amax(dim=-1, keepdim=True).float()
        return (amax / self.max_code).clamp_min(_SMALLEST_SCALE)

    def encode(self, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        scaled = rows.float() / scales
        if self.rounds:
            scaled = scaled.round()
        return scaled.clamp(-self.max_code, self.max_code).to(self.dtype)


FP8 = RowFormat(torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max, rounds=False)
INT8 = RowFormat(torch.int8, 127.0, rounds=True)


def quantize_rows(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes shaped like `rows` and float32 scales [..., 1] (activations: one scale per token)."""
    scales = fmt.scales(rows)
    return fmt.encode(rows, scales), scales


def quantize_weight(weight: torch.Tensor, fmt: RowFormat,
                    stored_scales: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] matrix as codes [out, in] and float32 scales [out], a few rows at a time
    (on the device the weight is on; on the meta device it only shapes the result).
    stored_scales: float32 [out] that the stored values are multiplied by first (a file's
    quantized weights in another format)."""
    out_features = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=fmt.dtype, device=weight.device)
    scales = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    step = max(1, _LOAD_CHUNK_ELEMENTS // max(1, weight[0].numel()))
    for start in range(0, out_features, step):
        rows = weight[start:start + step].float()
        if stored_scales is not None:
            rows = rows * stored_scales[start:start + step, None]
        row_scales = fmt.scales(rows)
        codes[start:start + step] = fmt.encode(rows, row_scales)
        scales[start:start + step] = row_scales[:, 0]
    return codes, scales


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """codes * scales per row, computed in float32 and rounded once to `dtype`."""
    return (codes.float() * scales[:, None]).to(dtype)
