"""FP8 attention: a flash-attention kernel whose two matrix products run on 8-bit tensor cores
(Ada and Hopper GPUs, compute capability 8.9+): Q K^T in int8, P V in fp8. Two kernels compute
the same output bit for bit: the portable Triton one (fp8_attention_kernels.py) and, on Hopper,
a warp-specialized one in Triton's Gluon dialect (fp8_attention_hopper.py), which is faster.

Numerics (what is rounded, and how finely it is scaled):
- Q: int8 with one scale per token and head (its largest magnitude maps onto 127).
- K: minus its mean over all tokens (per head and channel; it shifts every score of a query by
  the same amount, which the softmax cancels), then int8 with one scale per 128 tokens and head.
  The mean removes the shared offset that dominates Wan's keys, so the blocks' scales fit what
  varies between tokens. int8 keeps 2-3 more bits than fp8 e4m3 on the large components that
  decide a score: with fp8 Q and K the output moved 2-10x further from exact attention.
- Q K^T is accumulated exactly in int32; the online softmax runs in float32 (exp2, the softmax
  scale and log2(e) folded into the query scales).
- P (probabilities in 0..1) times 448 in fp8, V in fp8 with one scale per channel and head; each
  128-key product is summed in float32.
`reference_fp8_attention` computes the same quantities with PyTorch operations (any device): the
tests hold the kernel to it, and it to exact attention.

`fp8_attention(q, k, v)` takes and returns [B, L, heads, head_dim] like every backend; for short
key sequences (cross-attention to 512 text rows), where fp8 gains nothing, it uses SDPA.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ..gpu_support import (KERNEL_OPTIONS, TRITON, fp8_unavailable, import_gluon_kernel,
                           kernel_operator, spill_problem, warn_once)
from .glue import head_parts, rms_norm_heads
from .sdpa import sdpa

FP8_MAX = 448.0
K_BLOCK = 128
P_SCALE = 448.0
LOG2E = 1.4426950408889634
# Key sequences shorter than this go to SDPA (text cross-attention has 512 rows).
MIN_KEYS = 1024
HEAD_DIMS = (64, 128)


def fp8_attention_unavailable(device: torch.device, head_dim: int | None = None) -> str | None:
    """Why the fp8 kernel cannot run here, or None when it can."""
    hardware = fp8_unavailable(device, "it")
    if hardware is not None:
        return hardware
    if not TRITON:
        return "it needs Triton, which is not installed"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"it supports head_dim {HEAD_DIMS}; this model has {head_dim}"
    return None


def padded_length(length: int) -> int:
    return -(-length // K_BLOCK) * K_BLOCK


# -- the PyTorch statement of the numerics -------------------------------------------------------

INT8_MAX = 127.0


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest float8_e4m3fn value, returned as float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def _to_int8(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero to an integer in -127..127, as float32 (the kernel's rule)."""
    return (x.abs() + 0.5).floor().copysign(x).clamp(-INT8_MAX, INT8_MAX)


def quantized_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Dequantized float32 Q, K, V ([B, H, L, D]) and the fp8-rounding of P, as the kernel
    sees them (Q without the softmax scale)."""
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    q_scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-30) / INT8_MAX
    q_deq = _to_int8(q / q_scale) * q_scale
    k = k - k.mean(dim=2, keepdim=True)
    length = k.shape[2]
    blocks = F.pad(k, (0, 0, 0, padded_length(length) - length)).unflatten(2, (-1, K_BLOCK))
    k_scale = blocks.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30) / INT8_MAX
    k_deq = (_to_int8(blocks / k_scale) * k_scale).flatten(2, 3)[:, :, :length]
    v_scale = v.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / FP8_MAX
    v_deq = _to_fp8(v / v_scale) * v_scale
    return q_deq, k_deq, v_deq


def reference_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            query_chunk: int = 4096, pv_fp8: bool = True) -> torch.Tensor:
    """What the kernel computes, with PyTorch operations in float32, queries a chunk at a time.
    One softmax over all keys: the kernel's online softmax scales P by a running maximum, so
    its fp8 P rounds at other points (a difference of the size of P's rounding; with
    pv_fp8=False, P and V in bf16, the two agree to bf16 rounding)."""
    q_deq, k_deq, v_deq = quantized_operands(q, k, v)
    if not pv_fp8:
        v_deq = v.transpose(1, 2).float()
    out = torch.empty_like(q_deq)
    for start in range(0, q_deq.shape[2], query_chunk):
        rows = slice(start, start + query_chunk)
        scores = (q_deq[:, :, rows] @ k_deq.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        total = weights.sum(-1, keepdim=True)
        p = (_to_fp8(weights * P_SCALE) / P_SCALE if pv_fp8
             else weights.to(torch.bfloat16).float())
        out[:, :, rows] = (p @ v_deq) / total
    return out.transpose(1, 2).to(q.dtype)


# -- the kernel ----------------------------------------------------------------------------------

@dataclass
class Fp8Keys:
    """K (int8) and V (fp8) in the kernel's layouts (fp8_attention_kernels.py) and their scales:
    what every chunk of query rows attending to the same keys takes (fp8_keys)."""
    k8: torch.Tensor
    vt: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    length: int
    pv_fp8: bool


@dataclass
class Fp8Operands(Fp8Keys):
    """The keys' operands (Fp8Keys) with Q's: q8 (int8) and q_scale in the kernel's layouts."""
    q8: torch.Tensor
    q_scale: torch.Tensor


