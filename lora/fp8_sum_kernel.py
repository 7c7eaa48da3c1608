"""Triton kernel: an fp8 weight with low-rank terms added, requantized per row (see
fp8_sum.py). Imported only where Triton is installed."""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
SMALLEST_SCALE = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal number


@triton.jit
def _summed_tile(codes_ptr, down_ptr, up, scale, alpha, rows, ranks, k0, N, K,
                 BLOCK_K: tl.constexpr):
    """codes * scale + alpha * up @ down for rows x [k0, k0 + BLOCK_K) in float32 (zeros
    outside)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < N) & (cols[None, :] < K)
    codes = tl.load(codes_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=inside,
                    other=0.0).to(tl.float32)
    down = tl.load(down_ptr + ranks[:, None] * K + cols[None, :], mask=cols[None, :] < K,
                   other=0.0)
    return codes * scale[:, None] + alpha * tl.dot(up, down)


def configs():
    """Few rows per program for the 3072-row matrices (enough programs for every SM), more
    for the wide ones."""
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
            for n, k, w, st in ((16, 256, 4, 3), (16, 128, 2, 3), (32, 128, 4, 3),
                                (64, 128, 4, 3), (32, 256, 8, 3))]


@triton.autotune(configs=configs(), key=["N", "K", "R"])
@triton.jit
def fp8_sum_rows_kernel(codes_ptr, scale_ptr, up_ptr, down_ptr, out_codes_ptr, out_scale_ptr,
                        alpha, N, K, R: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """One program per BLOCK_N rows: a first pass over the rows for their largest magnitude,
    a second that writes their codes (the low-rank product is formed twice rather than kept:
    it is cheap next to the memory it would take)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    up = tl.load(up_ptr + rows[:, None].to(tl.int64) * R + ranks[None, :],
                 mask=rows[:, None] < N, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=rows < N, other=0.0)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _summed_tile(codes_ptr, down_ptr, up, scale, alpha, rows, ranks, k0, N, K,
                         BLOCK_K)
        amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
    new_scale = tl.maximum(amax / FP8_MAX, SMALLEST_SCALE)
    tl.store(out_scale_ptr + rows, new_scale, mask=rows < N)
    for k0 in range(0, K, BLOCK_K):
        w = _summed_tile(codes_ptr, down_ptr, up, scale, alpha, rows, ranks, k0, N, K,
                         BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        codes = tl.clamp(w / new_scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        tl.store(out_codes_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], codes,
                 mask=(rows[:, None] < N) & (cols[None, :] < K))
