"""Triton kernel: a row's fp8 codes with one scale per row, optionally of its tanh-GELU first
(see fp8_rows.py and gelu_fp8.py). Imported only where Triton is installed."""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
# PyTorch divides a tensor by a number as a product with its float32 reciprocal: the scales are
# amax times this (the rounding of 1 / 448 to float32), to be PyTorch's to the bit
INV_FP8_MAX = tl.constexpr(0.002232142857142857)
SMALLEST_SCALE = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal number
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def fp8_rows_kernel(x_ptr, bias_ptr, codes_ptr, scales_ptr, K, HAS_BIAS: tl.constexpr,
                    GELU: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the row (plus the bias) is read once, kept in registers for its
    maximum and its codes (codes = y / scale, scale = max |y| / 448, y = gelu(x) or x; the
    division of the codes rounded as IEEE's, so without the GELU the codes are PyTorch's to the
    bit)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU:
        inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        # tanh(u) = 1 - 2 / (exp(2u) + 1), exact at both ends in float32
        y = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        y = x
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) * INV_FP8_MAX, SMALLEST_SCALE)
    codes = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(codes_ptr + row * K + cols, codes, mask=inside)
    tl.store(scales_ptr + row, scale)
