"""An fp8 weight with its LoRA terms added, for one call: codes and per-row scales of

    W' = codes * scale + sum_i s_i up_i @ down_i

requantized per output channel exactly as quant.rowwise quantizes a weight. For a video's tens
of thousands of tokens this is far cheaper than adding the terms to the output: one pass over
a matrix of codes (1 byte each) instead of output-sized bf16 sums after every layer. The result
is what merging the LoRAs into the weights gives (merge, then quantize), computed per call, so
the factors stay apart and a strength can change without a reload.

The kernel (fp8_sum_kernel.py) reads the codes twice (row maxima, then the codes) and never
holds the float matrix; elsewhere `fp8_sum_reference` states the same numbers with PyTorch
operations (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu_support import KERNEL_OPTIONS, kernel_operator, triton_kernels_usable
from ..quant.rowwise import FP8, quantize_rows

# the kernel keeps a block of rows of the stacked up factors in registers
MAX_RANK = 256
_MIN_RANK = 16  # the tensor-core product's smallest inner width


def stack_terms(terms: list[tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Low-rank terms (down [r, K], up [N, r], scale) as one (up [N, R], down [R, K], alpha)
    in `dtype` with sum_i s_i up_i @ down_i = alpha * up @ down, R the ranks' sum padded with
    zeros to a power of two of at least 16. One term of such a rank, already in `dtype`, is
    taken as it is (alpha its scale: nothing is copied); several are concatenated, each up
    block times its scale in float32 (alpha 1)."""
    if len(terms) == 1:
        down, up, scale = terms[0]
        rank = down.shape[0]
        if (rank >= _MIN_RANK and rank & (rank - 1) == 0 and down.dtype == up.dtype == dtype
                and down.is_contiguous() and up.is_contiguous()):
            return up, down, float(scale)
    ups = torch.cat([up.float() * scale for _, up, scale in terms], dim=1).to(dtype)
    downs = torch.cat([down.to(dtype) for down, _, _ in terms], dim=0)
    rank = downs.shape[0]
    padded = max(_MIN_RANK, 1 << (rank - 1).bit_length())
    if padded != rank:
        ups = F.pad(ups, (0, padded - rank))
        downs = F.pad(downs, (0, 0, 0, padded - rank))
    return ups.contiguous(), downs.contiguous(), 1.0


def fp8_sum_reference(codes: torch.Tensor, scale: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor, alpha: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The statement in PyTorch: (codes [N, K], scales [N]) of
    codes * scale + alpha * up @ down."""
    summed = codes.float() * scale[:, None] + alpha * (up.float() @ down.float())
    new_codes, new_scale = quantize_rows(summed, FP8)
    return new_codes, new_scale.view(-1)


def _launch(codes: torch.Tensor, scale: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .fp8_sum_kernel import fp8_sum_rows_kernel

    n, k = codes.shape
    out_codes = torch.empty_like(codes)
    out_scale = torch.empty(n, dtype=torch.float32, device=codes.device)

    def grid(meta):
        return (-(-n // meta["BLOCK_N"]),)

    fp8_sum_rows_kernel[grid](codes.contiguous(), scale.contiguous(), up, down, out_codes,
                              out_scale, alpha, n, k, R=down.shape[0], **KERNEL_OPTIONS)
    return out_codes, out_scale


def _fp8_sum_shape(codes, scale, up, down, alpha):
    return (torch.empty_like(codes), codes.new_empty(codes.shape[0], dtype=torch.float32))


FP8_SUM_ROWS = kernel_operator("wan_enhanced_lora::fp8_sum_rows", _launch, _fp8_sum_shape)


def fp8_kernel_usable(codes: torch.Tensor, rank: int) -> bool:
    return triton_kernels_usable(codes) and rank <= MAX_RANK


def fp8_sum(codes: torch.Tensor, scale: torch.Tensor,
            terms: list[tuple[torch.Tensor, torch.Tensor, float]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales [N]) of the fp8 weight plus the low-rank terms: the kernel on CUDA,
    the PyTorch statement elsewhere."""
    rank = sum(down.shape[0] for down, _, _ in terms)
    if fp8_kernel_usable(codes, rank):
        return FP8_SUM_ROWS(codes, scale, *stack_terms(terms, torch.bfloat16))
    up, down, alpha = stack_terms(terms, torch.float32)
    return fp8_sum_reference(codes, scale, up, down, alpha)
