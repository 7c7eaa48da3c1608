"""Unmerged LoRA: a block matrix wrapped so that its LoRAs are added at run time,

    y = base(x) + sum_i s_i * (x @ down_i^T) @ up_i^T   (+ s_j * x @ diff_j^T, + s_k * bias_k)

with base an nn.Linear or a quantized layer (quant/linear.py), used as it is: an fp8 file's
weights are never dequantized for it. The factors are buffers of the wrapper, plain tensors in
the model's compute dtype, so the device placement and block swap (offload/) move them with
their block like any other tensor; the scales are plain numbers, so changing a strength changes
no tensor.

How the terms are computed is chosen per call, by cost:
- a layer whose forward multiplies a dense weight (bf16/fp32 weights, or quantized weights it
  dequantizes) and an input of many rows: the weight with the terms added,
  W + sum s_i up_i @ down_i, is formed for this call only (a temporary of one matrix, freed
  after) and the input multiplied once. For a video's thousands of tokens that is a pass over
  one matrix instead of two more passes over the activations per term;
- otherwise (few rows, or the fp8 and int8 kernels, whose codes must stay as stored): the terms
  are added to the base's output in place, the up-projection and the addition in one matrix
  product (addmm_).
For fp8 matmuls the wrapper keeps the layer's fast feed-forward path (wan/dit_ffn.py feed_forward):
the base still takes the GELU and the first layer's bias into its fp8 input step. Then
- for an input of many rows, the layer's codes with the low-rank terms added are requantized
  for the call (lora/fp8_sum.py: one pass over the codes, the numbers a merge gives) and the
  input's codes multiplied once;
- otherwise the terms' down-projections read the same fp8 codes of the input (the factors
  quantized per row on the fly, padded to the kernel's multiple of 16) and the up-projections
  are added to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant.kernels import fp8_codes_matmul
from ..quant.linear import layer_output_bytes
from ..quant.rowwise import FP8, RowCodes, quantize_rows
from .fp8_sum import fp8_sum

_FP8_MULTIPLE = 16  # torch._scaled_mm's widths


@dataclass
class Adapter:
    """One LoRA's term in a wrapped layer: which buffers and its scale."""
    kind: str  # "low_rank" | "weight_diff" | "bias_diff"
    names: tuple[str, ...]  # buffer names on the wrapper
    scale: float


def merges_per_call(rows: int, in_features: int, out_features: int) -> bool:
    """Whether forming the summed weight for a call costs less memory traffic than adding the
    terms to the output: one matrix read, written and read again (3 in*out) against the input
    read once more and the output read and written (rows * (in + 2 out)) per term."""
    return rows * (in_features + 2 * out_features) > 3 * in_features * out_features


