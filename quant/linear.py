"""Linear layers with low-precision weights: FP8 e4m3fn and INT8, one float32 scale per output
channel, bias in the compute dtype.

State contract (the block swap engine and the device placement rely on it): every tensor is a
plain torch.Tensor registered as a parameter with requires_grad=False — `weight` (codes
[out, in]), `weight_scale` (float32 [out]) and `bias` — and `forward` reads them afresh at
every call; nothing derived from them (transposes, dequantized copies) is kept on the module.
So swapping each tensor's `.data` for a view into a device buffer of the same shape and dtype
is all it takes to move a layer. Forward branches only on devices, shapes and flags, never on
tensor values, so torch.compile traces it into one graph.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gpu_support import warn_once
from .fp8_rows import quantize_activations, quantize_opaque_output
from .gelu_fp8 import gelu_quantize
from .kernels import (fp8_codes_matmul, fp8_matmul_unavailable, fp8_scaled_matmul,
                      fp8_shape_unsupported, int8_scaled_matmul)
from .rowwise import (FP8, INT8, RowCodes, RowFormat, dequantize_weight, quantize_rows,
                      quantize_weight)


def fast_fallback_message(reason: str, dtype: torch.dtype) -> str:
    return (f"fp8_e4m3fn_fast: {reason}; dequantizing the weights to "
            f"{str(dtype).removeprefix('torch.')} for the matmul instead")


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def layer_output_bytes(layer: nn.Module, dtype: torch.dtype) -> int:
    """Bytes per output element `layer`'s forward holds at its peak in `dtype`: what a quantized
    layer (or a LoRA around one) says (output_bytes), else the dtype's size."""
    output_bytes = getattr(layer, "output_bytes", None)
    return dtype.itemsize if output_bytes is None else output_bytes(dtype)


