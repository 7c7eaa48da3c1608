"""The DiT block's feed-forward (linear, tanh-GELU, linear) as the layers' kinds take it: the
GELU in the second fp8 layer's input step or in the first 16-bit layer's product epilogue, and
the hidden activation's fp8 codes made in row pieces."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..quant.gelu_fp8 import gelu_quantize_in_pieces
from ..quant.rowwise import RowCodes
from .glue import gelu_product_weights, linear_gelu


def feed_forward(ffn: nn.Sequential, h: torch.Tensor | RowCodes, pieces: int = 1
                 ) -> torch.Tensor:
    """Linear, tanh-GELU, linear. A second layer that can take the GELU into its input step
    (fp8 matmuls: quant/linear.py gelu_forward) does, and then takes the first layer's bias
    too when the first one runs an fp8 matmul; otherwise a plain 16-bit first layer on a GPU
    takes the GELU into its product's epilogue (glue.linear_gelu), also with its LoRA terms
    summed into the weight for the call. `pieces` > 1: where both layers run fp8 matmuls, the
    first layer's output exists for one of that many row pieces at a time (hidden_codes), the
    same numbers."""
    first, act, second = ffn
    gelu_forward = getattr(second, "gelu_forward", None)
    if gelu_forward is None:
        weights = gelu_product_weights(first, act, h)
        if weights is not None:
            return second(linear_gelu(h, *weights))
        return second(act(first(h)))
    fp8_first = getattr(first, "runs_fp8_matmul", None)
    # a norm's codes (RowCodes) come only to a first layer that runs the fp8 matmul
    if fp8_first is not None and (isinstance(h, RowCodes) or fp8_first(h.device)):
        if pieces > 1 and second.runs_fp8_matmul(_device(h)):
            return second(hidden_codes(first, h, pieces))
        return gelu_forward(first.scaled_forward_without_bias(h), first.bias)
    return gelu_forward(first(h))


def hidden_codes(first: nn.Module, h: torch.Tensor | RowCodes, pieces: int) -> RowCodes:
    """The fp8 codes of gelu_tanh(first(h)), the input of an fp8 second layer, made `pieces`
    row ranges at a time: first's product of each range (without its bias), then its GELU and
    codes into rows of one codes tensor (quant/gelu_fp8.py gelu_quantize_in_pieces); each row
    is the whole product's row, so the codes are gelu_forward's to the bit. A LoRA'd first
    layer that sums its terms into its weight per call (lora/layers.py) does so once for all
    the pieces (products_without_bias)."""
    rows = math.prod(h.shape[:-1])
    step = -(-rows // pieces)
    piece_product = first.products_without_bias(rows)

    def product(start: int, end: int) -> torch.Tensor:
        return piece_product(_row_range(h, start, end))

    codes, scales = gelu_quantize_in_pieces(
        product, rows, first.out_features, first.bias,
        [(start, min(start + step, rows)) for start in range(0, rows, step)], _device(h))
    return RowCodes(codes, scales, (*h.shape[:-1], first.out_features), h.dtype)


def _row_range(h: torch.Tensor | RowCodes, start: int, end: int) -> torch.Tensor | RowCodes:
    """Rows start..end of h's rows (all leading dimensions flattened)."""
    if isinstance(h, RowCodes):
        return RowCodes(h.codes[start:end], h.scales[start:end], (end - start, h.shape[-1]),
                        h.dtype)
    return h.reshape(-1, h.shape[-1])[start:end]


def _device(h: torch.Tensor | RowCodes) -> torch.device:
    return h.codes.device if isinstance(h, RowCodes) else h.device