class LoraLinear(nn.Module):
    """A block matrix plus LoRA terms kept apart from its weights."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.adapters: list[Adapter] = []

    def add(self, kind: str, tensors: tuple[torch.Tensor, ...], scale: float) -> None:
        """A term: low_rank (down [r, in], up [out, r]), weight_diff ([out, in]) or bias_diff
        ([out]). The tensors become buffers as they are (the same tensor objects)."""
        index = len(self.adapters)
        names = tuple(f"lora{index}_{part}" for part in _PARTS[kind])
        for name, tensor in zip(names, tensors):
            self.register_buffer(name, tensor, persistent=False)
        self.adapters.append(Adapter(kind, names, scale))

    def terms(self) -> list[tuple[Adapter, tuple[torch.Tensor, ...]]]:
        return [(a, tuple(getattr(self, n) for n in a.names)) for a in self.adapters]

    def active_terms(self, kinds=("low_rank", "weight_diff", "bias_diff")):
        return [(a, t) for a, t in self.terms() if a.scale != 0 and a.kind in kinds]

    @property
    def bias(self) -> torch.Tensor | None:
        """The effective bias: the base's plus the bias differences."""
        bias = self.base.bias
        for adapter, tensors in self.active_terms(("bias_diff",)):
            term = tensors[0] * adapter.scale
            bias = term if bias is None else bias + term.to(bias.dtype)
        return bias

    def output_bytes(self, dtype: torch.dtype) -> int:
        """What the base layer's forward holds per output element (chunks.hidden_bytes sizes the
        FFN's chunks by it): the terms come on top of the base's output."""
        return layer_output_bytes(self.base, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active_terms():
            return self.base(x)
        merged = self.merged_weights(x)
        if merged is not None:
            return F.linear(x, *merged)
        return self.lora_delta(x, self.base(x))

    def merged_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(the summed weight, the effective bias) in x's dtype where this call would form the
        summed weight (forward's first way), else None: for a caller that multiplies them
        itself (the FFN's product with its GELU in the epilogue, wan/glue.py)."""
        if not self.active_terms():
            return None
        rows = x.numel() // self.in_features
        if not merges_per_call(rows, self.in_features, self.out_features):
            return None
        weight = self._dense_weight(x)
        if weight is None:
            return None
        bias = self.bias
        return self._summed(weight[0], weight[1]), None if bias is None else bias.to(x.dtype)

    def _dense_weight(self, x: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        """(the weight the base multiplies x by, whether it is a fresh tensor) or None."""
        if isinstance(self.base, nn.Linear):
            return self.base.weight.to(x.dtype), self.base.weight.dtype != x.dtype
        dense = getattr(self.base, "dense_weight", None)
        weight = None if dense is None else dense(x)
        return None if weight is None else (weight, True)

    def _summed(self, weight: torch.Tensor, fresh: bool) -> torch.Tensor:
        """weight + the low-rank and weight terms (in place when the weight is fresh)."""
        for adapter, tensors in self.active_terms(("low_rank", "weight_diff")):
            if adapter.kind == "low_rank":
                down, up = (t.to(weight.dtype) for t in tensors)
                weight = (weight.addmm_(up, down, alpha=adapter.scale) if fresh
                          else torch.addmm(weight, up, down, alpha=adapter.scale))
            else:
                diff = tensors[0].to(weight.dtype)
                weight = (weight.add_(diff, alpha=adapter.scale) if fresh
                          else torch.add(weight, diff, alpha=adapter.scale))
            fresh = True
        return weight

    def lora_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the LoRA terms for input x (out: the base layer's output for x, a tensor of
        its own, which eager runs add to in place)."""
        out = out.contiguous()
        flat, rows = out.view(-1, self.out_features), x.reshape(-1, self.in_features)
        for adapter, tensors in self.active_terms():
            if adapter.kind == "low_rank":
                down, up = (t.to(out.dtype) for t in tensors)
                flat = _add_product(flat, F.linear(rows.to(out.dtype), down), up.t(),
                                    adapter.scale)
            elif adapter.kind == "weight_diff":
                flat = _add_product(flat, rows.to(out.dtype), tensors[0].to(out.dtype).t(),
                                    adapter.scale)
            else:
                flat = flat + tensors[0].to(out.dtype) * adapter.scale
        return flat.view(out.shape)

    def extra_repr(self) -> str:
        return f"loras={[(a.kind, a.scale) for a in self.adapters]}"


_PARTS = {"low_rank": ("down", "up"), "weight_diff": ("diff",), "bias_diff": ("diff_b",)}


class LoraFp8Linear(LoraLinear):
    """LoraLinear around an fp8 layer: keeps the layer's fp8 feed-forward steps
    (runs_fp8_matmul, scaled_forward_without_bias, products_without_bias, gelu_forward), and
    where the fp8 matmul runs, every term reads the input's fp8 codes; so it also takes a
    norm's codes (RowCodes), as the base does."""

    takes_row_codes = True

    def runs_fp8_matmul(self, device: torch.device) -> bool:
        return self.base.runs_fp8_matmul(device)

    def forward(self, x: torch.Tensor | RowCodes) -> torch.Tensor:
        if isinstance(x, RowCodes) or (self.active_terms()
                                       and self.base.runs_fp8_matmul(x.device)):
            codes, scales = self._input_codes(x)
            return self._from_codes(codes, scales, x, with_bias=True,
                                   summed=self._summed_codes(codes.shape[0]))
        return super().forward(x)

    def scaled_forward_without_bias(self, x: torch.Tensor | RowCodes) -> torch.Tensor:
        """The fp8 matmul and the terms without any bias (the next step adds self.bias)."""
        codes, scales = self._input_codes(x)
        return self._from_codes(codes, scales, x, with_bias=False,
                               summed=self._summed_codes(codes.shape[0]))

    def products_without_bias(self, rows: int):
        """scaled_forward_without_bias for row ranges of one input of `rows` rows (an FFN's
        hidden activation made in pieces, dit_ffn.hidden_codes): where the terms are summed into
        the layer's codes, the sum is formed once for all the ranges, not once per range."""
        summed = self._summed_codes(rows)

        def product(x: torch.Tensor | RowCodes) -> torch.Tensor:
            codes, scales = self._input_codes(x)
            return self._from_codes(codes, scales, x, with_bias=False, summed=summed)
        return product

    def _input_codes(self, x: torch.Tensor | RowCodes) -> tuple[torch.Tensor, torch.Tensor]:
        return (x.codes, x.scales) if isinstance(x, RowCodes) else self.base.input_codes(x)

    def gelu_forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """self(gelu_tanh(x + bias)), through the base's fused GELU-quantize step where the fp8
        matmul runs."""
        if not self.base.runs_fp8_matmul(x.device):
            if bias is not None:
                x = x + bias.to(x.dtype)
            return self(F.gelu(x, approximate="tanh"))
        codes, scales = self.base.gelu_codes(x, bias)
        return self._from_codes(codes, scales, x, with_bias=True,
                                summed=self._summed_codes(codes.shape[0]))

    def _from_codes(self, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor | RowCodes,
                    with_bias: bool, summed: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> torch.Tensor:
        """The product of x's codes with the layer and its terms (x: for its shape and dtype);
        `summed`: the layer's codes and scales with the terms added (_summed_codes), or None
        where the terms go to the output."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"LoRA fp8 layer: input of width {x.shape[-1]} for a layer of "
                             f"{self.in_features} input features")
        base = self.base
        bias = self.bias if with_bias else None  # added in the fp8 kernel's epilogue
        if summed is not None:
            out = fp8_codes_matmul(codes, scales, *summed, base.fast_accum, bias)
            return self._shaped(out, x)
        out = fp8_codes_matmul(codes, scales, base.weight, base.weight_scale, base.fast_accum,
                               bias)
        for adapter, tensors in self.active_terms(("low_rank", "weight_diff")):
            if adapter.kind == "low_rank":
                down, up = tensors
                inner = _codes_times(codes, scales, down, base.fast_accum)[:, :down.shape[0]]
                out = _add_product(out, inner, up.to(out.dtype).t(), adapter.scale)
            else:
                out = out + _codes_times(codes, scales, tensors[0], base.fast_accum) * adapter.scale
        return self._shaped(out, x)

    def _summed_codes(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For an input of many rows, the layer's codes and scales with the low-rank terms
        added and requantized for this call (lora/fp8_sum.py); None where the terms go to the
        output instead (few rows, or a full weight difference among the terms)."""
        terms = self.active_terms(("low_rank", "weight_diff"))
        if (not terms or any(a.kind == "weight_diff" for a, _ in terms)
                or not merges_per_call(rows, self.in_features, self.out_features)):
            return None
        return fp8_sum(self.base.weight, self.base.weight_scale,
                       [(down, up, adapter.scale) for adapter, (down, up) in terms])

    def _shaped(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float
                 ) -> torch.Tensor:
    """out + alpha * a @ b. Run eagerly: in place, the product and the sum one matrix product
    (addmm_). Compiled: out of place, so that the compiler folds the sum and the scale into the
    next elementwise step instead of copying out first, as a functional addmm would."""
    if torch.compiler.is_compiling():
        return out + torch.mm(a, b) * alpha
    return out.addmm_(a, b, alpha=alpha)


def _codes_times(codes: torch.Tensor, scales: torch.Tensor, matrix: torch.Tensor,
                 fast_accum: bool) -> torch.Tensor:
    """The fp8 activation codes [M, K] times matrix [N, K]^T (quantized per row here, N padded
    with zero rows to the kernel's multiple): bf16 [M, N padded]."""
    pad = -matrix.shape[0] % _FP8_MULTIPLE
    if pad:
        matrix = F.pad(matrix, (0, 0, 0, pad))
    weight, weight_scale = quantize_rows(matrix, FP8)
    return fp8_codes_matmul(codes, scales, weight, weight_scale.view(-1), fast_accum)


def wrap(model: nn.Module, name: str) -> LoraLinear:
    """The wrapper of block matrix `name` (e.g. 'blocks.0.ffn.2'), put in place if needed."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    layer = getattr(parent, child)
    if isinstance(layer, LoraLinear):
        return layer
    wrapper = (LoraFp8Linear if hasattr(layer, "gelu_forward") else LoraLinear)(layer)
    setattr(parent, child, wrapper)
    return wrapper


def wrappers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def unwrap_all(model: nn.Module) -> None:
    """Every wrapped layer back to its base layer. Factors that block swap had packed into a
    block's buffer are copied out, so the buffer is not kept alive by them."""
    for name, wrapper in wrappers(model).items():
        for _, tensors in wrapper.terms():
            for tensor in tensors:
                if tensor.untyped_storage().nbytes() > tensor.nbytes:
                    tensor.data = tensor.data.clone()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper.base)


def official_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers under their official names, seeing
    through LoRA wrappers ('blocks.0.ffn.2.base.weight' is 'blocks.0.ffn.2.weight')."""
    return {key.replace(".base.", "."): value
            for key, value in model.state_dict(keep_vars=True).items()}
