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

from ..gpu_support import kernel_operator, triton_kernels_usable
from ..quant.rowwise import FP8, quantize_rows

# the kernel keeps a block of rows of the stacked up factors in registers
MAX_RANK = 256
_MIN_RANK = 16  # the tensor-core product's smallest inner width
_BLOCK_N, _BLOCK_K = 64, 128


def stack_terms(terms: list[tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-rank terms (down [r, K], up [N, r], scale) as one pair: up [N, R] (each block times
    its scale, in float32, then `dtype`) and down [R, K] in `dtype`, R the ranks' sum padded
    with zeros to a power of two of at least 16."""
    ups = torch.cat([up.float() * scale for _, up, scale in terms], dim=1).to(dtype)
    downs = torch.cat([down.to(dtype) for down, _, _ in terms], dim=0)
    rank = downs.shape[0]
    padded = max(_MIN_RANK, 1 << (rank - 1).bit_length())
    if padded != rank:
        ups = F.pad(ups, (0, padded - rank))
        downs = F.pad(downs, (0, 0, 0, padded - rank))
    return ups.contiguous(), downs.contiguous()


def fp8_sum_reference(codes: torch.Tensor, scale: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The statement in PyTorch: (codes [N, K], scales [N]) of codes*scale + up @ down."""
    summed = codes.float() * scale[:, None] + up.float() @ down.float()
    new_codes, new_scale = quantize_rows(summed, FP8)
    return new_codes, new_scale.view(-1)


def _launch(codes: torch.Tensor, scale: torch.Tensor, up: torch.Tensor, down: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    from .fp8_sum_kernel import fp8_sum_rows_kernel

    n, k = codes.shape
    out_codes = torch.empty_like(codes)
    out_scale = torch.empty(n, dtype=torch.float32, device=codes.device)
    fp8_sum_rows_kernel[(-(-n // _BLOCK_N),)](
        codes.contiguous(), scale.contiguous(), up, down, out_codes, out_scale, n, k,
        R=down.shape[0], BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4, num_stages=3)
    return out_codes, out_scale


def _fp8_sum_shape(codes, scale, up, down):
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
        up, down = stack_terms(terms, torch.bfloat16)
        return FP8_SUM_ROWS(codes, scale, up, down)
    up, down = stack_terms(terms, torch.float32)
    return fp8_sum_reference(codes, scale, up, down)
