"""The DiT block's elementwise work between its matrix products: norms, modulation, rotary
embedding and the gated residual updates of the float32 residual stream.

Each function is stated once in PyTorch operations (the CPU path, the path torch.compile traces
and fuses itself, and the reference of the tests). On a CUDA device in eager mode, where PyTorch
would run each operation as its own pass over the rows (a layer norm, a multiply, an add, a cast:
five to eight kernels per step), the Triton kernels of glue_kernels.py do each step in one pass,
with float32 arithmetic and one rounding at the end.

Modulation tables are [B, G, D] with G groups of L / G consecutive tokens (see dit.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu_support import triton_kernels_usable
from .rope import RotaryTable


def _use_kernels(x: torch.Tensor) -> bool:
    return triton_kernels_usable(x) and not torch.compiler.is_compiling()


def _kernels():
    from . import glue_kernels
    return glue_kernels


def _launch_shape(width: int) -> tuple[int, int]:
    block = triton_next_power_of_2(width)
    return block, 4 if block <= 2048 else 8 if block <= 4096 else 16


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# -- PyTorch statements --------------------------------------------------------------------------

def layer_norm(x: torch.Tensor, eps: float, norm: torch.nn.LayerNorm | None = None) -> torch.Tensor:
    """float32 LayerNorm; without `norm` it has no affine parameters."""
    if norm is None:
        return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return F.layer_norm(x.float(), (x.shape[-1],), norm.weight.float(), norm.bias.float(), eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift, with shift/scale [B, G, D] shared by groups of L/G tokens."""
    b, length, d = x.shape
    groups = shift.shape[1]
    grouped = x.view(b, groups, length // groups, d)
    return (grouped * (1 + scale[:, :, None]) + shift[:, :, None]).view(b, length, d)


def _add_gated_torch(x, y, gate):
    b, length, d = x.shape
    groups = gate.shape[1]
    x.view(b, groups, length // groups, d).addcmul_(y.view(b, groups, length // groups, d),
                                                   gate[:, :, None])
    return x


# -- the steps -----------------------------------------------------------------------------------

def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift in float32, rounded to `dtype`. x: [B, L, D]."""
    if not _use_kernels(x) or x.stride(-1) != 1:
        return modulate(layer_norm(x, eps), shift, scale).to(dtype)
    return _norm(x, eps, dtype, shift=shift, scale=scale)


def norm_affine(x: torch.Tensor, norm: torch.nn.LayerNorm, eps: float,
                dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x) with the norm's weight and bias in float32, rounded to `dtype`."""
    if not _use_kernels(x) or x.stride(-1) != 1:
        return layer_norm(x, eps, norm).to(dtype)
    return _norm(x, eps, dtype, weight=norm.weight.float(), bias=norm.bias.float())


def _norm(x, eps, dtype, shift=None, scale=None, weight=None, bias=None) -> torch.Tensor:
    """The layer-norm kernel, modulated by shift/scale tables or with an affine weight/bias
    (arguments the kernel does not use are passed as x, a placeholder pointer)."""
    b, length, d = x.shape
    out = torch.empty(b, length, d, dtype=dtype, device=x.device)
    block, warps = _launch_shape(d)
    rows_per_group = length
    if shift is not None:
        shift, scale = shift.float(), scale.float()
        if shift.stride() != scale.stride():  # the kernel indexes both with one stride
            shift, scale = shift.contiguous(), scale.contiguous()
        rows_per_group = length // shift.shape[1]
    table = x if shift is None else shift
    _kernels().layer_norm_modulate_kernel[(b * length,)](
        x, table, x if scale is None else scale, x if weight is None else weight,
        x if bias is None else bias, out, length, d, x.stride(0), x.stride(1), rows_per_group,
        table.stride(0), table.stride(1), eps, MODULATE=shift is not None,
        AFFINE=weight is not None, BLOCK_D=block, num_warps=warps)
    return out


def add_gated_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """x += y * gate (or x += y without a gate), in place, in float32 (y is upcast), with gate
    [B, G, D] shared by groups of tokens. In place: the float32 residual stream is the largest
    tensor of a step, and a new one per update would double it."""
    if not _use_kernels(x) or x.stride(-1) != 1 or x.dtype != torch.float32:
        if gate is None:
            return x.add_(y)
        return _add_gated_torch(x, y, gate)
    b, length, d = x.shape
    y = y.reshape(b * length, d)
    if not y.is_contiguous():
        y = y.contiguous()
    block, warps = _launch_shape(d)
    table = gate.float() if gate is not None else x
    rows_per_group = length // gate.shape[1] if gate is not None else length
    _kernels().add_gated_kernel[(b * length,)](
        x, y, table, length, d, x.stride(0), x.stride(1), rows_per_group, table.stride(0),
        table.stride(1), GATED=gate is not None, BLOCK_D=block, num_warps=warps)
    return x


def rms_norm_heads(t: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                   rope: RotaryTable | None = None, start: int = 0) -> torch.Tensor:
    """RMS norm of t [B, L, W] over its whole width (all heads), times the gain, as
    [B, L, heads, W / heads]; with `rope`, each head's channel pairs rotated for tokens
    start.. of the grid. The PyTorch statement rounds to t's dtype after the norm and after the
    rotation; the kernel rounds once."""
    b, length, width = t.shape
    if not _use_kernels(t):
        normed = (F.rms_norm(t.float(), (width,), eps=eps) * weight.float()).to(t.dtype)
        normed = normed.view(b, length, heads, -1)
        return normed if rope is None else rope.rotate(normed, start)
    t = t.contiguous()
    out = torch.empty_like(t)
    block, warps = _launch_shape(width // 2)
    half_head = width // heads // 2
    _kernels().rms_norm_rope_kernel[(b * length,)](
        t, weight.float(), rope.cos if rope is not None else t,
        rope.sin if rope is not None else t, out, width, half_head, eps, length, start,
        ROTATE=rope is not None, BLOCK_P=block, num_warps=warps)
    return out.view(b, length, heads, -1)
