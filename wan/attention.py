"""Attention backends. All take q, k, v as [B, L, heads, head_dim] and return the same layout.

"sdpa" is PyTorch's scaled_dot_product_attention with its own kernel choice; "sdpa_cudnn" asks
for the cuDNN kernel first (PyTorch's fastest exact kernel at Wan shapes on Hopper);
"bf16_hopper" is our exact kernel for Hopper GPUs (bf16_attention.py; elsewhere cuDNN-first SDPA
with a warning); "fp8_triton" is our FP8 kernel (fp8_attention.py: NVIDIA GPUs of compute
capability 8.9+ with Triton; elsewhere SDPA with a warning); "flash_attn" and "sageattention"
are offered only when their packages import.
"auto" picks per weight format and device (resolve_backend): fp8 attention where the weights
already run their matrices in fp8 (fp8_e4m3fn_fast); otherwise exact attention: bf16_hopper
where it runs (a Hopper GPU with Triton, weights computing in bf16 or fp16), else cuDNN-first SDPA.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Callable

import torch

from ..gpu_support import warn_once
from . import bf16_attention, fp8_attention as fp8
from .bf16_attention import bf16_hopper_attention, bf16_hopper_fallback, bf16_hopper_unavailable
from .fp8_attention import fp8_attention, fp8_attention_unavailable
from .sdpa import sdpa, sdpa_cudnn


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
    "sdpa": (sdpa, None),
    "sdpa_cudnn": (sdpa_cudnn, None),
    "bf16_hopper": (None, None),
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


# What "auto" runs for each weight format (docs/nodes.md says the same): fp8 attention for
# weights whose matrices run in fp8; exact attention otherwise, ours where it runs.
AUTO_BY_WEIGHTS = {"fp8_e4m3fn_fast": "fp8_triton"}
AUTO_EXACT = "bf16_hopper"
AUTO_DEFAULT = "sdpa_cudnn"
FLOAT32_WEIGHTS = ("fp32", )


def resolve_backend(name: str, weight_dtype: str | None = None,
                    device: torch.device | None = None) -> str:
    """A concrete backend name: "auto" becomes the choice for `weight_dtype` on `device` (None:
    weights computing in 16 bits)."""
    if name != "auto":
        return name
    if weight_dtype in AUTO_BY_WEIGHTS:
        return AUTO_BY_WEIGHTS[weight_dtype]
    if (weight_dtype not in FLOAT32_WEIGHTS and device is not None
            and bf16_hopper_unavailable(device) is None):
        return AUTO_EXACT
    return AUTO_DEFAULT


def fp8_attention_fallback(reason: str) -> str:
    """What is said when fp8_triton cannot run (here, or by the loader at load time)."""
    return f"attention 'fp8_triton' cannot run here: {reason}; using SDPA (cuDNN first) instead"


def get_backend(name: str, device: torch.device | None = None,
                head_dim: int | None = None) -> Callable:
    """The attention function of backend `name` for tensors on `device`. A backend that cannot
    run there (fp8_triton without Triton or on an older GPU, bf16_hopper off Hopper) gives SDPA
    with cuDNN first, with a warning that names the backend, the requirement and the fallback
    ("auto" falls back without one: it promises only the fastest exact kernel that runs)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {list(_BACKENDS)}")
    device = device or torch.device("cpu")
    chosen_by_auto = name == "auto"
    name = resolve_backend(name, device=device)
    fn, module = _BACKENDS[name]
    if not _importable(module):
        raise ValueError(f"attention backend {name!r} needs the package {module!r}, "
                         f"which is not installed; available: {available_backends()}")
    if name == "fp8_triton":
        reason = fp8_attention_unavailable(device, head_dim)
        if reason is None:
            return fp8_attention
        warn_once(fp8_attention_fallback(reason))
        return sdpa_cudnn
    if name == "bf16_hopper":
        reason = bf16_hopper_unavailable(device, head_dim)
        if reason is None:
            return bf16_hopper_attention
        if not chosen_by_auto:
            warn_once(bf16_hopper_fallback(reason))
        return sdpa_cudnn
    return fn


def wave_rows(attend: Callable, batch_heads: int, head_dim: int, device: torch.device,
              dtype: torch.dtype) -> int | None:
    """Query rows per launch of the self-attention `attend` that fill whole waves of the GPU,
    for our Hopper kernels (fp8_triton's and bf16_hopper's: one program of ROWS_PER_PROGRAM query
    rows at a time on each multiprocessor, batch_heads programs per row tile): the rows of the
    fewest row tiles whose programs are a multiple of the multiprocessors. None for other
    backends and devices. Row chunks of a multiple of it leave no wave of their launch part
    empty but the last chunk's (chunks.row_chunks; bench/results/2026-11-26-h100-eager-whole-waves/).
    """
    if attend is fp8_attention:
        rows = fp8.hopper_rows_per_program(device, head_dim)
    elif attend is bf16_hopper_attention:
        rows = bf16_attention.hopper_rows_per_program(device, head_dim, dtype)
    else:
        return None
    if rows is None:
        return None
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    return rows * (multiprocessors // math.gcd(batch_heads, multiprocessors))
