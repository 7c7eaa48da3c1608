"""The weight quantization choices as typed configurations, one class per kind (the shape of
torchao's `quantize_(model, config)`), each known by the weight_dtype name ComfyUI users know.

    quantize_block_linears(model, Float8DynamicActivationFloat8WeightConfig())
    quantize_block_linears(model, "int8")  # the same by name
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .linear import Fp8Linear, Int8Linear, QuantizedLinear

# Activations, embeddings and the head run in bf16 around quantized block matrices: fp8 and
# int8 products come out in bf16 (torch._scaled_mm's row-wise mode allows nothing else), and
# fp16's range is too narrow for Wan's activations.
COMPUTE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class QuantConfig:
    """A weight quantization: the layer it makes and the layer's settings."""

    name: ClassVar[str]  # the weight_dtype value
    layer: ClassVar[type[QuantizedLinear]]

    @property
    def options(self) -> dict:
        """Keyword arguments of the layer."""
        return {}

    @property
    def low_precision_matmul(self) -> bool:
        """The matrix product itself runs in 8 bits (not only the stored weights)."""
        return False

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.layer.fmt.dtype

    def quantize(self, linear: torch.nn.Linear,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE) -> QuantizedLinear:
        return self.layer.from_linear(linear, compute_dtype, **self.options)


@dataclass(frozen=True)
class Float8WeightOnlyConfig(QuantConfig):
    """fp8 weights, dequantized to bf16 for each matmul: any device."""
    name: ClassVar[str] = "fp8_e4m3fn"
    layer: ClassVar[type[QuantizedLinear]] = Fp8Linear

    @property
    def options(self) -> dict:
        return {"fast": False}


@dataclass(frozen=True)
class Float8DynamicActivationFloat8WeightConfig(QuantConfig):
    """fp8 x fp8 matmul (torch._scaled_mm), activations scaled per token: GPUs of compute
    capability 8.9+. fast_accum: the tensor cores' own accumulator over K (faster, the same
    distance to float32 at Wan's widths)."""
    name: ClassVar[str] = "fp8_e4m3fn_fast"
    layer: ClassVar[type[QuantizedLinear]] = Fp8Linear
    fast_accum: bool = True

    @property
    def options(self) -> dict:
        return {"fast": True, "fast_accum": self.fast_accum}

    @property
    def low_precision_matmul(self) -> bool:
        return True


@dataclass(frozen=True)
class Int8WeightOnlyConfig(QuantConfig):
    """int8 weights, dequantized to bf16 for each matmul."""
    name: ClassVar[str] = "int8"
    layer: ClassVar[type[QuantizedLinear]] = Int8Linear

    @property
    def options(self) -> dict:
        return {"dynamic": False}


@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """W8A8: int8 weights and per-token int8 activations, integer matmul (torch._int_mm)."""
    name: ClassVar[str] = "int8_dynamic"
    layer: ClassVar[type[QuantizedLinear]] = Int8Linear

    @property
    def options(self) -> dict:
        return {"dynamic": True}

    @property
    def low_precision_matmul(self) -> bool:
        return True


# The name the loaders and the model handle have used for a configuration.
QuantScheme = QuantConfig

SCHEMES: dict[str, QuantConfig] = {c.name: c for c in (
    Float8WeightOnlyConfig(), Float8DynamicActivationFloat8WeightConfig(),
    Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig())}


def scheme(name: str) -> QuantConfig:
    if name not in SCHEMES:
        raise ValueError(f"quantization {name!r} is not one of {list(SCHEMES)}")
    return SCHEMES[name]
