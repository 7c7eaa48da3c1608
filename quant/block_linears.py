"""Swapping a Wan DiT's block matrices for quantized layers.

Only the large matrices inside the transformer blocks (attention projections, FFN; see
wan.dit.is_block_linear) are quantized: they are nearly all of the weights. Embeddings, norms,
modulation tables and the head are small and sensitive, and stay as they are.
"""

from __future__ import annotations

import torch.nn as nn

from ..wan.dit import is_block_linear
from .linear import QuantizedLinear
from .schemes import COMPUTE_DTYPE, QuantScheme, scheme as scheme_named


def block_linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the nn.Linear block matrices (e.g. 'blocks.0.ffn.2')."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and is_block_linear(f"{name}.weight")]


def quantize_block_linears(model: nn.Module, scheme: QuantScheme | str) -> nn.Module:
    """Replace the block matrices of `model` (a WanDiT) by quantized layers, in place; its
    compute dtype becomes bf16. The weights are quantized from the layers' own values; on the
    meta device this only builds empty quantized layers, ready for a checkpoint's tensors."""
    chosen = scheme_named(scheme) if isinstance(scheme, str) else scheme
    for name in block_linear_names(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, chosen.quantize(getattr(parent, child)))
    model.compute_dtype = COMPUTE_DTYPE
    return model


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
