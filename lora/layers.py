"""Unmerged LoRA: a block matrix wrapped so that its LoRAs are added at run time,

    y = base(x) + sum_i s_i * (x @ down_i^T) @ up_i^T   (+ s_j * x @ diff_j^T, + s_k * bias_k)

with base an nn.Linear or a quantized layer (quant/linear.py), used as it is: an fp8 file's
weights are never dequantized for it. The factors are buffers of the wrapper, plain tensors in
the model's compute dtype, so the device placement and block swap (offload/) move them with
their block like any other tensor; the scales are plain numbers, so changing a strength changes
no tensor.

For fp8 matmuls the wrapper keeps the layer's fast feed-forward path (wan/dit.py feed_forward):
the base still takes the GELU and the first layer's bias into its fp8 input step, and the LoRA
terms are added to its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Adapter:
    """One LoRA's term in a wrapped layer: which buffers and its scale."""
    kind: str  # "low_rank" | "weight_diff" | "bias_diff"
    names: tuple[str, ...]  # buffer names on the wrapper
    scale: float


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

    def lora_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the LoRA terms for input x (out: the base layer's output for x)."""
        for adapter, tensors in self.terms():
            if adapter.scale == 0:
                continue
            if adapter.kind == "low_rank":
                down, up = tensors
                out = out + F.linear(F.linear(x, down) * adapter.scale, up)
            elif adapter.kind == "weight_diff":
                out = out + F.linear(x, tensors[0]) * adapter.scale
            else:
                out = out + (tensors[0] * adapter.scale).to(out.dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_delta(x, self.base(x))

    def extra_repr(self) -> str:
        return f"loras={[(a.kind, a.scale) for a in self.adapters]}"


_PARTS = {"low_rank": ("down", "up"), "weight_diff": ("diff",), "bias_diff": ("diff_b",)}


class LoraFp8Linear(LoraLinear):
    """LoraLinear around an fp8 layer: keeps the layer's fp8 feed-forward steps
    (runs_fp8_matmul, scaled_forward_without_bias, gelu_forward) with the LoRA terms added."""

    def runs_fp8_matmul(self, device: torch.device) -> bool:
        return self.base.runs_fp8_matmul(device)

    @property
    def bias(self) -> torch.Tensor | None:
        """The effective bias (the base's plus the bias differences), for the next layer's
        fused GELU step."""
        bias = self.base.bias
        for adapter, tensors in self.terms():
            if adapter.kind == "bias_diff" and adapter.scale != 0:
                term = tensors[0] * adapter.scale
                bias = term if bias is None else bias + term.to(bias.dtype)
        return bias

    def scaled_forward_without_bias(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.scaled_forward_without_bias(x)
        for adapter, tensors in self.terms():
            if adapter.kind != "bias_diff" and adapter.scale != 0:
                out = self._term(adapter, tensors, x, out)
        return out

    def gelu_forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """self(gelu_tanh(x + bias)), the base's fused fp8 step where it runs."""
        if not self.base.runs_fp8_matmul(x.device):
            if bias is not None:
                x = x + bias.to(x.dtype)
            return self(F.gelu(x, approximate="tanh"))
        out = self.base.gelu_forward(x, bias)
        if any(a.kind != "bias_diff" and a.scale != 0 for a in self.adapters):
            if bias is not None:
                x = x + bias.to(x.dtype)
            out = self.lora_delta(F.gelu(x, approximate="tanh"), out)
        else:
            out = self.lora_delta(x, out)  # bias terms only: x is not read
        return out

    def _term(self, adapter, tensors, x, out):
        if adapter.kind == "low_rank":
            down, up = tensors
            return out + F.linear(F.linear(x, down) * adapter.scale, up)
        return out + F.linear(x, tensors[0]) * adapter.scale


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
