"""Ulysses self-attention: an all-to-all turns row shards of all heads into all rows of a
share of the heads, attention runs there over the whole sequence, and a second all-to-all
brings the output back to row shards.

q, k and v travel in one all-to-all (one collective instead of three). The gathered sequence is
the ranks' shards in rank order, so the padding rows (layout.py) are its last rows: the keys
and values are cut to the real rows before attention, which is then exactly the attention over
the real sequence, with any backend (no mask needed). Needs heads divisible by the group size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .comm_stats import CommStats
from .layout import SequenceLayout


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                      group, attend: Callable, stats: CommStats) -> torch.Tensor:
    """q, k, v: this rank's rows [B, n, H, D]; returns its rows of the attention output."""
    world = layout.world
    b, n, heads, d = q.shape
    share = heads // world
    # [3, B, n, world, H/world, D] -> [world (destination), 3, B, n, H/world, D]
    sent = torch.stack((q, k, v)).view(3, b, n, world, share, d).permute(3, 0, 1, 2, 4, 5)
    sent = sent.contiguous()
    received = torch.empty_like(sent)
    with stats.timed("all_to_all", _bytes(sent) * (world - 1) // world):
        dist.all_to_all_single(received, sent, group=group)
    del sent
    # [world (source), 3, B, n, share, D] -> [3, B, world * n, share, D]
    whole = received.permute(1, 2, 0, 3, 4, 5).reshape(3, b, world * n, share, d)
    del received
    real = layout.length
    out = attend(whole[0], whole[1, :, :real], whole[2, :, :real])
    del whole
    # [B, world * n, share, D] -> [world (destination), B, n, share, D]
    back = out.reshape(b, world, n, share, d).permute(1, 0, 2, 3, 4).contiguous()
    del out
    returned = torch.empty_like(back)
    with stats.timed("all_to_all", _bytes(back) * (world - 1) // world):
        dist.all_to_all_single(returned, back, group=group)
    # [world (head share), B, n, share, D] -> [B, n, H, D]
    return returned.permute(1, 2, 0, 3, 4).reshape(b, n, heads, d)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
