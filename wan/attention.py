"""Attention backends. All take q, k, v as [B, L, heads, head_dim] and return the same layout.

"sdpa" is PyTorch's scaled_dot_product_attention with its own kernel choice; "sdpa_cudnn" asks
for the cuDNN kernel first (the fastest exact kernel at Wan shapes on Hopper); "fp8_triton" is our
FP8 kernel (fp8_attention.py: NVIDIA GPUs of compute capability 8.9+ with Triton; elsewhere SDPA
with a warning); "flash_attn" and "sageattention" are offered only when their packages import.
"auto" picks per weight format (resolve_backend): fp8 attention where the weights already run
their matrices in fp8 (fp8_e4m3fn_fast), the exact cuDNN-first SDPA otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F

from ..gpu_support import warn_once
from .fp8_attention import fp8_attention, fp8_attention_unavailable


def _sdpa(q, k, v):
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


def _sdpa_cudnn(q, k, v):
    if q.device.type != "cuda":
        return _sdpa(q, k, v)
    with _cudnn_first():
        return _sdpa(q, k, v)


def _flash_attn(q, k, v):
    half = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    try:
        from flash_attn_interface import flash_attn_func  # FlashAttention 3
        out = flash_attn_func(q.to(half), k.to(half), v.to(half))
        out = out[0] if isinstance(out, tuple) else out
    except ImportError:
        from flash_attn import flash_attn_func
        out = flash_attn_func(q.to(half), k.to(half), v.to(half))
    return out.to(q.dtype)


def _sageattention(q, k, v):
    from sageattention import sageattn
    half = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    out = sageattn(q.to(half), k.to(half), v.to(half), tensor_layout="NHD")
    return out.to(q.dtype)


_BACKENDS: dict[str, tuple[Callable | None, str | None]] = {
    "auto": (None, None),
    "sdpa": (_sdpa, None),
    "sdpa_cudnn": (_sdpa_cudnn, None),
    "fp8_triton": (None, None),
    "flash_attn": (_flash_attn, "flash_attn"),
    "sageattention": (_sageattention, "sageattention"),
}


def _importable(module: str | None) -> bool:
    if module is None:
        return True
    if module == "flash_attn":
        return any(importlib.util.find_spec(m) is not None
                   for m in ("flash_attn_interface", "flash_attn"))
    return importlib.util.find_spec(module) is not None


def available_backends() -> list[str]:
    """Backends usable in this environment, default first."""
    return [name for name, (_, module) in _BACKENDS.items() if _importable(module)]


# What "auto" runs for each weight format (the README's table says the same).
AUTO_BY_WEIGHTS = {"fp8_e4m3fn_fast": "fp8_triton"}
AUTO_DEFAULT = "sdpa_cudnn"


def resolve_backend(name: str, weight_dtype: str | None = None) -> str:
    """A concrete backend name: "auto" becomes the choice for `weight_dtype`."""
    if name == "auto":
        return AUTO_BY_WEIGHTS.get(weight_dtype or "", AUTO_DEFAULT)
    return name


def fp8_attention_fallback(reason: str) -> str:
    """What is said when fp8_triton cannot run (here, or by the loader at load time)."""
    return f"attention 'fp8_triton' cannot run here: {reason}; using SDPA (cuDNN first) instead"


def get_backend(name: str, device: torch.device | None = None,
                head_dim: int | None = None) -> Callable:
    """The attention function of backend `name` for tensors on `device`. A backend that cannot
    run there (fp8_triton without Triton or on an older GPU) gives SDPA, with a warning that
    names the backend, the requirement and the fallback."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {list(_BACKENDS)}")
    fn, module = _BACKENDS[resolve_backend(name)]
    if not _importable(module):
        raise ValueError(f"attention backend {name!r} needs the package {module!r}, "
                         f"which is not installed; available: {available_backends()}")
    if resolve_backend(name) == "fp8_triton":
        reason = fp8_attention_unavailable(device or torch.device("cpu"), head_dim)
        if reason is None:
            return fp8_attention
        warn_once(fp8_attention_fallback(reason))
        return _sdpa_cudnn
    return fn
