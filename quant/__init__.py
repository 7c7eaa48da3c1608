"""Weight quantization of the Wan DiT's block matrices: FP8 e4m3fn and INT8 with per-output-
channel scales, quantized on load (checkpoints/loader.py) or in memory (quantize_block_linears).

Every quantized layer keeps plain tensors (no tensor subclasses), so block swap and device
placement move it as raw bytes like any other layer.
"""

from .block_linears import (block_linear_names, is_block_matrix, quantize_block_linears,
                            quantized_layers)
from .linear import Fp8Linear, Int8Linear, QuantizedLinear
from .schemes import (COMPUTE_DTYPE, SCHEMES, Float8DynamicActivationFloat8WeightConfig,
                      Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                      Int8WeightOnlyConfig, QuantConfig, QuantScheme, scheme)

__all__ = ["COMPUTE_DTYPE", "SCHEMES", "Float8DynamicActivationFloat8WeightConfig",
           "Float8WeightOnlyConfig", "Fp8Linear", "Int8DynamicActivationInt8WeightConfig",
           "Int8Linear", "Int8WeightOnlyConfig", "QuantConfig", "QuantScheme",
           "QuantizedLinear", "block_linear_names", "is_block_matrix", "quantize_block_linears",
           "quantized_layers", "scheme"]
