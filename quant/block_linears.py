"""Swapping a Wan DiT's block matrices for quantized layers.

Only the large matrices inside the transformer blocks (attention projections, FFN; see
wan.dit.is_block_linear) are quantized: they are nearly all of the weights. Embeddings, norms,
modulation tables and the head are small and sensitive, and stay as they are.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..wan.dit import is_block_linear
from .linear import QuantizedLinear
from .schemes import COMPUTE_DTYPE, QuantConfig, scheme as scheme_named


def is_block_matrix(module: nn.Module, name: str) -> bool:
    """The default filter: an nn.Linear that is one of the blocks' large matrices."""
    return isinstance(module, nn.Linear) and is_block_linear(f"{name}.weight")


def block_linear_names(model: nn.Module,
                       filter_fn: Callable[[nn.Module, str], bool] = is_block_matrix
                       ) -> list[str]:
    """Qualified names of the layers `filter_fn` picks (by default the block matrices, e.g.
    'blocks.0.ffn.2')."""
    return [name for name, module in model.named_modules() if filter_fn(module, name)]


def quantize_block_linears(model: nn.Module, config: QuantConfig | str,
                           filter_fn: Callable[[nn.Module, str], bool] = is_block_matrix,
                           compute_dtype: torch.dtype = COMPUTE_DTYPE) -> nn.Module:
    """Replace the layers of `model` (a WanDiT, or another model with a filter) that
    `filter_fn(module, qualified_name)` picks (the DiT's block matrices by default) by quantized
    layers of `config` (or its weight_dtype name), in place, computing in `compute_dtype` (the
    model's compute_dtype, where it has one, becomes that too). The weights are quantized from
    the layers' own values; on the meta device this only builds empty quantized layers, ready
    for a checkpoint's tensors."""
    chosen = scheme_named(config) if isinstance(config, str) else config
    for name in block_linear_names(model, filter_fn):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, chosen.quantize(getattr(parent, child), compute_dtype))
    if hasattr(model, "compute_dtype"):
        model.compute_dtype = compute_dtype
    return model


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
