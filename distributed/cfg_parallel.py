"""CFG parallel: the conditional and the unconditional forward of a step on the two halves of
the group at once, each half splitting the token sequence over its own ranks.

The denoise loop already knows one form of this: a batched conditioning makes it call the model
once with the sample twice along the batch (cond rows first) and read the two velocities back
from the result (sampling/guidance.py). Here the batched conditioning is a CfgPair: the model
callable (ParallelModel) gives the cond rows to the first half of the ranks and the uncond rows
to the second, and rank i of each half swaps its velocity with rank i of the other, so every
rank returns both, as one forward over the batch would. Steps that need one forward only
(guidance 1, as an A14B expert may have) run it over the whole group.

A group of odd size cannot halve: the loop then gets no batched conditioning and runs the two
forwards one after the other, each over the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .comm_stats import CommStats
from .sequence_split import SequenceSplit


@dataclass(frozen=True)
class CfgPair:
    """The batched conditioning of a CFG-parallel step: one conditioning per half."""
    cond: Any
    uncond: Any


class Topology:
    """The process groups of a worker group of `world` ranks, made once (every rank must make
    every group, in the same order): the two halves, and the pairs (i, i + world/2)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank
        self.halves = world >= 2 and world % 2 == 0
        self.half_group = self.pair_group = None
        self.half = self.half_size = None
        if not self.halves:
            return
        size = world // 2
        self.half_size, self.half = size, rank // size
        for half in range(2):
            group = dist.new_group(list(range(half * size, half * size + size)))
            if half == self.half:
                self.half_group = group
        for i in range(size):
            group = dist.new_group([i, i + size])
            if rank % size == i:
                self.pair_group = group


def topology(state) -> Topology:
    """The worker's topology, made on first use and kept."""
    found = state.cache.get("topology")
    if found is None:
        found = state.cache["topology"] = Topology(state.world, state.rank)
    return found


Forward = Callable[[torch.Tensor, torch.Tensor, Any, SequenceSplit | None], torch.Tensor]


class ParallelModel:
    """A model callable for the denoise loop (model(x, t, cond) -> v) over the worker group."""

    def __init__(self, forward: Forward, topo: Topology, mode: str, stats: CommStats):
        self.forward, self.topo, self.mode, self.stats = forward, topo, mode, stats

    def _split(self, group, size: int) -> SequenceSplit | None:
        return SequenceSplit(group, self.mode, self.stats) if size > 1 else None

    def __call__(self, x: torch.Tensor, t: torch.Tensor, cond) -> torch.Tensor:
        if not isinstance(cond, CfgPair):
            return self.forward(x, t, cond, self._split(None, self.topo.world))
        topo = self.topo
        batch = x.shape[0] // 2
        rows = slice(0, batch) if topo.half == 0 else slice(batch, 2 * batch)
        mine = self.forward(x[rows], t[rows], cond.cond if topo.half == 0 else cond.uncond,
                            self._split(topo.half_group, topo.half_size)).contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        with self.stats.timed("cfg", mine.numel() * mine.element_size()):
            dist.all_gather(both, mine, group=topo.pair_group)
        return torch.cat(both)  # the pair's group ranks: the cond half's first
