"""Exact attention on Hopper GPUs: our warp-specialized flash-attention kernel in bf16 or fp16
(bf16_attention_hopper.py; float32 accumulation and softmax, like cuDNN's and FlashAttention's
kernels, and faster than cuDNN at Wan's self-attention shapes: bench/results/). The backend
"bf16_hopper"; what "auto" picks on Hopper for weights that compute in bf16 or fp16.

Short key sequences (text cross-attention: 512 rows; image tokens: 257) go to cuDNN's SDPA,
which is faster there; so do float32 inputs (the kernel computes in 16 bits).
"""

from __future__ import annotations

import functools

import torch

from ..gpu_support import import_gluon_kernel, kernel_operator, warn_once
from .sdpa import sdpa_cudnn

HEAD_DIM = 128
DTYPES = (torch.bfloat16, torch.float16)
# Shorter key sequences go to cuDNN, which was faster at 512 text keys (bench/results/).
MIN_KEYS = 1024


@functools.cache
def _kernel_module():
    """bf16_attention_hopper, or the reason it cannot be imported (a str)."""
    return import_gluon_kernel(".bf16_attention_hopper", __package__)


def bf16_hopper_unavailable(device: torch.device, head_dim: int | None = None,
                            dtype: torch.dtype | None = None) -> str | None:
    """Why the kernel cannot run on `device` (for this head_dim and compute dtype), or None."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"it needs an NVIDIA Hopper GPU (compute capability 9.0); this runs on {device.type}"
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) != (9, 0):
        return (f"it needs a Hopper GPU (compute capability 9.0); {props.name} has "
                f"{props.major}.{props.minor}")
    if head_dim is not None and head_dim != HEAD_DIM:
        return f"it takes head_dim {HEAD_DIM}; this model has {head_dim}"
    if dtype is not None and dtype not in DTYPES:
        return f"it computes in bf16 or fp16; these weights compute in {dtype}"
    module = _kernel_module()
    return module if isinstance(module, str) else None


def hopper_rows_per_program(device: torch.device, head_dim: int,
                            dtype: torch.dtype) -> int | None:
    """The query rows a program of the kernel takes, where it runs on `device` for this head_dim
    and compute dtype (a program fills a multiprocessor's registers: one at a time on each);
    None where it does not."""
    if _FAILED or bf16_hopper_unavailable(device, head_dim, dtype) is not None:
        return None
    return _kernel_module().ROWS_PER_PROGRAM


def bf16_hopper_fallback(reason: str) -> str:
    """What is said when bf16_hopper cannot run (here, or by the loader at load time)."""
    return f"attention 'bf16_hopper' cannot run here: {reason}; using SDPA (cuDNN first) instead"


_FAILED: list[str] = []  # the first launch's error, if it had one


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t contiguous with a 16-byte-aligned start (what TMA descriptors take)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if not _FAILED:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        try:
            _kernel_module().attend(_tma_ready(q), _tma_ready(k), _tma_ready(v), out)
            return out
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # the kernel did not build with this Triton
            _FAILED.append(f"it failed to build here ({type(exc).__name__}: {exc})")
            warn_once(bf16_hopper_fallback(_FAILED[0]))
    return sdpa_cudnn(q, k, v)


def _launch_shape(q, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# registered at import: never inside a compiled region
HOPPER_ATTENTION = kernel_operator("wan_enhanced_attention::bf16_hopper_attention", _launch,
                                   _launch_shape)


def bf16_hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The backend: attention of q [B, Lq, heads, 128] over k, v [B, L, heads, 128]. Callers
    check bf16_hopper_unavailable first."""
    fits = (k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
            and q.shape[-1] == HEAD_DIM and q.dtype in DTYPES and k.dtype == v.dtype == q.dtype)
    if not fits or k.shape[1] < MIN_KEYS:  # SDPA also says what is wrong with a bad input
        return sdpa_cudnn(q, k, v)
    return HOPPER_ATTENTION(q, k, v)
