"""The DiT's sequence-parallel hook: WanDiT.forward(..., sequence=SequenceSplit(...)).

Every rank of the group runs the same forward on the same inputs. After the patch embedding,
`shard` keeps this rank's rows of the token sequence (layout.py) and makes everything indexed by
token position match them by GLOBAL position: the rotary table's rows, and the timestep
modulation when it is per frame or per token. The blocks then run unchanged on the shard:
cross-attention and every row-wise phase are local, and self-attention, the one phase that mixes
rows, runs over the whole sequence through the `attend` this hook hands the blocks (its
`self_attention`: Ulysses when the heads divide by the group size, else ring). After the head,
`gather` joins the shards' outputs in rank order and cuts the padding, so every rank returns
the whole velocity.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..wan.rope import RotaryTable
from .comm_stats import CommStats
from .layout import SequenceLayout, group_rows_for
from .ring import ring_attention
from .ulysses import ulysses_attention

MODES = ("auto", "ulysses", "ring")


def choose_mode(heads: int, world: int, mode: str = "auto") -> str:
    """Ulysses when the head count divides by the group size, ring otherwise."""
    if mode not in MODES:
        raise ValueError(f"sequence-parallel mode {mode!r} is not one of {list(MODES)}")
    if mode == "auto":
        return "ulysses" if heads % world == 0 else "ring"
    if mode == "ulysses" and heads % world:
        raise ValueError(f"Ulysses attention needs the {heads} heads to divide by the group size "
                         f"{world}; use ring")
    return mode


class SequenceAttention:
    """The `attend` the blocks get: called directly (cross-attention) it is the local backend;
    `self_attention` attends this rank's queries to the keys of the whole sequence."""

    def __init__(self, local: Callable, layout: SequenceLayout, group, mode: str,
                 stats: CommStats):
        self.local, self.layout, self.group, self.mode, self.stats = (
            local, layout, group, mode, stats)

    def __call__(self, q, k, v):
        return self.local(q, k, v)

    @torch.compiler.disable
    def self_attention(self, q, k, v):
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.layout, self.group, self.local, self.stats)
        return ring_attention(q, k, v, self.layout, self.group, self.stats)


class LocalRotaryTable(RotaryTable):
    """The rows of a whole-sequence rotary table that one shard covers, by global position;
    padding rows rotate by nothing."""

    def __init__(self, table: RotaryTable, layout: SequenceLayout):
        start, real = layout.start, layout.valid_rows()
        pad = layout.shard - real
        self.cos = _padded(table.cos[start:start + real], pad, 1.0)
        self.sin = _padded(table.sin[start:start + real], pad, 0.0)


def _padded(rows: torch.Tensor, pad: int, value: float) -> torch.Tensor:
    if pad == 0:
        return rows.contiguous()
    filler = rows.new_full((pad, *rows.shape[1:]), value)
    return torch.cat((rows, filler)).contiguous()


class SequenceSplit:
    """One forward's split over a process group (None: the default group)."""

    def __init__(self, group=None, mode: str = "auto", stats: CommStats | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mode = mode
        self.stats = stats if stats is not None else CommStats()
        self.layout: SequenceLayout | None = None

    def shard(self, tokens: torch.Tensor, grid, e: torch.Tensor, e0: torch.Tensor,
              rope: RotaryTable, attend: Callable, heads: int):
        """This rank's token rows, time tables, rotary table and the sequence-wide `attend`."""
        length, groups = tokens.shape[1], e.shape[1]
        row_multiple = grid[2] if 1 < groups < length else 1
        layout = SequenceLayout.make(length, self.world, self.rank, row_multiple)
        self.layout = layout
        mode = choose_mode(heads, self.world, self.mode)
        local = _rows(tokens, layout).contiguous()
        e, e0 = (_group_table(table, layout, groups) for table in (e, e0))
        return (local, e, e0, LocalRotaryTable(rope, layout),
                SequenceAttention(attend, layout, self.group, mode, self.stats))

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Every shard's rows of `out` [B, n, C], in rank order, without the padding."""
        layout = self.layout
        parts = [torch.empty_like(out) for _ in range(self.world)]
        with self.stats.timed("gather", out.numel() * out.element_size() * (self.world - 1)):
            dist.all_gather(parts, out.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :layout.length]


def _rows(tokens: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    start, real = layout.start, layout.valid_rows()
    rows = tokens[:, start:start + real]
    pad = layout.shard - real
    if pad == 0:
        return rows
    return torch.cat((rows, rows.new_zeros(rows.shape[0], pad, *rows.shape[2:])), dim=1)


def _group_table(table: torch.Tensor, layout: SequenceLayout, groups: int) -> torch.Tensor:
    """A [B, G, ...] table of the whole sequence as the shard's [B, n / g, ...] table: g rows per
    local group (group_rows_for), each taking the global group its first row belongs to
    (padding rows: the last group)."""
    if groups == 1:
        return table
    per_group = layout.length // groups
    size = group_rows_for(layout.length, groups, layout.shard)
    first_rows = torch.arange(layout.start, layout.start + layout.shard, size,
                              device=table.device)
    index = torch.clamp(first_rows // per_group, max=groups - 1)
    return table[:, index]
