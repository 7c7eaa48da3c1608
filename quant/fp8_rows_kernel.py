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
# -2 log2(e) sqrt(2 / pi), and the same times 0.044715: the GELU's exponent in base 2
NEG_2_LOG2E_SQRT_2_OVER_PI = tl.constexpr(-2.302208198144325)
NEG_2_LOG2E_SQRT_2_OVER_PI_CUBIC = tl.constexpr(-0.1029432395800235)


@triton.jit
def row_scale(amax):
    """A row's scale from its largest magnitude: amax / 448 rounded as PyTorch rounds it (see
    INV_FP8_MAX), never below float32's smallest normal number."""
    return tl.maximum(amax * INV_FP8_MAX, SMALLEST_SCALE)


@triton.jit
def fp8_codes(y, scale):
    """y / scale as the IEEE quotient, clamped to +-448, in fp8: PyTorch's codes to the bit."""
    return tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _gelu(x):
    """tanh-GELU as x * sigmoid(2u) = x / (1 + 2^(-2u log2 e)), u = sqrt(2/pi) (x + 0.044715 x^3):
    one exp2 and one reciprocal on the special function unit (the tanh form with an IEEE
    division took four times the instructions and made the kernel compute-bound). Within a few
    float32 ulps of the tanh form; exact at both ends (x / inf = -0, x / 1 = x)."""
    t = x * (NEG_2_LOG2E_SQRT_2_OVER_PI + NEG_2_LOG2E_SQRT_2_OVER_PI_CUBIC * (x * x))
    return tl.inline_asm_elementwise(
        "{ .reg .f32 e; ex2.approx.ftz.f32 e, $1; add.ftz.f32 e, e, 0f3F800000; "
        "rcp.approx.ftz.f32 e, e; mul.ftz.f32 $0, $2, e; }",
        "=r,r,r", [t, x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _part(x_ptr, bias_ptr, row, K, START: tl.constexpr, SIZE: tl.constexpr,
          HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """Columns START..START + SIZE of the row (masked past K): y, their indices, the mask."""
    cols = START + tl.arange(0, SIZE)
    inside = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU:
        y = _gelu(x)
    else:
        y = x
    return y, cols, inside


@triton.jit
def _store(y, scale, inverse, codes_ptr, cols, inside, GELU: tl.constexpr):
    if GELU:
        # y times the row's 1 / scale, the fp8 conversion saturating at +-448: the codes of the
        # IEEE quotient but where it lies within a float32 ulp of an fp8 rounding edge
        codes = (y * inverse).to(tl.float8e4nv)
    else:
        codes = fp8_codes(y, scale)
    tl.store(codes_ptr + cols, codes, mask=inside)


@triton.jit
def fp8_rows_kernel(x_ptr, bias_ptr, codes_ptr, scales_ptr, K, HAS_BIAS: tl.constexpr,
                    GELU: tl.constexpr, PART0: tl.constexpr, PART1: tl.constexpr,
                    PART2: tl.constexpr, PART3: tl.constexpr):
    """One program per row: the row (plus the bias) is read once, kept in registers for its
    maximum and its codes (codes = y / scale, scale = max |y| / 448, y = gelu(x) or x). Without
    the GELU the division is rounded as IEEE's, so the codes are PyTorch's to the bit; with it,
    y times 1 / scale (see _store). The row is held as up to four parts of power-of-two widths
    (fp8_rows.row_parts), so a width such as 8960 takes 8192 + 512 + 256 lanes, not 16384."""
    row = tl.program_id(0).to(tl.int64)
    y0, cols0, inside0 = _part(x_ptr, bias_ptr, row, K, 0, PART0, HAS_BIAS, GELU)
    amax = tl.max(tl.abs(y0), axis=0)
    if PART1 > 0:
        y1, cols1, inside1 = _part(x_ptr, bias_ptr, row, K, PART0, PART1, HAS_BIAS, GELU)
        amax = tl.maximum(amax, tl.max(tl.abs(y1), axis=0))
    if PART2 > 0:
        y2, cols2, inside2 = _part(x_ptr, bias_ptr, row, K, PART0 + PART1, PART2, HAS_BIAS,
                                   GELU)
        amax = tl.maximum(amax, tl.max(tl.abs(y2), axis=0))
    if PART3 > 0:
        y3, cols3, inside3 = _part(x_ptr, bias_ptr, row, K, PART0 + PART1 + PART2, PART3,
                                   HAS_BIAS, GELU)
        amax = tl.maximum(amax, tl.max(tl.abs(y3), axis=0))
    scale = row_scale(amax)
    inverse = tl.math.div_rn(1.0, scale)
    codes_ptr += row * K
    _store(y0, scale, inverse, codes_ptr, cols0, inside0, GELU)
    if PART1 > 0:
        _store(y1, scale, inverse, codes_ptr, cols1, inside1, GELU)
    if PART2 > 0:
        _store(y2, scale, inverse, codes_ptr, cols2, inside2, GELU)
    if PART3 > 0:
        _store(y3, scale, inverse, codes_ptr, cols3, inside3, GELU)
    tl.store(scales_ptr + row, scale)
