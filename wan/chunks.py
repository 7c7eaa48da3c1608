"""How the DiT blocks cut the token rows into chunks: each of a block's phases runs over row
chunks so that its float32 norms, projections and the FFN's hidden activation exist for one
chunk at a time (wan/dit_block.py), and the head does too (wan/dit.py)."""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from ..quant.linear import layer_output_bytes

# Token rows per pass through a block. Each of the block's three phases (self-attention,
# cross-attention, feed-forward) runs over chunks of this many rows, so its float32 norms and
# modulation, its projections and the FFN's hidden activation exist for one chunk at a time:
# at 14B 720p (75,600 tokens) a chunk's temporaries are a tenth of the full ones, and the block's
# peak is the residual stream plus the self-attention keys and values (H100, one forward: 5.8
# GiB of activations instead of 8.0, for 4% more time).
ROW_CHUNK_TOKENS = 8192

# The feed-forward phase runs in one pass while its hidden activation (rows x ffn_dim, at the
# bytes per element its first layer holds: hidden_bytes) stays under this many bytes, and in
# equal chunks beyond: a 5B 720p block (0.8 GB in bf16) runs whole, a 14B 720p one (2.1 GB) in
# three chunks, and with int8 W8A8 matrices (int32 products beside the bf16 output, 2.3 GB) the
# 5B block in three too.
FFN_HIDDEN_BYTES = 1 << 30


# The check a forward runs between two row chunks of a phase (its caller's interrupt check: a
# stop request is honoured within a block, not only between blocks); none outside a forward.
_BETWEEN_CHUNKS: ContextVar[Callable[[], None] | None] = ContextVar("between_chunks",
                                                                   default=None)


@contextlib.contextmanager
def checks_between_chunks(check: Callable[[], None]):
    """Within the block, `check()` runs between the row chunks of every phase (`checked`)."""
    token = _BETWEEN_CHUNKS.set(check)
    try:
        yield
    finally:
        _BETWEEN_CHUNKS.reset(token)


def checked(chunks: list[tuple[int, int]]) -> Iterable[tuple[int, int]]:
    """The chunks in order, the current check (checks_between_chunks) run before each but the
    first; a compiled graph takes them unchecked (a check there would break the graph)."""
    if len(chunks) < 2 or torch.compiler.is_compiling():
        return chunks
    check = _BETWEEN_CHUNKS.get()
    return chunks if check is None else _checked(chunks, check)


def _checked(chunks, check) -> Iterator[tuple[int, int]]:
    for index, chunk in enumerate(chunks):
        if index:
            check()
        yield chunk


def row_chunks(length: int, groups: int, target: int | None = None,
               unit: int | None = None) -> list[tuple[int, int]]:
    """Row ranges [start, end) covering 0..length. With several timestep groups (per frame or
    per token) each range holds whole groups, so its modulation is a slice of the group tables.
    With `unit` (attention.wave_rows: query rows that fill whole waves of the GPU) each range but
    the last also holds a multiple of it, the multiple nearest `target`, where one holding both
    whole groups and whole units is at most 1.5 times `target`, which bounds what a chunk's
    temporaries may grow by (else unit is not taken)."""
    target = ROW_CHUNK_TOKENS if target is None else target
    if length <= target:
        return [(0, length)]
    per_group = length // groups if groups > 1 else 1
    step = max(1, target // per_group) * per_group
    both = math.lcm(per_group, unit) if unit else None
    if both is not None and 2 * both <= 3 * target:
        step = max(1, round(target / both)) * both
    return [(start, min(start + step, length)) for start in range(0, length, step)]


def hidden_bytes(first: nn.Module, dtype: torch.dtype) -> int:
    """Bytes per element of the FFN's hidden activation while its first layer makes it in
    `dtype` (quant/linear.py layer_output_bytes: a quantized layer's own count, else the
    dtype's size)."""
    return layer_output_bytes(first, dtype)


def ffn_chunks(length: int, groups: int, ffn_dim: int, itemsize: int) -> list[tuple[int, int]]:
    """Row ranges for the feed-forward phase: one when the hidden activation is small enough,
    else about equal ones (no short last chunk, whose matrix products run slowest)."""
    pieces = -(-length * ffn_dim * itemsize // FFN_HIDDEN_BYTES)
    return row_chunks(length, groups, -(-length // pieces))


def group_rows(table: torch.Tensor, start: int, end: int, length: int) -> torch.Tensor:
    """The part of a per-group table [B, G, D] that covers token rows [start, end)."""
    groups = table.shape[1]
    if groups == 1:
        return table
    per_group = length // groups
    return table[:, start // per_group:end // per_group]
