"""Triton kernels for the DiT block's elementwise work (see glue.py): one pass over the rows
for what PyTorch does in several. Imported only where Triton is installed.

Every kernel takes one row (a token's width of channels) per program; modulation tables are
[B, G, D] with G groups of L / G consecutive tokens (G = 1, one per frame, or one per token).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _group_offset(row, L, rows_per_group, stride_mb, stride_mg):
    b = row // L
    g = (row % L) // rows_per_group
    return b.to(tl.int64) * stride_mb + g.to(tl.int64) * stride_mg


@triton.jit
def _row_offset(row, L, stride_b, stride_l):
    return (row // L).to(tl.int64) * stride_b + (row % L).to(tl.int64) * stride_l


@triton.jit
def layer_norm_modulate_kernel(x_ptr, shift_ptr, scale_ptr, w_ptr, b_ptr, out_ptr, L, D,
                               stride_xb, stride_xl, rows_per_group, stride_mb, stride_mg, eps,
                               MODULATE: tl.constexpr, AFFINE: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    """out = LN(x) * (1 + scale) + shift (MODULATE) or LN(x) * w + b (AFFINE), float32
    arithmetic; x [B, L, D] with unit channel stride, out [B*L, D] contiguous in its dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(x_ptr + _row_offset(row, L, stride_xb, stride_xl) + cols, mask=inside,
                other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    centred = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
    y = centred * rstd
    if MODULATE:
        m = _group_offset(row, L, rows_per_group, stride_mb, stride_mg)
        shift = tl.load(shift_ptr + m + cols, mask=inside, other=0.0)
        scale = tl.load(scale_ptr + m + cols, mask=inside, other=0.0)
        y = y * (1.0 + scale) + shift
    if AFFINE:
        y = y * tl.load(w_ptr + cols, mask=inside, other=0.0) + tl.load(b_ptr + cols, mask=inside,
                                                                        other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * D + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def add_gated_kernel(x_ptr, y_ptr, gate_ptr, L, D, stride_xb, stride_xl, rows_per_group,
                     stride_mb, stride_mg, GATED: tl.constexpr, BLOCK_D: tl.constexpr):
    """x += y * gate (GATED) or x += y, in place; x float32 [B, L, D] with unit channel stride,
    y [B*L, D] contiguous in any float dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    offset = _row_offset(row, L, stride_xb, stride_xl) + cols
    x = tl.load(x_ptr + offset, mask=inside, other=0.0)
    y = tl.load(y_ptr + row.to(tl.int64) * D + cols, mask=inside, other=0.0).to(tl.float32)
    if GATED:
        m = _group_offset(row, L, rows_per_group, stride_mb, stride_mg)
        y = y * tl.load(gate_ptr + m + cols, mask=inside, other=0.0)
    tl.store(x_ptr + offset, x + y, mask=inside)


@triton.jit
def rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, W, HALF_HEAD, eps,
                         rows_per_sample, rope_start,
                         ROTATE: tl.constexpr, BLOCK_P: tl.constexpr):
    """RMS norm over a row's whole width W (all heads), times the gain, then (ROTATE) each
    channel pair (2i, 2i+1) rotated by the token's angle for pair i mod HALF_HEAD. float32
    arithmetic, rounded once to out's dtype. Rows of x [B*L, W] contiguous.

    The row is loaded and stored whole (contiguous, so in 16-byte vectors) and split into its
    even and odd channels in registers: loads of every second channel were not vectorized."""
    row = tl.program_id(0)
    cols = tl.arange(0, 2 * BLOCK_P)
    inside = cols < W
    base = row.to(tl.int64) * W
    x = tl.load(x_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / W + eps)
    y = x * rstd * tl.load(w_ptr + cols, mask=inside, other=0.0)
    if ROTATE:
        even, odd = tl.split(tl.reshape(y, [BLOCK_P, 2]))
        pairs = tl.arange(0, BLOCK_P)
        token = (row % rows_per_sample + rope_start).to(tl.int64)
        angle = token * HALF_HEAD + pairs % HALF_HEAD
        c = tl.load(cos_ptr + angle, mask=pairs < W // 2, other=1.0)
        s = tl.load(sin_ptr + angle, mask=pairs < W // 2, other=0.0)
        y = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), [2 * BLOCK_P])
    tl.store(out_ptr + base + cols, y.to(out_ptr.dtype.element_ty), mask=inside)
