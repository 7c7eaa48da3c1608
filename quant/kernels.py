"""The low-precision matrix products, with the checks that decide whether a kernel applies.

FP8: `torch._scaled_mm` with row-wise scales (float32 [M, 1] per token, [1, N] per output
channel) and the bias in its epilogue, bf16 out. It needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper)
and both matrix widths (K, N) multiples of 16.

INT8: `torch._int_mm` (int8 x int8 -> int32) on CUDA, which needs more than 16 rows (fewer are
padded with zero rows) and K, N multiples of 8. Elsewhere the same integer product is computed
exactly in float64: every partial sum is an integer below K * 127^2, far inside float64's
2^53, so both paths give identical int32-valued results.

INT8 uses torch's own kernel rather than torchao on purpose: torchao's quantized weights are
tensor subclasses, which the block swap engine cannot move as raw bytes (it swaps every tensor's
`.data` for a view into a device buffer); ours are plain int8 tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu_support import fp8_unavailable, triton_kernels_usable, warn_once
from .fp8_rows import quantize_activations

def fp8_matmul_unavailable(device: torch.device) -> str | None:
    """Why `torch._scaled_mm` cannot run on `device`, or None when it can."""
    return fp8_unavailable(device, "fp8 matmul")


def fp8_shape_unsupported(in_features: int, out_features: int) -> str | None:
    if in_features % 16 or out_features % 16:
        return (f"fp8 matmul needs widths that are multiples of 16; this layer is "
                f"{in_features} -> {out_features}")
    return None


def fp8_scaled_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      fast_accum: bool = True, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16) times the fp8 weight [N, K] with scales [N] (+ bias [N]): bf16 [M, N]. The
    activations are quantized to fp8 per token on the fly."""
    codes, scales = quantize_activations(x)
    return fp8_codes_matmul(codes, scales, weight, weight_scale, fast_accum, bias)


def fp8_codes_matmul(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor, fast_accum: bool = True,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Activation codes [M, K] (fp8, scales [M, 1]) times the fp8 weight [N, K] (+ bias [N]):
    bf16 [M, N]. The bias is added in the kernel's epilogue, before the one rounding to bf16:
    no pass over the output of its own (which cost 0.1-0.16 ms a matrix at 5B 720p on an H100
    wherever no later fused step took it in)."""
    # weight.t() is the column-major [K, N] operand the kernel wants: a view, nothing copied.
    # Fast accumulation: the tensor cores' own accumulator over the K loop, as cuBLAS offers it
    # for fp8 (bench/results: about 15% less time at Wan's widths, the same distance to float32).
    return torch._scaled_mm(codes, weight.t(), scale_a=scales,
                            scale_b=weight_scale.view(1, -1),
                            bias=None if bias is None else bias.to(torch.bfloat16),
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


# torch._int_mm's limits on CUDA (cuBLAS int8 GEMM)
_INT_MM_MIN_ROWS = 17
_INT_MM_MULTIPLE = 8


def int8_kernel_unsupported(in_features: int, out_features: int) -> str | None:
    if in_features % _INT_MM_MULTIPLE or out_features % _INT_MM_MULTIPLE:
        return (f"int8 matmul (torch._int_mm) needs widths that are multiples of 8; this layer "
                f"is {in_features} -> {out_features}; computing it in float64 instead")
    return None


def int8_matmul(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact integer product codes [M, K] x weight [N, K]^T as float32 [M, N]."""
    if codes.is_cuda:
        reason = int8_kernel_unsupported(codes.shape[1], weight.shape[0])
        if reason is None:
            return int_mm_padded(codes, weight)
        warn_once(reason)
    return exact_int8_product(codes, weight)


def int_mm_padded(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch._int_mm as float32, with zero rows added up to its minimum row count (and dropped
    after)."""
    return _int_mm_int32(codes, weight).float()


def _int_mm_int32(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = codes.shape[0]
    if rows < _INT_MM_MIN_ROWS:
        codes = F.pad(codes, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
    # weight.t() is the column-major [K, N] operand cuBLAS' int8 GEMM wants: a view
    return torch._int_mm(codes, weight.t())[:rows]


def int8_scaled_matmul(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """(codes [M, K] x weight [N, K]^T) * scales [M, 1] * weight_scale [N] (+ bias [N]), rounded
    once to `dtype`. Eager on CUDA: torch._int_mm's int32 products and one Triton pass
    (int8_rescale_kernel) that writes the output, the same bits as the statement below without
    its float32 temporaries of the product's size (1.6 GB each at the 5B FFN's first matrix,
    27280 x 14336). Elsewhere and under torch.compile (which fuses it) the statement."""
    if (triton_kernels_usable(codes) and not torch.compiler.is_compiling()
            and int8_kernel_unsupported(codes.shape[1], weight.shape[0]) is None):
        return _rescale(_int_mm_int32(codes, weight), scales, weight_scale, bias, dtype)
    out = int8_matmul(codes, weight) * scales * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def _rescale(acc: torch.Tensor, scales: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    from .int8_rescale_kernel import int8_rescale_kernel

    rows, cols = acc.shape
    out = torch.empty(rows, cols, dtype=dtype, device=acc.device)
    block_m, block_n = 32, 128
    int8_rescale_kernel[(-(-rows // block_m), -(-cols // block_n))](
        acc, scales.reshape(rows).contiguous(), weight_scale.contiguous(),
        acc if bias is None else bias.contiguous(), out, rows, cols, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, enable_fp_fusion=False)
    return out


def exact_int8_product(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same integers as torch._int_mm, computed in float64 (exact, see above)."""
    return (codes.double() @ weight.double().t()).float()
