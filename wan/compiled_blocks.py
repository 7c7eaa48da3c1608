"""The DiT blocks through torch.compile: each of a block's three phases (self-attention,
cross-attention, feed-forward) a compiled graph of its own, made once per process and shared by
every block of every model: the weights are graph inputs, so 30 or 40 blocks reuse the compiled
graphs. They fuse the float32 norms, modulation, RoPE and gated residuals around the matrix and
attention kernels into a few Triton kernels: a forward takes a little less time than the eager
blocks with their own one-pass kernels, and a process's first step with a new video size some
seconds more (bench/results/2026-11-26-h100-eager-or-compiled/ has both).

A graph per phase, not one per block: a compiled graph updates the residual stream out of place
and writes it back at its end, so a graph spanning two residual updates holds a float32 working
copy of x between them (one graph for the block held it through the FFN, one for both attentions
through cross-attention). Instead a phase's update (dit_block.ResidualUpdate) is added at the start of
the next phase's graph, in the pass of that phase's norm, where it would otherwise be a pass of
its own over x: the self-attention's in the cross-attention graph, the cross-attention's in the
FFN graph, the FFN's in the next block's self-attention graph (OwedUpdate carries it). A
handed-on update stays alive through the graph that adds it (the graph's inputs are held until
it returns): the FFN's through the next self-attention, the self-attention's through the
cross-attention, the cross-attention's through the FFN. The last is handed on only where the
FFN makes its hidden activation in pieces (WanBlock.feed_forward_takes_update: both its layers
take fp8 codes), which frees more than the update holds; elsewhere the cross-attention adds its
update in its own graph (a chunked FFN adds its chunks as it goes and hands nothing on). The
first block's self-attention graph, with nothing to add, and the FFN graph without an update to
add are graphs of their own. A new video shape compiles again (tens of seconds, once); values
differ from the eager blocks by rounding only, since the fused kernels skip intermediate
roundings.

The graphs are of the block class's phase methods (self_attention_update, cross_attention_phase
or cross_attention_update, feed_forward_update: wan/dit_block.py WanBlock), taken from the block
given, so this module needs nothing of the model's.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..gpu_support import register_kernel_operators
from .glue import add_gated_

# Every video size, timestep form (TI2V per-frame or not) and weight format gets its own graphs of
# the shared block phases (the self-attention two: the first block's, with nothing owed, and the
# others'); past dynamo's default of 8 per phase, later ones would run eager, unannounced.
COMPILED_GRAPHS_KEPT = 128


class OwedUpdate:
    """The residual update one compiled block leaves to the next. It is held here rather than by
    the caller's variables, so taking it hands it over: it is freed when the next block's
    self-attention graph, which adds it, returns, not kept alive through that block's other
    graphs."""

    def __init__(self):
        self.update = None  # a dit_block.ResidualUpdate, or None

    def take(self):
        update, self.update = self.update, None
        return update


def compiled_block_forward() -> Callable:
    """forward(block, x, e0, rope, context, image_context, attend, compute_dtype, attention_rows,
    owed) -> x, updated in place; with an OwedUpdate `owed`, the update it holds (the previous
    block's FFN) is added first and this block's FFN update is left in it instead of added (the
    caller adds the last one). The self-attention runs in one pass over x's rows (WanDiT.forward
    gives compiled blocks all rows as attention_rows, which the cross-attention takes too)."""
    return _forward


def _forward(block, x, e0, rope, context, image_context, attend, compute_dtype,
             attention_rows=None, owed: OwedUpdate | None = None):
    graphs = _graphs(type(block))
    # the owed update is handed over without a name here: freed when this graph returns
    update = graphs.self_attention(block, x, e0, rope, attend, compute_dtype,
                                   None if owed is None else owed.take())
    if block.feed_forward_takes_update(x, e0, compute_dtype):
        crossed = graphs.cross_attention_update(block, x, context, image_context, attend,
                                                compute_dtype, update)
        del update
        ffn_update = graphs.feed_forward(block, x, e0, compute_dtype, crossed)
        del crossed
    else:
        x = graphs.cross_attention(block, x, context, image_context, attend, compute_dtype,
                                   attention_rows, update)
        del update
        ffn_update = graphs.feed_forward(block, x, e0, compute_dtype)
    if owed is not None:
        owed.update = ffn_update
    elif ffn_update is not None:
        add_gated_(x, *ffn_update)
    return x


class _PhaseGraphs(NamedTuple):
    self_attention: Callable
    cross_attention: Callable
    cross_attention_update: Callable
    feed_forward: Callable


_GRAPHS: dict[type, _PhaseGraphs] = {}


def wrap_phase_graphs(block_class: type, wrap: Callable[[str, Callable], Callable]) -> None:
    """Replace each compiled phase graph of block_class by wrap(its name, the graph), e.g. to
    measure it (bench/phase_peaks_gpu.py); the names are those of _PhaseGraphs."""
    graphs = _graphs(block_class)
    _GRAPHS[block_class] = _PhaseGraphs(*(wrap(name, graph)
                                          for name, graph in zip(_PhaseGraphs._fields, graphs)))


def _graphs(block_class: type) -> _PhaseGraphs:
    graphs = _GRAPHS.get(block_class)
    if graphs is None:
        register_kernel_operators()  # our kernels as operators the graphs keep whole
        _raise_recompile_limit(COMPILED_GRAPHS_KEPT)
        graphs = _GRAPHS[block_class] = _PhaseGraphs(*(
            torch.compile(phase, dynamic=False) for phase in (
                block_class.self_attention_update, block_class.cross_attention_phase,
                block_class.cross_attention_update, block_class.feed_forward_update)))
    return graphs


def _raise_recompile_limit(limit: int) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
