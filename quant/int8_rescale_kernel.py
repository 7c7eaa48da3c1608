"""The int8 product's epilogue in one pass: the int32 products of torch._int_mm times the row
(token) and column (output channel) scales, plus the bias, rounded once to the output dtype.

The same float32 operations in the same order as the PyTorch statement
(`acc.float() * row_scales * col_scales + bias.float()`, then the cast; quant/kernels.py), with
Triton's multiply-add contraction off at the launch, so the output equals the statement's to the
bit without the statement's float32 temporaries of the product's size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_rescale_kernel(acc_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, M, N,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.load(acc_ptr + offsets, mask=inside, other=0).to(tl.float32)
    row_scale = tl.load(row_scale_ptr + rows, mask=rows < M, other=0.0)
    col_scale = tl.load(col_scale_ptr + cols, mask=cols < N, other=0.0)
    y = acc * row_scale[:, None]
    y = y * col_scale[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)
