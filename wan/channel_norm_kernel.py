"""Triton kernel: the VAE's channel RMS norm, optionally followed by SiLU, over channels-last rows
(see channel_norm.py). Imported only where Triton is installed."""

from __future__ import annotations

import triton
import triton.language as tl

EPS = tl.constexpr(1e-12)  # F.normalize's floor on the norm


@triton.jit
def channel_norm_kernel(x_ptr, bias_ptr, gamma_ptr, out_ptr, rows, channels, x_batch_stride,
                        out_batch_stride, scale, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """BLOCK_ROWS pixels of one batch item per program (program_id 1: the item). A pixel's
    channels are one contiguous row of `channels` values in x and in out; the row is read once,
    normalised to unit L2 norm in float32, times scale * gamma, then SiLU (SILU), and rounded
    once to out's dtype. With HAS_BIAS a per-channel bias is added to x first (in float32)."""
    batch = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_C)
    col_inside = cols < channels
    inside = (row[:, None] < rows) & col_inside[None, :]
    offsets = row.to(tl.int64)[:, None] * channels + cols[None, :]
    x = tl.load(x_ptr + batch * x_batch_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=col_inside, other=0.0).to(tl.float32)[None, :]
    factor = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), EPS)
    gamma = tl.load(gamma_ptr + cols, mask=col_inside, other=0.0).to(tl.float32)
    y = x * factor[:, None] * gamma[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + batch * out_batch_stride + offsets, y.to(out_ptr.dtype.element_ty),
             mask=inside)
