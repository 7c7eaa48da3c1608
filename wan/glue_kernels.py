"""Triton kernels for the DiT block's elementwise work (see glue.py): one pass over the rows
for what PyTorch does in several. Imported only where Triton is installed.

Every kernel takes one row (a token's width of channels) per program; modulation tables are
[B, G, D] with G groups of L / G consecutive tokens (G = 1, one per frame, or one per token).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant.fp8_rows_kernel import fp8_codes, row_scale


@triton.jit
def _group_offset(row, L, rows_per_group, stride_mb, stride_mg):
    b = row // L
    g = (row % L) // rows_per_group
    return b.to(tl.int64) * stride_mb + g.to(tl.int64) * stride_mg


@triton.jit
def _row_offset(row, L, stride_b, stride_l):
    return (row // L).to(tl.int64) * stride_b + (row % L).to(tl.int64) * stride_l


@triton.jit
def _scaled_shifted(y, cols, inside, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr, rows_per_group,
                    stride_mb, stride_mg, MODULATE: tl.constexpr, AFFINE: tl.constexpr):
    """The normed y (columns `cols` of a row) times (1 + scale) plus shift of the row's group
    (MODULATE), or times w plus b (AFFINE)."""
    if MODULATE:
        m = _group_offset(row, L, rows_per_group, stride_mb, stride_mg)
        shift = tl.load(shift_ptr + m + cols, mask=inside, other=0.0)
        scale = tl.load(scale_ptr + m + cols, mask=inside, other=0.0)
        y = y * (1.0 + scale) + shift
    if AFFINE:
        y = y * tl.load(w_ptr + cols, mask=inside, other=0.0) + tl.load(b_ptr + cols, mask=inside,
                                                                        other=0.0)
    return y


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
    y = _scaled_shifted(centred * rstd, cols, inside, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                        rows_per_group, stride_mb, stride_mg, MODULATE, AFFINE)
    tl.store(out_ptr + row.to(tl.int64) * D + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


# the activation dtype the codes kernel rounds the norm to before it quantizes (the order of the
# statement: norm_modulate's output, then its quantization)
ROUND_NONE = tl.constexpr(0)
ROUND_BF16 = tl.constexpr(1)
ROUND_FP16 = tl.constexpr(2)


@triton.jit
def _stream_part(x_ptr, y_ptr, gate_ptr, row, L, D, stride_xb, stride_xl, gate_rows, stride_gb,
                 stride_gg, START: tl.constexpr, SIZE: tl.constexpr, UPDATE: tl.constexpr,
                 GATED: tl.constexpr):
    """Columns START..START + SIZE of the float32 row (masked past D), with x += y * gate (GATED)
    or x += y (UPDATE) written back: x, the columns, the mask."""
    cols = START + tl.arange(0, SIZE)
    inside = cols < D
    offset = _row_offset(row, L, stride_xb, stride_xl) + cols
    x = tl.load(x_ptr + offset, mask=inside, other=0.0).to(tl.float32)
    if UPDATE:
        y = tl.load(y_ptr + row.to(tl.int64) * D + cols, mask=inside, other=0.0).to(tl.float32)
        if GATED:
            g = _group_offset(row, L, gate_rows, stride_gb, stride_gg)
            y = y * tl.load(gate_ptr + g + cols, mask=inside, other=0.0)
        x = x + y
        tl.store(x_ptr + offset, x, mask=inside)
    return x, cols, inside


@triton.jit
def _normed_part(centred, rstd, cols, inside, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                 rows_per_group, stride_mb, stride_mg, MODULATE: tl.constexpr,
                 AFFINE: tl.constexpr, ROUNDING: tl.constexpr):
    """A part's normed values: layer_norm_modulate_kernel's arithmetic from its centred values,
    then rounded to the activation's dtype (ROUNDING)."""
    h = _scaled_shifted(centred * rstd, cols, inside, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                        rows_per_group, stride_mb, stride_mg, MODULATE, AFFINE)
    if ROUNDING == ROUND_BF16:
        h = h.to(tl.bfloat16).to(tl.float32)
    elif ROUNDING == ROUND_FP16:
        h = h.to(tl.float16).to(tl.float32)
    return h


