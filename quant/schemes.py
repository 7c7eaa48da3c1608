"""The weight quantization choices of the model loader, by the names ComfyUI users know."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .linear import Fp8Linear, Int8Linear, QuantizedLinear

# Activations, embeddings and the head run in bf16 around quantized block matrices: fp8 and
# int8 products come out in bf16 (torch._scaled_mm's row-wise mode allows nothing else), and
# fp16's range is too narrow for Wan's activations.
COMPUTE_DTYPE = torch.bfloat16


@dataclass(frozen=True, eq=False)
class QuantScheme:
    name: str  # the weight_dtype value
    layer: type[QuantizedLinear]
    options: dict = field(default_factory=dict)  # keyword arguments of the layer

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.layer.fmt.dtype

    def quantize(self, linear: torch.nn.Linear) -> QuantizedLinear:
        return self.layer.from_linear(linear, COMPUTE_DTYPE, **self.options)


SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    # fp8 weights, dequantized to bf16 for each matmul: any device
    QuantScheme("fp8_e4m3fn", Fp8Linear, {"fast": False}),
    # fp8 x fp8 matmul (torch._scaled_mm), activations scaled per token: compute capability 8.9+
    QuantScheme("fp8_e4m3fn_fast", Fp8Linear, {"fast": True}),
    # int8 weights, dequantized to bf16 for each matmul
    QuantScheme("int8", Int8Linear, {"dynamic": False}),
    # W8A8: int8 weights and per-token int8 activations, integer matmul (torch._int_mm)
    QuantScheme("int8_dynamic", Int8Linear, {"dynamic": True}),
)}


def scheme(name: str) -> QuantScheme:
    if name not in SCHEMES:
        raise ValueError(f"quantization {name!r} is not one of {list(SCHEMES)}")
    return SCHEMES[name]
