"""Per-token fp8 quantization of activations (the input of every fp8 matmul) in one pass.

PyTorch's statement (quant.rowwise.quantize_rows) makes several passes over the activation,
two of them in float32: abs, the row maximum, the division and the clamp, the cast. In eager
runs on CUDA one Triton program per row reads it once and writes its codes and scale, equal
to the statement's to the bit. Under torch.compile the statement stays (quantize_activations):
inductor fuses it into the operation that produces the activation (a norm, a residual update),
which an opaque kernel would prevent; where that operation is itself opaque (an attention
kernel), the kernel runs inside the graph too, as an operator of its own
(quantize_opaque_output).
"""

from __future__ import annotations

import torch

from ..gpu_support import KERNEL_OPTIONS, kernel_operator, triton_kernels_usable
from .rowwise import FP8, quantize_rows

MAX_WIDTH = 32768  # one row in one program's registers
GRANULE = 256  # the narrowest part of a row (fp8_rows_kernel)
MOST_PARTS = 4


def row_parts(width: int) -> tuple[int, int, int, int]:
    """A row of `width` as up to four power-of-two parts, widest first (zeros: absent), that
    cover it with little to spare: the width rounded up to GRANULE, in binary (8960 = 8192 +
    512 + 256; 14336 = 8192 + 4096 + 2048); past four parts the narrowest are merged into one
    power of two. One power of two for a width of at most GRANULE."""
    if width <= GRANULE:
        return (1 << (width - 1).bit_length(), 0, 0, 0)
    padded = -(-width // GRANULE) * GRANULE
    parts = [1 << bit for bit in reversed(range(padded.bit_length())) if padded >> bit & 1]
    if len(parts) > MOST_PARTS:
        tail = sum(parts[MOST_PARTS - 1:])
        parts = parts[:MOST_PARTS - 1] + [1 << (tail - 1).bit_length()]
    return tuple(parts + [0] * (MOST_PARTS - len(parts)))


def rows_kernel_usable(x: torch.Tensor) -> bool:
    return triton_kernels_usable(x) and x.shape[-1] <= MAX_WIDTH


def launch_rows(x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False,
                out: tuple[torch.Tensor, torch.Tensor] | None = None, warps: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes [M, K] and float32 scales [M, 1] of x [M, K] (+ bias, then tanh-GELU if
    `gelu`), by the Triton kernel (callers check rows_kernel_usable); written into `out`
    (contiguous codes and scales of those shapes, e.g. rows of larger ones) where given.
    `warps`: per row program, row_warps(K) unless given (bench/row_kernels_gpu.py tries
    others)."""
    from .fp8_rows_kernel import fp8_rows_kernel

    rows, width = x.shape
    x = x.contiguous()
    if out is None:
        codes = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    else:
        codes, scales = out
    parts = row_parts(width)
    fp8_rows_kernel[(rows,)](x, x if bias is None else bias.contiguous(), codes, scales, width,
                             HAS_BIAS=bias is not None, GELU=gelu, PART0=parts[0],
                             PART1=parts[1], PART2=parts[2], PART3=parts[3],
                             num_warps=warps or row_warps(width), **KERNEL_OPTIONS)
    return codes, scales


def row_warps(width: int) -> int:
    """Warps per row program: 8 for rows of 8192 columns or more, else 4 (H100, the fastest
    at Wan's widths: bench/results/README.md, experiments)."""
    return 8 if width >= 8192 else 4


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_rows(x)


def rows_shape(x: torch.Tensor, bias: torch.Tensor | None = None):
    """What launch_rows returns for x [M, K], without computing it (the row operators' fake
    outputs while torch.compile traces): fp8 codes [M, K] and float32 scales [M, 1]."""
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(x.shape[0], 1, dtype=torch.float32))


FP8_ROWS = kernel_operator("wan_enhanced_quant::fp8_rows", _rows, rows_shape)


def quantize_opaque_output(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations for an x made by an operator torch.compile cannot fuse into (an
    attention kernel): the kernel also inside compiled graphs, as an operator of its own. There
    the statement could only become a reduction of its own that reads each row twice (H100, the
    5B attention output, 27280 x 3072: 0.17 ms against one pass)."""
    if rows_kernel_usable(x):
        return FP8_ROWS(x)
    return quantize_rows(x, FP8)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as fp8 codes and float32 scales [M, 1], one scale per token: the kernel in eager
    CUDA runs, quantize_rows elsewhere (the same numbers)."""
    if rows_kernel_usable(x) and not torch.compiler.is_compiling():
        return launch_rows(x)
    return quantize_rows(x, FP8)