@triton.jit
def norm_codes_kernel(x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, w_ptr, b_ptr, codes_ptr,
                      scales_ptr, L, D, stride_xb, stride_xl, gate_rows, stride_gb, stride_gg,
                      rows_per_group, stride_mb, stride_mg, eps, UPDATE: tl.constexpr,
                      GATED: tl.constexpr, MODULATE: tl.constexpr, AFFINE: tl.constexpr,
                      ROUNDING: tl.constexpr, PART0: tl.constexpr, PART1: tl.constexpr,
                      PART2: tl.constexpr, PART3: tl.constexpr):
    """A norm read only by fp8 matmuls, as their input codes, in one pass over the float32 row:
    with UPDATE, x += y * gate (GATED) or x += y first, in place (add_gated_kernel's arithmetic);
    then layer_norm_modulate_kernel's arithmetic, rounded to the activation's dtype (ROUNDING),
    as codes = h / scale with scale = max |h| / 448 (quant/rowwise.py's per-token fp8
    quantization, its division and rounding): codes [B*L, D], scales [B*L]. The normed
    activation is never stored. The row is held as up to four parts of power-of-two widths
    (quant/fp8_rows.py row_parts: 3072 = 2048 + 1024, 5120 = 4096 + 1024), not one block
    padded to the next power of two."""
    row = tl.program_id(0)
    x0, c0, i0 = _stream_part(x_ptr, y_ptr, gate_ptr, row, L, D, stride_xb, stride_xl, gate_rows,
                              stride_gb, stride_gg, 0, PART0, UPDATE, GATED)
    total = tl.sum(x0, axis=0)
    if PART1 > 0:
        x1, c1, i1 = _stream_part(x_ptr, y_ptr, gate_ptr, row, L, D, stride_xb, stride_xl,
                                  gate_rows, stride_gb, stride_gg, PART0, PART1, UPDATE, GATED)
        total += tl.sum(x1, axis=0)
    if PART2 > 0:
        x2, c2, i2 = _stream_part(x_ptr, y_ptr, gate_ptr, row, L, D, stride_xb, stride_xl,
                                  gate_rows, stride_gb, stride_gg, PART0 + PART1, PART2, UPDATE,
                                  GATED)
        total += tl.sum(x2, axis=0)
    if PART3 > 0:
        x3, c3, i3 = _stream_part(x_ptr, y_ptr, gate_ptr, row, L, D, stride_xb, stride_xl,
                                  gate_rows, stride_gb, stride_gg, PART0 + PART1 + PART2, PART3,
                                  UPDATE, GATED)
        total += tl.sum(x3, axis=0)
    mean = total / D
    x0 = tl.where(i0, x0 - mean, 0.0)
    squares = tl.sum(x0 * x0, axis=0)
    if PART1 > 0:
        x1 = tl.where(i1, x1 - mean, 0.0)
        squares += tl.sum(x1 * x1, axis=0)
    if PART2 > 0:
        x2 = tl.where(i2, x2 - mean, 0.0)
        squares += tl.sum(x2 * x2, axis=0)
    if PART3 > 0:
        x3 = tl.where(i3, x3 - mean, 0.0)
        squares += tl.sum(x3 * x3, axis=0)
    rstd = 1.0 / tl.sqrt(squares / D + eps)
    h0 = _normed_part(x0, rstd, c0, i0, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                      rows_per_group, stride_mb, stride_mg, MODULATE, AFFINE, ROUNDING)
    amax = tl.max(tl.abs(h0), axis=0)
    if PART1 > 0:
        h1 = _normed_part(x1, rstd, c1, i1, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                          rows_per_group, stride_mb, stride_mg, MODULATE, AFFINE, ROUNDING)
        amax = tl.maximum(amax, tl.max(tl.abs(h1), axis=0))
    if PART2 > 0:
        h2 = _normed_part(x2, rstd, c2, i2, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                          rows_per_group, stride_mb, stride_mg, MODULATE, AFFINE, ROUNDING)
        amax = tl.maximum(amax, tl.max(tl.abs(h2), axis=0))
    if PART3 > 0:
        h3 = _normed_part(x3, rstd, c3, i3, row, L, shift_ptr, scale_ptr, w_ptr, b_ptr,
                          rows_per_group, stride_mb, stride_mg, MODULATE, AFFINE, ROUNDING)
        amax = tl.maximum(amax, tl.max(tl.abs(h3), axis=0))
    scale = row_scale(amax)
    codes_ptr += row.to(tl.int64) * D
    tl.store(codes_ptr + c0, fp8_codes(h0, scale), mask=i0)
    if PART1 > 0:
        tl.store(codes_ptr + c1, fp8_codes(h1, scale), mask=i1)
    if PART2 > 0:
        tl.store(codes_ptr + c2, fp8_codes(h2, scale), mask=i2)
    if PART3 > 0:
        tl.store(codes_ptr + c3, fp8_codes(h3, scale), mask=i3)
    tl.store(scales_ptr + row, scale)


@triton.jit
def add_gated_kernel(x_ptr, y_ptr, gate_ptr, L, D, stride_xb, stride_xl, rows_per_group,
                     stride_mb, stride_mg, GATED: tl.constexpr, BLOCK_D: tl.constexpr):
    """x += y * gate (GATED) or x += y, in place; x float32 [B, L, D] with unit channel stride,
    y [B*L, D] contiguous in any float dtype."""
    _stream_part(x_ptr, y_ptr, gate_ptr, tl.program_id(0), L, D, stride_xb, stride_xl,
                 rows_per_group, stride_mb, stride_mg, 0, BLOCK_D, True, GATED)