class QuantizedLinear(nn.Module):
    """Codes and per-output-channel scales; the default forward dequantizes the weight to the
    input's dtype and multiplies (any device)."""

    fmt: RowFormat

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 compute_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype  # what the weights are dequantized to by default
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=self.fmt.dtype,
                                          device=device))
        self.weight_scale = _frozen(torch.ones(out_features, dtype=torch.float32,
                                               device=device))
        if bias:
            self.bias = _frozen(torch.zeros(out_features, dtype=compute_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16,
                    **options) -> "QuantizedLinear":
        """`linear` quantized (on its device; a meta layer gives a meta layer to load into)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None,
                     compute_dtype, device="meta", **options)
        if linear.weight.is_meta:
            # The constructor's state already has the right shapes and dtypes. Quantizing meta
            # tensors would only repeat that, and it makes torch import its Python meta kernels
            # (torch._dynamo, sympy: about 70 MiB per process).
            return module
        codes, scales = quantize_weight(linear.weight.detach(), cls.fmt)
        bias = None if linear.bias is None else linear.bias.detach().to(compute_dtype)
        module.assign(codes, scales, bias)
        return module

    def assign(self, codes: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None) -> None:
        """Take these tensors as the layer's state (shapes and dtypes checked)."""
        expected = (self.out_features, self.in_features)
        if tuple(codes.shape) != expected or codes.dtype != self.fmt.dtype:
            raise ValueError(f"weight codes {codes.dtype} {list(codes.shape)}; expected "
                             f"{self.fmt.dtype} {list(expected)}")
        if tuple(scales.shape) != (self.out_features,) or scales.dtype != torch.float32:
            raise ValueError(f"weight scales {scales.dtype} {list(scales.shape)}; expected "
                             f"float32 [{self.out_features}]")
        self.weight = _frozen(codes)
        self.weight_scale = _frozen(scales)
        if bias is not None:
            self.bias = _frozen(bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype)

    def dequantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantized_forward(x)

    def dense_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The weight this layer's forward would multiply x by, dequantized to x's dtype (a
        fresh tensor), or None where the forward multiplies codes (an fp8 or int8 kernel)."""
        return self.dequantized_weight(x.dtype)

    def output_bytes(self, dtype: torch.dtype) -> int:
        """Bytes per output element the forward holds at its peak, output in `dtype` included
        (the FFN's row chunks are sized by it: chunks.ffn_chunks)."""
        return dtype.itemsize

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.fmt.dtype}")


class Fp8Linear(QuantizedLinear):
    """FP8 e4m3fn weights. `fast`: fp8 x fp8 matmul through torch._scaled_mm with the
    activations quantized per token, where the GPU has it (compute capability 8.9+, widths
    multiples of 16); elsewhere the dequantizing forward, announced once by a warning."""

    fmt = FP8
    # forward and scaled_forward_without_bias also take a norm's codes (rowwise.RowCodes) where
    # runs_fp8_matmul holds
    takes_row_codes = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 compute_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, fast: bool = False,
                 fast_accum: bool = True):
        super().__init__(in_features, out_features, bias, compute_dtype, device)
        self.fast = fast
        self.fast_accum = fast_accum  # the tensor cores' own accumulator over K (see kernels)

    def forward(self, x: torch.Tensor | RowCodes) -> torch.Tensor:
        if isinstance(x, RowCodes):
            return self._codes_product(*self._row_codes(x), x, self.bias)
        return self.scaled_forward(x) if self._multiplies_codes(x) else self.dequantized_forward(x)

    def dense_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self._multiplies_codes(x) else self.dequantized_weight(x.dtype)

    def _multiplies_codes(self, x: torch.Tensor) -> bool:
        """Whether the forward for x runs the fp8 matmul; a fast layer that cannot run it here
        says why, once, and dequantizes instead."""
        if not self.fast:
            return False
        reason = self._fp8_matmul_reason(x.device)
        if reason is not None:
            warn_once(fast_fallback_message(reason, x.dtype))
        return reason is None

    def _fp8_matmul_reason(self, device: torch.device) -> str | None:
        return (fp8_matmul_unavailable(device)
                or fp8_shape_unsupported(self.in_features, self.out_features))

    def scaled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fp8 matmul itself (no device check: callers make sure the kernel exists)."""
        lead = x.shape[:-1]
        out = fp8_scaled_matmul(x.reshape(-1, self.in_features), self.weight,
                                self.weight_scale, self.fast_accum, self.bias)
        return self._finish(out, x.dtype, lead)

    def runs_fp8_matmul(self, device: torch.device) -> bool:
        return self.fast and self._fp8_matmul_reason(device) is None

    def scaled_forward_without_bias(self, x: torch.Tensor | RowCodes) -> torch.Tensor:
        """The fp8 matmul without the bias (which the next step adds: gelu_forward)."""
        if isinstance(x, RowCodes):
            return self._codes_product(*self._row_codes(x), x, None)
        out = fp8_scaled_matmul(x.reshape(-1, self.in_features), self.weight,
                                self.weight_scale, self.fast_accum)
        return self._finish(out, x.dtype, x.shape[:-1])

    def products_without_bias(self, rows: int):
        """scaled_forward_without_bias for row ranges of one input of `rows` rows (as
        LoraFp8Linear's, which forms its summed weight once for them)."""
        return self.scaled_forward_without_bias

    def gelu_forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """self(gelu_tanh(x + bias)). Where the fp8 matmul runs, the bias, the GELU and the
        activations' fp8 quantization are one pass over x (quant/gelu_fp8.py) instead of
        four."""
        if self.runs_fp8_matmul(x.device):
            return self._codes_product(*self.gelu_codes(x, bias), x, self.bias)
        if bias is not None:
            x = x + bias.to(x.dtype)
        return self(F.gelu(x, approximate="tanh"))

    def forward_after_opaque(self, x: torch.Tensor) -> torch.Tensor:
        """self(x) for an x made by an operator torch.compile cannot fuse into (the attention
        output): its fp8 codes come from the row kernel inside compiled graphs too
        (fp8_rows.quantize_opaque_output)."""
        if not self._multiplies_codes(x):
            return self.dequantized_forward(x)
        return self._codes_product(*quantize_opaque_output(x.reshape(-1, self.in_features)), x,
                                   self.bias)

    def input_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., K] as the fp8 matmul's input: codes [M, K] and float32 scales [M, 1]."""
        return quantize_activations(x.reshape(-1, self.in_features))

    def gelu_codes(self, x: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """gelu_tanh(x + bias) as the fp8 matmul's input, in one pass (quant/gelu_fp8.py)."""
        return gelu_quantize(x.reshape(-1, self.in_features), bias)

    def _codes_product(self, codes: torch.Tensor, scales: torch.Tensor,
                       x: torch.Tensor | RowCodes, bias: torch.Tensor | None) -> torch.Tensor:
        """The fp8 matmul of x's activation codes [M, K] (scales [M, 1]) with `bias` in its
        epilogue, in x's dtype and leading shape."""
        out = fp8_codes_matmul(codes, scales, self.weight, self.weight_scale, self.fast_accum,
                               bias)
        return self._finish(out, x.dtype, x.shape[:-1])

    def _row_codes(self, rows: RowCodes) -> tuple[torch.Tensor, torch.Tensor]:
        """A norm's codes and scales (callers checked runs_fp8_matmul), refused by name where
        their width is not this layer's."""
        if rows.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear: input codes of width {rows.shape[-1]} for a layer of "
                             f"{self.in_features} input features")
        return rows.codes, rows.scales

    def _finish(self, out: torch.Tensor, dtype: torch.dtype, lead) -> torch.Tensor:
        """The matmul's bf16 output (its bias added in the kernel) in x's dtype and shape."""
        return out.to(dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fast={self.fast}, fast_accum={self.fast_accum}"


class Int8Linear(QuantizedLinear):
    """INT8 weights. Weight-only by default (dequantize, then matmul in the input's dtype);
    `dynamic`: W8A8, the activations quantized to int8 per token and multiplied in integers
    (torch._int_mm on CUDA, exact float64 elsewhere), rescaled in float32."""

    fmt = INT8

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 compute_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, dynamic: bool = False):
        super().__init__(in_features, out_features, bias, compute_dtype, device)
        self.dynamic = dynamic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dynamic_forward(x) if self.dynamic else self.dequantized_forward(x)

    def dense_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.dynamic else self.dequantized_weight(x.dtype)

    def output_bytes(self, dtype: torch.dtype) -> int:
        # W8A8: the int32 products beside the output (kernels.int8_scaled_matmul)
        return 4 + dtype.itemsize if self.dynamic else dtype.itemsize

    def dynamic_forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        codes, scales = quantize_rows(x.reshape(-1, self.in_features), INT8)
        out = int8_scaled_matmul(codes, scales, self.weight, self.weight_scale, self.bias,
                                 x.dtype)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dynamic={self.dynamic}"
