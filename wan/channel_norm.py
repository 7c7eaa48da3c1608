"""The VAE's channel RMS norm (and the SiLU after it) in one pass over channels-last activations.

ChannelRMSNorm states the norm in PyTorch: F.normalize over the channels (x / max(||x||_2,
1e-12)), times sqrt(C), times a per-channel gain; a SiLU follows in residual blocks and heads.
Run so in bf16 that is five passes over the activation (the norm, the division, two products,
the SiLU), each rounding to bf16. When the decoder runs in channels_last_3d on CUDA (see
CausalVideoVAE), every pixel's channel vector is one contiguous row of C values, and one Triton
program reads a block of such rows once, computes in float32 and rounds once; it writes where
the caller says, e.g. straight into the input buffer of the causal convolution that follows.

`reference` is the same arithmetic in PyTorch float32 operations (the kernel's tests compare
against it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..gpu_support import KERNEL_OPTIONS, triton_kernels_usable

MAX_CHANNELS = 4096  # one row in one program's registers
ROW_BLOCK_ELEMENTS = 8192  # rows x (channels rounded up to a power of two) per program
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference(x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result in PyTorch: float32 throughout (x + bias where a per-channel bias
    is given), rounded once to x's dtype."""
    v = x.float()
    if bias is not None:
        v = v + bias.float().reshape(-1, *([1] * (x.dim() - 2)))
    gain = gamma.float().reshape(-1, *([1] * (x.dim() - 2)))
    y = F.normalize(v, dim=1) * scale * gain
    if silu:
        y = F.silu(y)
    return y.to(x.dtype)


def batch_stride(t: torch.Tensor) -> int | None:
    """The distance between batch items of a [B, C, ...] tensor whose items each hold their
    pixels as contiguous rows of C channels (channels-last), or None if they do not."""
    if t.dim() < 3 or not t[0].movedim(0, -1).is_contiguous():
        return None
    return t.stride(0)


def kernel_usable(x: torch.Tensor, out: torch.Tensor) -> bool:
    """The kernel can read x and write out (same shape and dtype, channels-last rows, CUDA)."""
    return (triton_kernels_usable(x) and out.device == x.device and out.shape == x.shape
            and out.dtype == x.dtype and x.dtype in DTYPES and 0 < x.shape[1] <= MAX_CHANNELS
            and x.numel() > 0 and batch_stride(x) is not None
            and batch_stride(out) is not None)


def launch(x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool,
           out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference(x, gamma, scale, silu, bias) written into `out` by the Triton kernel (callers
    check kernel_usable(x, out)); returns out."""
    from .channel_norm_kernel import channel_norm_kernel

    batch, channels = x.shape[:2]
    rows = math.prod(x.shape[2:])
    block_c = 1 << max(0, (channels - 1).bit_length())
    block_rows = max(1, ROW_BLOCK_ELEMENTS // block_c)
    grid = (-(-rows // block_rows), batch)
    # kernel_usable found both in channels-last rows: their batch strides are stride(0)
    channel_norm_kernel[grid](x, x if bias is None else bias.reshape(-1).contiguous(),
                              gamma.reshape(-1).contiguous(), out, rows, channels, x.stride(0),
                              out.stride(0), float(scale), HAS_BIAS=bias is not None,
                              SILU=silu, BLOCK_ROWS=block_rows, BLOCK_C=block_c, num_warps=8,
                              **KERNEL_OPTIONS)
    return out