def quantize_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  pv_fp8: bool = True) -> Fp8Operands:
    """The kernel's operands of q [B, Lq, heads, head_dim] and k, v [B, L, heads, head_dim]
    (the first of its two steps). pv_fp8=False keeps V in bf16 for a bf16 P V product (more
    exact, slower)."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"fp8 attention takes q [B, Lq, H, D] and k, v [B, L, H, D]; got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    return with_queries(quantize_keys(k, v, pv_fp8), query_codes(q))


def query_codes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Lq, heads, head_dim] as the kernel's query operand: int8 codes [B * heads, Lq
    padded, D] and scales [B * heads, Lq padded] (quantize_q_kernel)."""
    from . import fp8_attention_kernels as kernels

    q = q if q.stride(-1) == 1 else q.contiguous()
    b, lq, heads, dim = q.shape
    lqp, bh = padded_length(lq), b * heads
    codes = q.new_empty(bh, lqp, dim, dtype=torch.int8)
    scales = q.new_empty(bh, lqp, dtype=torch.float32)
    kernels.quantize_q_kernel[(lqp // K_BLOCK, bh)](
        q, codes, scales, lq, lqp, heads, *q.stride()[:3], LOG2E / math.sqrt(dim),
        BLOCK=K_BLOCK, D=dim, **KERNEL_OPTIONS)
    return codes, scales


def with_queries(keys: Fp8Keys, queries: tuple[torch.Tensor, torch.Tensor]) -> Fp8Operands:
    """The kernel's operands of quantized keys (quantize_keys) and the queries' codes and
    scales (query_codes or normed_query_codes)."""
    return Fp8Operands(**{field.name: getattr(keys, field.name) for field in fields(Fp8Keys)},
                       q8=queries[0], q_scale=queries[1])


def quantize_keys(k: torch.Tensor, v: torch.Tensor, pv_fp8: bool = True) -> Fp8Keys:
    """k and v [B, L, heads, head_dim] as the kernel takes them (quantize_k_kernel,
    quantize_vt_kernel)."""
    from . import fp8_attention_kernels as kernels

    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    b, length, heads, dim = k.shape
    lp, bh = padded_length(length), b * heads
    fp8 = torch.float8_e4m3fn
    keys = Fp8Keys(
        k8=k.new_empty(bh, lp, dim, dtype=torch.int8),
        vt=k.new_empty(bh, dim, lp, dtype=fp8 if pv_fp8 else torch.bfloat16),
        k_scale=k.new_empty(bh, lp // K_BLOCK, dtype=torch.float32),
        v_scale=(torch.linalg.vector_norm(v, ord=math.inf, dim=1, dtype=torch.float32)
                 .clamp_min(1e-30).div_(FP8_MAX).reshape(bh, dim).contiguous()
                 if pv_fp8 else k.new_ones(bh, dim, dtype=torch.float32)),
        length=length, pv_fp8=pv_fp8)
    k_mean = k.mean(dim=1, dtype=torch.float32).reshape(bh, dim).contiguous()
    grid = (lp // K_BLOCK, bh)
    kernels.quantize_k_kernel[grid](k, k_mean, keys.k8, keys.k_scale, length, lp, heads,
                                    *k.stride()[:3], BLOCK=K_BLOCK, D=dim, **KERNEL_OPTIONS)
    kernels.quantize_vt_kernel[grid](v, keys.v_scale, keys.vt, length, lp, heads, *v.stride()[:3],
                                     BLOCK=K_BLOCK, D=dim, **KERNEL_OPTIONS)
    return keys


KERNELS = ("auto", "portable", "hopper")


@functools.cache
def _hopper_module():
    """fp8_attention_hopper, or the reason it cannot be imported (a str)."""
    return import_gluon_kernel(".fp8_attention_hopper", __package__)


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _hopper_device(device: torch.device) -> bool:
    return device.type == "cuda" and _is_hopper(device.index or 0)


def _on_hopper(t: torch.Tensor) -> bool:
    return _hopper_device(t.device)


_HOPPER_FAILED: list[str] = []  # the first launch's error, if it had one
# why auto leaves the Hopper kernel although it builds (this Triton spills its registers), once
# a build's first launch has said so; that launch's output stands (it is correct, only slow)
_HOPPER_SLOW: list[str] = []
# the builds checked so far, by id (kept, so that no other object takes an id): Triton builds the
# kernel once per specialization (lengths multiples of 16 or not, ...), each with registers of
# its own (on Triton 3.6 the 5B shape's build keeps 16 words in local memory, another 18)
_HOPPER_CHECKED: dict[int, object] = {}


def _hopper_build_problem() -> str | None:
    """Why the Hopper kernel's module cannot serve (this Triton does not import or build it), or
    None."""
    module = _hopper_module()
    if isinstance(module, str):
        return module
    return _HOPPER_FAILED[0] if _HOPPER_FAILED else None


def _hopper_auto_problem() -> str | None:
    """Why `auto` does not run the Hopper kernel: it cannot (_hopper_build_problem) or this
    Triton built it with its registers spilled (_check_hopper_build); or None."""
    return _hopper_build_problem() or (_HOPPER_SLOW[0] if _HOPPER_SLOW else None)


def _check_hopper_build(compiled) -> None:
    """After a launch of the Hopper kernel, the first time its build (`compiled`) runs: where
    this Triton built it with its registers spilled (gpu_support.spill_problem), auto runs the
    portable kernel from then on, and says so once."""
    if id(compiled) in _HOPPER_CHECKED:
        return
    _HOPPER_CHECKED[id(compiled)] = compiled
    problem = spill_problem(compiled, _hopper_module().SPILL_LIMIT_WORDS)
    if problem is not None and not _HOPPER_SLOW:
        _HOPPER_SLOW.append(problem)
        warn_once(f"fp8 attention: the Hopper kernel is slow here ({problem}); the portable "
                  "Triton kernel runs instead")


def hopper_rows_per_program(device: torch.device, head_dim: int) -> int | None:
    """The query rows a program of the Hopper kernel takes, where that kernel runs this
    backend's self-attention on `device` (a program fills a multiprocessor's registers: one at a
    time on each); None where it does not."""
    if not _hopper_device(device) or head_dim != 128 or _hopper_auto_problem() is not None:
        return None
    return _hopper_module().ROWS_PER_PROGRAM


def hopper_kernel_unavailable(ops: Fp8Operands, out: torch.Tensor) -> str | None:
    """Why the Hopper kernel (fp8_attention_hopper) cannot take these operands, or None."""
    if not _on_hopper(out):
        return "it needs a Hopper GPU (compute capability 9.0)"
    if not ops.pv_fp8:
        return "it computes P V in fp8 only"
    if out.shape[-1] != 128:
        return f"it takes head_dim 128; these operands have {out.shape[-1]}"
    if ops.length <= K_BLOCK:
        return f"it needs more than {K_BLOCK} keys; these are {ops.length}"
    return _hopper_build_problem()


def attend_quantized(ops: Fp8Operands, out: torch.Tensor, config: dict | None = None,
                     kernel: str = "auto") -> None:
    """The attention kernel over quantized operands, written into out [B, Lq, heads, head_dim].
    kernel: "hopper" (fp8_attention_hopper: warp-specialized, Hopper only, the same output),
    "portable" (any GPU of compute capability 8.9+), or "auto": the Hopper kernel where it can
    run, else the portable one. config: the portable kernel's BLOCK_M, BLOCK_N, num_warps,
    num_stages instead of the autotuned choice."""
    if kernel not in KERNELS:
        raise ValueError(f"fp8 attention: kernel must be one of {KERNELS}; got {kernel!r}")
    if kernel != "portable" and config is None:
        reason = hopper_kernel_unavailable(ops, out)
        if reason is None and kernel == "auto":
            reason = _hopper_auto_problem()  # a spilled build: said when it was found
        if reason is None:
            try:
                compiled = _hopper_module().attend(ops, out)
            except Exception as exc:  # the kernel did not build with this Triton
                if kernel == "hopper":
                    raise
                _HOPPER_FAILED.append(f"it failed to build here ({type(exc).__name__}: {exc})")
                reason = _HOPPER_FAILED[0]
            else:
                _check_hopper_build(compiled)
                return
        if kernel == "hopper":
            raise ValueError(f"fp8 attention: the Hopper kernel cannot run: {reason}")
        if _on_hopper(out) and _hopper_build_problem() is not None:
            warn_once(f"fp8 attention: the Hopper kernel cannot run ({reason}); the slower "
                      "portable Triton kernel runs instead")
    elif kernel == "hopper":
        raise ValueError("fp8 attention: a config is for the portable kernel, not the Hopper one")
    _attend_portable(ops, out, config)


def _attend_portable(ops: Fp8Operands, out: torch.Tensor, config: dict | None) -> None:
    from . import fp8_attention_kernels as kernels

    b, lq, heads, dim = out.shape
    bh, lqp, lp = b * heads, ops.q8.shape[1], ops.k8.shape[1]

    def grid(meta):
        return (triton_cdiv(lq, meta["BLOCK_M"]), bh)

    kernel = kernels.attention_kernel if config is None else kernels.attention_kernel.fn
    kernel[grid](ops.q8, ops.k8, ops.vt, ops.q_scale, ops.k_scale, ops.v_scale, out, ops.length,
                 lp, lq, lqp, heads, *out.stride()[:3], D=dim, KB=K_BLOCK, PV_FP8=ops.pv_fp8,
                 **(config or {}), **KERNEL_OPTIONS)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            config: dict | None = None, pv_fp8: bool = True) -> torch.Tensor:
    ops = quantize_only(q, k, v, pv_fp8)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    attend_quantized(ops, out, config)
    return out


def normed_query_codes(q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, start: int, eps: float, heads: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's query operand (q8 int8 [B * heads, Lq padded, D], scales [B * heads, Lq
    padded]) of the projected queries q [B, Lq, W] before their norm: RMS norm over W times
    `weight`, rotated by the tables cos/sin [tokens, 1, D / 2] from token `start` on, in one pass
    (fp8_attention_kernels.normed_query_kernel): the codes of glue.rms_norm_heads' output, to
    the bit, which is never stored. Rows past Lq as quantize_q_kernel leaves them (zeros)."""
    from . import fp8_attention_kernels as kernels

    b, lq, width = q.shape
    dim = width // heads
    lqp, bh = padded_length(lq), b * heads
    score_scale = LOG2E / math.sqrt(dim)
    q8 = q.new_empty(bh, lqp, dim, dtype=torch.int8)
    scales = q.new_empty(bh, lqp, dtype=torch.float32)
    if lqp > lq:  # what quantize_q_kernel writes for a row of zeros
        q8[:, lq:] = 0
        scales[:, lq:] = _padding_scale(score_scale)
    first, second, warps = head_parts(heads, dim)  # rms_norm_heads' launch: its sums in its order
    kernels.normed_query_kernel[(b * lq,)](
        q.contiguous(), weight, cos, sin, q8, scales, width, eps, lq, start, heads, lqp,
        score_scale, HEADS0=first, HEADS1=second, D=dim, num_warps=warps, **KERNEL_OPTIONS)
    return q8, scales


@functools.cache
def _padding_scale(score_scale: float) -> float:
    """quantize_q_kernel's scale of a row of zeros, (1e-30 / 127) * score_scale in float32
    steps, as a float (exactly that float32 value), worked out once and not per call."""
    return float(torch.tensor(1e-30, dtype=torch.float32) / INT8_MAX
                 * torch.tensor(score_scale, dtype=torch.float32))


def _normed_query_attention(q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, start: int, eps: float, k: torch.Tensor,
                            v: torch.Tensor) -> torch.Tensor:
    return _attend_normed_queries(q, weight, cos, sin, start, eps, quantize_keys(k, v),
                                  k.shape[2])


def _attend_normed_queries(q: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, start: int, eps: float, keys: Fp8Keys,
                           heads: int) -> torch.Tensor:
    """The kernel's output [B, Lq, heads, head_dim] for the projected queries q [B, Lq, W]
    before their norm (normed_query_codes) over quantized keys."""
    out = q.new_empty(q.shape[0], q.shape[1], heads, q.shape[2] // heads)
    attend_quantized(with_queries(keys, normed_query_codes(q, weight, cos, sin, start, eps,
                                                           heads)), out)
    return out


def _normed_query_attention_shape(q, weight, cos, sin, start, eps, k, v):
    return q.new_empty(q.shape[0], q.shape[1], k.shape[2], k.shape[3])


# registered at import: never inside a compiled region
FP8_NORMED_QUERY_ATTENTION = kernel_operator(
    "wan_enhanced_attention::fp8_normed_query_attention", _normed_query_attention,
    _normed_query_attention_shape)


def fp8_attention_normed_query(q: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               heads: int, rope, start: int, k: torch.Tensor,
                               v: torch.Tensor, keys: Fp8Keys | None = None) -> torch.Tensor:
    """fp8_attention(rms_norm_heads(q, norm_weight, eps, heads, rope, start), k, v) for the
    projected queries q [B, Lq, W] before their norm: where the kernel takes these keys, the
    queries' norm, rotation and int8 codes are one pass (normed_query_codes) instead of two,
    with the same codes (H100: bench/results/2026-11-26-h100-normed-query/). `keys`: k and v
    already quantized (fp8_keys, once for every chunk of query rows), the same output."""
    if (k.shape[1] < MIN_KEYS or q.dtype != torch.bfloat16 or not q.is_cuda
            or q.shape[-1] != heads * k.shape[-1] or 2 * rope.cos.shape[-1] != k.shape[-1]):
        return fp8_attention(rms_norm_heads(q, norm_weight, eps, heads, rope, start), k, v)
    if keys is not None and not torch.compiler.is_compiling():
        return _attend_normed_queries(q, norm_weight.float(), rope.cos, rope.sin, start, eps,
                                      keys, heads)
    return FP8_NORMED_QUERY_ATTENTION(q, norm_weight.float(), rope.cos, rope.sin, start, eps,
                                      k, v)


def fp8_keys(k: torch.Tensor, v: torch.Tensor) -> Fp8Keys | None:
    """k and v [B, L, heads, head_dim] quantized once for several calls of
    fp8_attention_normed_query over chunks of query rows (eager blocks), where those calls take
    them: keys long enough for the kernel, bf16 on a GPU, outside compiled graphs; else None.
    Without them each chunk quantized all the keys again
    (bench/results/2026-11-26-h100-eager-keys-once/)."""
    if (k.shape[1] < MIN_KEYS or k.dtype != torch.bfloat16 or not k.is_cuda
            or torch.compiler.is_compiling()):
        return None
    return quantize_keys(k, v)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _launch(q, k, v)


def _fp8_self_attention_shape(q, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# registered at import: never inside a compiled region
FP8_SELF_ATTENTION = kernel_operator("wan_enhanced_attention::fp8_self_attention",
                                     _fp8_self_attention, _fp8_self_attention_shape)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The backend: attention of q [B, Lq, heads, head_dim] over k, v [B, L, ...] (bf16/fp16)
    with the fp8 kernel for long key sequences (self-attention, also for a chunk of query rows),
    SDPA for short ones (text cross-attention). Callers check fp8_attention_unavailable first."""
    if k.shape[1] < MIN_KEYS:
        return sdpa(q, k, v)
    return FP8_SELF_ATTENTION(q, k, v)