@triton.jit
def _heads_part(x_ptr, base, W, FIRST: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr):
    """Heads FIRST..FIRST + HEADS of a row (zeros past W) as float32 [HEADS, D] (contiguous, so
    loaded in 16-byte vectors) and their offsets in the row."""
    offs = (FIRST + tl.arange(0, HEADS))[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(x_ptr + base + offs, mask=offs < W, other=0.0).to(tl.float32), offs


@triton.jit
def _row_squares(x_ptr, base, W, START: tl.constexpr, SIZE: tl.constexpr):
    """The sum of squares of a row's channels START..START + SIZE (masked past W) from a load of
    their own, in one dimension: the load's layout, and so the order of the sum, is then the
    same in every kernel that calls this, whatever it does with the row after. (Summed over the
    heads' tile, the order followed the tile's later use: the queries' int8 codes gave the tile
    another layout than the bf16 store, and other bits.)"""
    cols = START + tl.arange(0, SIZE)
    x = tl.load(x_ptr + base + cols, mask=cols < W, other=0.0).to(tl.float32)
    return tl.sum(x * x, axis=0)


@triton.jit
def _rotated_part(x, offs, rstd, w_ptr, cos_ptr, sin_ptr, angle, W, ROTATE: tl.constexpr):
    """A part's channels [HEADS, D] normed, times the gain and (ROTATE) each pair rotated by the
    angles `angle` [D / 2] of the token's tables (the pair on one thread), in float32."""
    heads: tl.constexpr = x.shape[0]
    d: tl.constexpr = x.shape[1]
    y = x * rstd * tl.load(w_ptr + offs, mask=offs < W, other=0.0)
    if ROTATE:
        even, odd = tl.split(tl.reshape(y, [heads, d // 2, 2]))
        c = tl.load(cos_ptr + angle)[None, :]
        s = tl.load(sin_ptr + angle)[None, :]
        y = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), [heads, d])
    return y


@triton.jit
def rms_norm_rope_heads(x_ptr, w_ptr, cos_ptr, sin_ptr, row, W, eps, rows_per_sample,
                        rope_start, ROTATE: tl.constexpr, HEADS0: tl.constexpr,
                        HEADS1: tl.constexpr, D: tl.constexpr):
    """Row `row` of x [B*L, W] (W = heads * D) normed over its whole width, times the gain and
    (ROTATE) each head's channel pair i rotated by the token's angle i, in float32. The heads as
    two parts of power-of-two counts (HEADS0, then HEADS1 masked past W; glue.head_parts), each
    [heads, D] with its offsets in the row, and the row's first element's offset. A head's
    pairs on neighbouring lanes, so its reductions are a warp's shuffles; the rotation's angles
    are loaded once for all heads."""
    base = row.to(tl.int64) * W
    squares = (_row_squares(x_ptr, base, W, 0, HEADS0 * D)
               + _row_squares(x_ptr, base, W, HEADS0 * D, HEADS1 * D))
    rstd = 1.0 / tl.sqrt(squares / W + eps)
    x0, offs0 = _heads_part(x_ptr, base, W, 0, HEADS0, D)
    x1, offs1 = _heads_part(x_ptr, base, W, HEADS0, HEADS1, D)
    angle = ((row % rows_per_sample + rope_start).to(tl.int64) * (D // 2)
             + tl.arange(0, D // 2))
    y0 = _rotated_part(x0, offs0, rstd, w_ptr, cos_ptr, sin_ptr, angle, W, ROTATE)
    y1 = _rotated_part(x1, offs1, rstd, w_ptr, cos_ptr, sin_ptr, angle, W, ROTATE)
    return y0, offs0, y1, offs1, base


@triton.jit
def rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, W, eps, rows_per_sample,
                         rope_start, ROTATE: tl.constexpr, HEADS0: tl.constexpr,
                         HEADS1: tl.constexpr, D: tl.constexpr):
    """RMS norm over a row's whole width W (all heads), times the gain, then (ROTATE) each
    head's channel pair (2i, 2i+1) rotated by the token's angle i (tables [tokens, D / 2]).
    float32 arithmetic, rounded once to out's dtype. Rows of x [B*L, W] contiguous; the row in
    rms_norm_rope_heads' two parts of heads."""
    y0, offs0, y1, offs1, base = rms_norm_rope_heads(
        x_ptr, w_ptr, cos_ptr, sin_ptr, tl.program_id(0), W, eps, rows_per_sample, rope_start,
        ROTATE, HEADS0, HEADS1, D)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + offs0, y0.to(dtype), mask=offs0 < W)
    tl.store(out_ptr + base + offs1, y1.to(dtype), mask=offs1 < W)
