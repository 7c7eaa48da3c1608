"""Which token rows each rank of a sequence-parallel group holds.

The L token rows of a video are cut into `world` shards of equal length n (all-to-all and the
ring need equal shapes); rank r holds global rows [r*n, r*n + n). When L does not divide, the
last rows of the last shard(s) are padding: zero rows that every phase computes like real ones
but that are never used as attention keys and are cut from the output.

With one timestep per latent frame the shard length is rounded up to whole rows of the latent
grid, so that a shard's rows fall into groups of at least one grid row sharing a frame (its
modulation table then has n / g rows, not n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SequenceLayout:
    length: int  # L: real token rows of the whole sequence
    world: int  # ranks sharing the sequence
    rank: int  # this rank, 0..world-1
    shard: int  # n: rows per rank, padding included

    @classmethod
    def make(cls, length: int, world: int, rank: int, row_multiple: int = 1) -> "SequenceLayout":
        if length < 1:
            raise ValueError(f"a sequence of {length} token rows cannot be split")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a group of {world}")
        shard = -(-length // world)
        shard = -(-shard // row_multiple) * row_multiple
        return cls(length, world, rank, shard)

    @property
    def start(self) -> int:
        return self.rank * self.shard

    @property
    def padded_length(self) -> int:
        return self.world * self.shard

    def valid_rows(self, rank: int | None = None) -> int:
        """Real (non-padding) rows of `rank`'s shard (default: this rank's)."""
        rank = self.rank if rank is None else rank
        return max(0, min(self.shard, self.length - rank * self.shard))


def group_rows_for(length: int, groups: int, shard: int) -> int:
    """Rows per modulation group in a shard of `shard` rows, when the whole sequence of `length`
    rows has `groups` groups of length / groups rows: the largest size that divides both a group
    and the shard (so no local group straddles two global ones)."""
    if groups == 1:
        return shard
    return math.gcd(length // groups, shard)
