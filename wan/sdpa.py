"""PyTorch's scaled_dot_product_attention in the backends' layout ([B, L, heads, head_dim]):
with PyTorch's own kernel choice, or with cuDNN's kernel first (the fastest of PyTorch's exact
kernels at Wan's shapes on Hopper; what ComfyUI itself runs there)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _cudnn_first():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # set_priority arrived in torch 2.6
        return sdpa_kernel(order)


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if q.device.type != "cuda":
        return sdpa(q, k, v)
    with _cudnn_first():
        return sdpa(q, k, v)
