"""The feed-forward's middle step for fp8 matmuls: tanh-GELU of the hidden activation and its
per-token fp8 quantization in one pass.

PyTorch runs it as three passes over the largest activation of a block (14336 wide at 5B):
the GELU, then the row maximum, then the division and cast, and torch.compile's fused version
still reads the row twice. The kernel reads each row once and writes its codes and scale. The
codes are those of quant.rowwise.quantize_rows applied to the GELU computed in float32, but
where the kernel's GELU and its product with 1 / scale (a few float32 ulps from the statement's)
put a value on the other side of an fp8 rounding edge (the PyTorch path rounds the GELU to bf16
first: a difference of bf16 rounding).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..gpu_support import kernel_operator
from .fp8_rows import launch_rows, rows_kernel_usable, rows_shape
from .rowwise import FP8, quantize_rows


def gelu_quantize_reference(x: torch.Tensor, bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch statement: float32 GELU of x (+ bias), then per-row fp8 codes and scales
    [M, 1]."""
    x = x.float() if bias is None else x.float() + bias.float()
    return quantize_rows(F.gelu(x, approximate="tanh"), FP8)


def _gelu_fp8_rows(x: torch.Tensor, bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_rows(x, bias, gelu=True)


GELU_FP8_ROWS = kernel_operator("wan_enhanced_quant::gelu_fp8_rows", _gelu_fp8_rows,
                                rows_shape)


def gelu_quantize(x: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU(x + bias) [M, K] as fp8 codes and float32 scales [M, 1]: the kernel on CUDA, the
    PyTorch statement elsewhere."""
    if rows_kernel_usable(x):
        return GELU_FP8_ROWS(x, bias)
    return gelu_quantize_reference(x, bias)


def _gelu_fp8_rows_into(x: torch.Tensor, bias: torch.Tensor | None, codes: torch.Tensor,
                        scales: torch.Tensor, start: int) -> None:
    rows = slice(start, start + x.shape[0])
    if rows_kernel_usable(x):
        launch_rows(x, bias, gelu=True, out=(codes[rows], scales[rows]))
    else:
        piece_codes, piece_scales = gelu_quantize_reference(x, bias)
        codes[rows], scales[rows] = piece_codes, piece_scales


def _nothing(*args) -> None:
    return None


# writes rows start.. of codes and scales: inside a compiled graph into the graph's own buffers
GELU_FP8_ROWS_INTO = kernel_operator("wan_enhanced_quant::gelu_fp8_rows_into",
                                     _gelu_fp8_rows_into, _nothing, mutates=("codes", "scales"))


def gelu_quantize_in_pieces(product: Callable[[int, int], torch.Tensor], rows: int, width: int,
                            bias: torch.Tensor | None, pieces: list[tuple[int, int]],
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_quantize of an activation [rows, width] that is never whole: product(start, end)
    makes rows start..end of it (a matrix product), piece by piece (`pieces`: row ranges
    covering 0..rows), and each piece's codes and scales go into rows of one codes and one
    scales tensor. Each row on its own: the codes of the whole activation, to the bit, while
    only one piece of it exists at a time."""
    codes = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=device)
    for start, end in pieces:
        GELU_FP8_ROWS_INTO(product(start, end), bias, codes, scales, start)
    return codes, scales
