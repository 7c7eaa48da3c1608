"""Per-token fp8 quantization of activations (the input of every fp8 matmul) in one pass.

PyTorch's statement (quant.rowwise.quantize_rows) makes several passes over the activation,
two of them in float32: abs, the row maximum, the division and the clamp, the cast. In eager
runs on CUDA one Triton program per row reads it once and writes its codes and scale, equal
to the statement's to the bit. Under torch.compile the statement stays: inductor fuses it into
the operation that produces the activation (a norm, a residual update), which an opaque kernel
would prevent.
"""

from __future__ import annotations

import torch

from ..gpu_support import triton_kernels_usable
from .rowwise import FP8, quantize_rows

MAX_WIDTH = 32768  # one row in one program's registers


def rows_kernel_usable(x: torch.Tensor) -> bool:
    return triton_kernels_usable(x) and x.shape[-1] <= MAX_WIDTH


def launch_rows(x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes [M, K] and float32 scales [M, 1] of x [M, K] (+ bias, then tanh-GELU if
    `gelu`), by the Triton kernel (callers check rows_kernel_usable)."""
    from .fp8_rows_kernel import fp8_rows_kernel

    rows, width = x.shape
    x = x.contiguous()
    codes = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = 1 << (width - 1).bit_length()
    fp8_rows_kernel[(rows,)](x, x if bias is None else bias.contiguous(), codes, scales, width,
                             HAS_BIAS=bias is not None, GELU=gelu, BLOCK=block,
                             num_warps=16 if block >= 8192 else 8)
    return codes, scales


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as fp8 codes and float32 scales [M, 1], one scale per token: the kernel in eager
    CUDA runs, quantize_rows elsewhere (the same numbers)."""
    if rows_kernel_usable(x) and not torch.compiler.is_compiling():
        return launch_rows(x)
    return quantize_rows(x, FP8)
