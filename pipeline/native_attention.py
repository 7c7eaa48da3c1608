"""ComfyUI's own Wan models with our attention kernels.

ComfyUI's Wan models (comfy.ldm.wan: the text-, image- and first-last-frame-to-video models,
VACE, S2V, Animate's video model) send every attention call through one function, and a model
option, transformer_options["optimized_attention_override"], may take each call:

    override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
             skip_output_reshape=False, **kwargs)

with func ComfyUI's own attention function and q, k, v [B, L, heads * head_dim] (or [B, heads,
L, head_dim] with skip_reshape). NativeAttention is such an override: it gives a call to our
kernel when the kernel takes it exactly as it comes (no mask, 16-bit inputs on a GPU where the
kernel runs, head size 128, a long key sequence), and every other call to ComfyUI's function
(or to an override already installed) unchanged. Each reason for handing a call back is logged
once and counted. It touches only the activations a call hands it, so ComfyUI's offloading,
LoRAs, caches and compile nodes keep working around it.

Modes: "fp8" our fp8 attention kernel; "bf16" our exact Hopper kernel; "auto" the fp8 kernel
where it runs, else the exact one, else ComfyUI's.

CUDA graphs: newer ComfyUIs (their "model compiler") run a block once, then capture it into a
CUDA graph and replay that. A kernel's first launch for a shape builds and loads it, which a
capture cannot hold; so a call made while the stream is capturing, of a kernel and shapes that
have not run uncaptured in this process, is handed back (ComfyUI's own attention is
capture-safe). After ComfyUI's uncaptured first run, the captured calls are ours.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import torch


MODES = ("auto", "fp8", "bf16")
HEAD_DIM = 128
_LOG = logging.getLogger("wan_enhanced")
# (kernel, query shape, key shape, dtype, device) of calls that ran outside a CUDA graph capture
_RAN_UNCAPTURED: set[tuple] = set()


class NativeAttention:
    """An optimized_attention_override for ComfyUI's Wan models (see the module docstring)."""

    def __init__(self, mode: str = "auto", inner: Callable | None = None):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {list(MODES)}")
        self.mode = mode
        self.inner = inner  # an override installed before ours: the calls we hand back go there
        self.ours = Counter()  # kernel name -> calls it took
        self.handed_back = Counter()  # reason -> calls given to ComfyUI's function

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        kernel, reason = self.kernel_for(q, k, v, heads, mask, skip_reshape)
        if kernel is None:
            return self._handed_back_call(reason, func, q, k, v, heads, mask, attn_precision,
                                          skip_reshape, skip_output_reshape, kwargs)
        name, attend = kernel
        signature = (name, tuple(q.shape), tuple(k.shape), q.dtype, q.device)
        if _capturing(q):
            if signature not in _RAN_UNCAPTURED:
                return self._handed_back_call(
                    "a CUDA graph capture before the kernel ran uncaptured at these shapes",
                    func, q, k, v, heads, mask, attn_precision, skip_reshape,
                    skip_output_reshape, kwargs)
        else:
            _RAN_UNCAPTURED.add(signature)
        self.ours[name] += 1
        q4, k4, v4 = (_heads_last(t, heads, skip_reshape) for t in (q, k, v))
        out = attend(q4, k4, v4)  # [B, Lq, heads, head_dim]
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)

    def kernel_for(self, q, k, v, heads, mask, skip_reshape):
        """((name, kernel), None) for a call our kernel takes, else (None, the reason)."""
        if mask is not None:
            return None, "a mask"
        if not (q.dim() == k.dim() == v.dim() == (4 if skip_reshape else 3)):
            return None, f"inputs of {q.dim()} dimensions"
        head_dim = q.shape[-1] if skip_reshape else q.shape[-1] // heads
        keys = k.shape[2] if skip_reshape else k.shape[1]
        if head_dim != HEAD_DIM or (not skip_reshape and q.shape[-1] != heads * head_dim):
            return None, f"head size {head_dim} (our kernels take {HEAD_DIM})"
        if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
            return None, "keys and values shaped unlike the queries"
        # (imported here: the kernels' modules import quant, whose block_linears imports
        # wan.dit, which imports wan.attention; from a module imported first, that loop breaks)
        from ..wan import attention as backends

        device = q.device
        candidates = []  # (name, kernel, fewest keys it takes, why it cannot run here)
        if self.mode in ("auto", "fp8"):
            candidates.append(("fp8", backends.fp8_attention, backends.fp8.MIN_KEYS,
                               backends.fp8_attention_unavailable(device, head_dim)))
        if self.mode in ("auto", "bf16"):
            candidates.append(("bf16", backends.bf16_hopper_attention,
                               backends.bf16_attention.MIN_KEYS,
                               backends.bf16_hopper_unavailable(device, head_dim)))
        runnable = [c for c in candidates if c[3] is None]
        if not runnable:
            which = "our fp8 kernel" if self.mode == "fp8" else "our kernels"
            return None, f"{which} cannot run here: {candidates[-1][3]}"
        if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
            return None, f"{q.dtype} inputs (our kernels take bf16 or fp16)"
        for name, kernel, min_keys, _ in runnable:
            if keys >= min_keys:
                return (name, kernel), None
        fewest = min(c[2] for c in runnable)
        return None, f"short key sequences (under {fewest}: text)"

    def _handed_back_call(self, reason, func, q, k, v, heads, mask, attn_precision,
                          skip_reshape, skip_output_reshape, kwargs):
        """The call given to the override installed before ours, else to ComfyUI's function,
        unchanged; the reason counted (and said once)."""
        self._hand_back(reason)
        options = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                       skip_output_reshape=skip_output_reshape, **kwargs)
        if self.inner is not None:
            return self.inner(func, q, k, v, heads, **options)
        return func(q, k, v, heads, **options)

    def _hand_back(self, reason: str) -> None:
        if reason not in self.handed_back:
            _LOG.info("Wan Enhanced Attention (%s): ComfyUI's attention takes the calls with %s",
                      self.mode, reason)
        self.handed_back[reason] += 1

    def __deepcopy__(self, memo):
        # ComfyUI deep-copies a patched model's options for every clone: the clones share one
        # override (and its counts), as they share the model
        return self


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on a CPU; not
    asked while torch.compile traces, where the compiled code's launch decides)."""
    return tensor.is_cuda and not torch.compiler.is_compiling() and \
        torch.cuda.is_current_stream_capturing()


def _heads_last(tensor: torch.Tensor, heads: int, skip_reshape: bool) -> torch.Tensor:
    """[B, L, heads * d] (or [B, heads, L, d]) as [B, L, heads, d]."""
    if skip_reshape:
        return tensor.transpose(1, 2)
    return tensor.view(tensor.shape[0], tensor.shape[1], heads, -1)
