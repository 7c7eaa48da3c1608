"""The DiT block's elementwise work between its matrix products: norms, modulation, rotary
embedding and the gated residual updates of the float32 residual stream.

Each function is stated once in PyTorch operations (the CPU path, the path torch.compile traces
and fuses itself, and the reference of the tests). On a CUDA device in eager mode, where PyTorch
would run each operation as its own pass over the rows (a layer norm, a multiply, an add, a cast:
five to eight kernels per step), the Triton kernels of glue_kernels.py do each step in one pass,
with float32 arithmetic and one rounding at the end.

Modulation tables are [B, G, D] with G groups of L / G consecutive tokens (see dit.py).

Three steps run as operators of their own inside compiled graphs too, where they beat what the
compiler makes of the statements: the q/k norm with its rotation (rms_norm_heads), the FFN's
first product with its GELU in the product's epilogue (linear_gelu), and a norm read only by fp8
matmuls, which hands them their input codes with the residual update before it in the same pass
(norm_codes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu_support import KERNEL_OPTIONS, kernel_operator, triton_kernels_usable
from ..quant.fp8_rows import row_parts
from ..quant.rowwise import FP8, RowCodes, quantize_rows
from .rope import RotaryTable


def _use_kernels(x: torch.Tensor) -> bool:
    return triton_kernels_usable(x) and not torch.compiler.is_compiling()


def _kernels():
    from . import glue_kernels
    return glue_kernels


def launch_shape(width: int) -> tuple[int, int]:
    """Lanes (the width's next power of two) and warps of a one-row program of these kernels."""
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
    block, warps = launch_shape(d)
    rows_per_group = length
    if shift is not None:
        shift, scale = _modulation_tables(shift, scale)
        rows_per_group = length // shift.shape[1]
    table = x if shift is None else shift
    _kernels().layer_norm_modulate_kernel[(b * length,)](
        x, table, x if scale is None else scale, x if weight is None else weight,
        x if bias is None else bias, out, length, d, x.stride(0), x.stride(1), rows_per_group,
        table.stride(0), table.stride(1), eps, MODULATE=shift is not None,
        AFFINE=weight is not None, BLOCK_D=block, num_warps=warps, **KERNEL_OPTIONS)
    return out


# -- a norm read only by fp8 matmuls, handed to them as their input codes ------------------------

def takes_row_codes(layers, x: torch.Tensor) -> bool:
    """Whether `layers` (one or more) all take norm_codes' codes of the float32 stream x
    (quant/linear.py Fp8Linear, where its fp8 matmul runs). A loop, not a generator, which
    torch.compile (2.11) would break its graph at."""
    if not layers or x.dtype != torch.float32 or x.stride(-1) != 1:
        return False
    for layer in layers:
        if not (getattr(layer, "takes_row_codes", False) and layer.runs_fp8_matmul(x.device)):
            return False
    return True


def norm_codes(x: torch.Tensor, eps: float, dtype: torch.dtype, *,
               shift: torch.Tensor | None = None, scale: torch.Tensor | None = None,
               norm: torch.nn.LayerNorm | None = None,
               pending: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> RowCodes:
    """norm_modulate(x, shift, scale) (or norm_affine(x, norm)) as the fp8 input codes of the
    layers that read it (rowwise.RowCodes; callers check takes_row_codes), in one pass over x,
    also inside compiled graphs, where the activation is never stored (faster than the
    compiler's fused steps: bench/results/2026-11-26-h100-norm-codes-parts/). `pending` (y, gate): x += y * gate first
    (add_gated_), in place, in the same pass. The codes are norm_codes_statement's but for about
    one in 10^5, one fp8 step off (float32 rounding within the norm)."""
    if not triton_kernels_usable(x):
        return norm_codes_statement(x, eps, dtype, shift=shift, scale=scale, norm=norm,
                                    pending=pending)
    weight = bias = None
    if norm is not None:
        weight, bias = norm.weight.float(), norm.bias.float()
    else:
        shift, scale = _modulation_tables(shift, scale)
    rounding = ROUNDINGS[dtype]
    if pending is None:
        codes, scales = NORM_CODES(x, shift, scale, weight, bias, eps, rounding)
    else:
        y, gate = pending
        if gate is not None:
            gate = gate.float()
            gate = gate if gate.stride(-1) == 1 else gate.contiguous()
        codes, scales = ADD_NORM_CODES(x, y, gate, shift, scale, weight, bias, eps, rounding)
    return RowCodes(codes, scales, x.shape, dtype)


def norm_codes_statement(x: torch.Tensor, eps: float, dtype: torch.dtype, *,
                         shift: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                         norm: torch.nn.LayerNorm | None = None,
                         pending: tuple[torch.Tensor, torch.Tensor | None] | None = None
                         ) -> RowCodes:
    """What norm_codes computes, step by step: add_gated_, norm_modulate or norm_affine,
    quantize_rows (the path where the kernel cannot run, and its reference)."""
    if pending is not None:
        add_gated_(x, *pending)
    h = (norm_affine(x, norm, eps, dtype) if norm is not None
         else norm_modulate(x, shift, scale, eps, dtype))
    codes, scales = quantize_rows(h.reshape(-1, h.shape[-1]), FP8)
    return RowCodes(codes, scales, x.shape, dtype)


# what norm_codes rounds the norm to before quantizing it (glue_kernels.ROUND_*)
ROUNDINGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# Warps per row of norm_codes_kernel: with the row in parts (3072 = 2048 + 1024), 4 was the
# fastest or within 3% of it at 1536, 3072 and 5120, with and without an update (H100:
# bench/results/2026-11-26-h100-norm-codes-parts/)
CODES_WARPS = 4


def launch_norm_codes(x: torch.Tensor, y: torch.Tensor | None, gate: torch.Tensor | None,
                      shift: torch.Tensor | None, scale: torch.Tensor | None,
                      weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                      rounding: int, warps: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_codes_kernel over x [B, L, D] (unit channel stride): codes [B*L, D], scales
    [B*L, 1]; with y [B, L, D], x += y * gate (gate [B, G, D] or None) first, in place. Tensors
    the kernel does not use are passed as x, a placeholder pointer."""
    b, length, d = x.shape
    codes = torch.empty(b * length, d, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(b * length, 1, dtype=torch.float32, device=x.device)
    if y is not None:
        y = y.reshape(b * length, d)
        if not y.is_contiguous():
            y = y.contiguous()
    table = x if shift is None else shift
    gates = x if gate is None else gate
    parts = row_parts(d)
    _kernels().norm_codes_kernel[(b * length,)](
        x, x if y is None else y, gates, table, x if scale is None else scale,
        x if weight is None else weight, x if bias is None else bias, codes, scales, length, d,
        x.stride(0), x.stride(1), length if gate is None else length // gate.shape[1],
        gates.stride(0), gates.stride(1),
        length if shift is None else length // shift.shape[1], table.stride(0),
        table.stride(1), eps, UPDATE=y is not None, GATED=gate is not None,
        MODULATE=shift is not None, AFFINE=weight is not None, ROUNDING=rounding,
        PART0=parts[0], PART1=parts[1], PART2=parts[2], PART3=parts[3],
        num_warps=warps or CODES_WARPS, **KERNEL_OPTIONS)
    return codes, scales


def _norm_codes(x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None,
                weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                rounding: int) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_norm_codes(x, None, None, shift, scale, weight, bias, eps, rounding)


def _add_norm_codes(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None,
                    shift: torch.Tensor | None, scale: torch.Tensor | None,
                    weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    rounding: int) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_norm_codes(x, y, gate, shift, scale, weight, bias, eps, rounding)


def _codes_shape(x, *args):
    rows = x.shape[0] * x.shape[1]
    return (x.new_empty(rows, x.shape[2], dtype=torch.float8_e4m3fn),
            x.new_empty(rows, 1, dtype=torch.float32))


# registered at import: never inside a compiled region
NORM_CODES = kernel_operator("wan_enhanced_glue::norm_codes", _norm_codes, _codes_shape)
ADD_NORM_CODES = kernel_operator("wan_enhanced_glue::add_norm_codes", _add_norm_codes,
                                 _codes_shape, mutates=("x",))


def _modulation_tables(shift: torch.Tensor, scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """shift and scale [B, G, D] in float32 as the norm kernels index them: both with one
    stride, channels one apart."""
    shift, scale = shift.float(), scale.float()
    if shift.stride() != scale.stride() or shift.stride(-1) != 1:
        shift, scale = shift.contiguous(), scale.contiguous()
    return shift, scale


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
    block, warps = launch_shape(d)
    table = gate.float() if gate is not None else x
    rows_per_group = length // gate.shape[1] if gate is not None else length
    _kernels().add_gated_kernel[(b * length,)](
        x, y, table, length, d, x.stride(0), x.stride(1), rows_per_group, table.stride(0),
        table.stride(1), GATED=gate is not None, BLOCK_D=block, num_warps=warps,
        **KERNEL_OPTIONS)
    return x


def head_parts(heads: int, head_dim: int) -> tuple[int, int, int] | None:
    """The launch of glue_kernels.rms_norm_rope_heads for rows of `heads` heads of `head_dim`
    channels: its two parts of power-of-two head counts (24 = 16 + 8, 40 = 32 + 8, 12 = 8 + 4;
    the second at least 1, masked past the row) and its warps (4: 2, 8 and 16 were no faster at
    Wan's widths on the H100); None where head_dim is not a power of two (the PyTorch statement
    runs). rms_norm_heads and the fp8 attention's normed_query_codes launch it alike, so that
    their sums run in the same order."""
    if heads < 1 or head_dim < 2 or head_dim & (head_dim - 1):
        return None
    first = 1 << (heads.bit_length() - 1)
    second = triton_next_power_of_2(heads - first) if heads > first else 1
    return first, second, 4


def rms_norm_heads(t: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                   rope: RotaryTable | None = None, start: int = 0) -> torch.Tensor:
    """RMS norm of t [B, L, W] over its whole width (all heads), times the gain, as
    [B, L, heads, W / heads]; with `rope`, each head's channel pairs rotated for tokens
    start.. of the grid. The PyTorch statement rounds to t's dtype after the norm and after the
    rotation; the kernel rounds once.

    With `rope` on a GPU the kernel also runs inside compiled graphs, as an operator of its own:
    torch.compile fused the norms and rotations of q and k into one kernel but wrote one of the
    two in float32 and rounded it in a second pass (H100, 5B 720p: 0.53 ms a block, where one
    pass over each reads and writes 0.34 GB)."""
    b, length, width = t.shape
    kernel = (head_parts(heads, width // heads) is not None and width % heads == 0
              and (rope is None or 2 * rope.cos.shape[-1] == width // heads))
    if kernel and ((rope is not None and triton_kernels_usable(t)) or _use_kernels(t)):
        cos, sin = (None, None) if rope is None else (rope.cos, rope.sin)
        out = RMS_NORM_ROPE(t.contiguous(), weight.float(), cos, sin, start, eps, heads)
        return out.view(b, length, heads, -1)
    normed = (F.rms_norm(t.float(), (width,), eps=eps) * weight.float()).to(t.dtype)
    normed = normed.view(b, length, heads, -1)
    return normed if rope is None else rope.rotate(normed, start)


def _rms_norm_rope(t: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None,
                   sin: torch.Tensor | None, start: int, eps: float, heads: int) -> torch.Tensor:
    """The kernel over contiguous t [B, L, W] of `heads` heads: rotated by the tables cos/sin
    [tokens, 1, head_dim / 2] from token `start` on, or not rotated (cos None)."""
    b, length, width = t.shape
    out = torch.empty_like(t)
    first, second, warps = head_parts(heads, width // heads)
    rotate = cos is not None
    _kernels().rms_norm_rope_kernel[(b * length,)](
        t, weight, cos if rotate else t, sin if rotate else t, out, width, eps, length, start,
        ROTATE=rotate, HEADS0=first, HEADS1=second, D=width // heads, num_warps=warps,
        **KERNEL_OPTIONS)
    return out


def _rms_norm_rope_shape(t, weight, cos, sin, start, eps, heads):
    return torch.empty_like(t)


# registered at import: never inside a compiled region
RMS_NORM_ROPE = kernel_operator("wan_enhanced_glue::rms_norm_rope", _rms_norm_rope,
                                _rms_norm_rope_shape)


# -- the FFN's first layer and its GELU in one matrix product -----------------------------------

def gelu_product_weights(layer: torch.nn.Module, act: torch.nn.Module,
                         h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (weight, bias) with which linear_gelu stands for act(layer(h)), or None: the tanh
    GELU (the one cuBLASLt's epilogue computes) after a layer with a bias in h's 16-bit dtype on
    an NVIDIA GPU, where the layer is a plain linear one or one that forms a summed weight for
    this call (a LoRA'd linear layer: its `merged_weights(h)`). Quantized layers have their own
    forward and keep it, and so does a weight of a tensor subclass (torchao's quantized weights:
    the epilogue product takes plain tensors only)."""
    if not (isinstance(act, torch.nn.GELU) and act.approximate == "tanh" and h.is_cuda
            and torch.version.hip is None and h.dtype in (torch.bfloat16, torch.float16)):
        return None
    if type(layer) is torch.nn.Linear:
        weights = layer.weight, layer.bias
    else:
        merged = getattr(layer, "merged_weights", None)
        weights = None if merged is None else merged(h)
        if weights is None:
            return None
    weight, bias = weights
    if bias is None or weight.dtype != h.dtype or bias.dtype != h.dtype:
        return None
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (weight, bias)):
        return None
    return weight, bias


def linear_gelu(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(h W^T + b) as one cuBLASLt product whose epilogue adds the bias and applies the
    GELU in float32 before the one rounding (torch._addmm_activation): no pass of its own over the
    hidden activation (H100, 5B 720p: 27280 x 14336, 0.56 ms a block). Also inside compiled
    graphs, as an operator of its own (torch.compile would split it into the product and a
    GELU kernel again). Callers take weight and bias from gelu_product_weights."""
    return LINEAR_GELU(h, weight, bias)


def _linear_gelu_launch(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    rows = h.reshape(-1, h.shape[-1])
    out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return out.view(*h.shape[:-1], weight.shape[0])


def _linear_gelu_shape(h, weight, bias):
    return h.new_empty(*h.shape[:-1], weight.shape[0])


LINEAR_GELU = kernel_operator("wan_enhanced_glue::linear_gelu", _linear_gelu_launch,
                              _linear_gelu_shape)

