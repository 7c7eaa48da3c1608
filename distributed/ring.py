"""Ring self-attention: every rank keeps its queries; the key/value shards travel around the
ring (rank r sends to r+1 and receives from r-1), and each rank merges the attention over each
shard it holds with the running result by log-sum-exp (online softmax). The next shard's
transfer runs while the current one is attended. Works for any head count.

Padding rows (layout.py) are cut from a shard's keys and values before its attention; a shard of
padding only is skipped. Shard 0 always holds real rows, so every query has keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_stats import CommStats
from .layout import SequenceLayout
from .lse_attention import attention_with_lse, merge


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                   group, stats: CommStats) -> torch.Tensor:
    """q, k, v: this rank's rows [B, n, H, D]; returns its rows of the attention output."""
    world, rank = layout.world, layout.rank
    peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    send_to, receive_from = peers[(rank + 1) % world], peers[(rank - 1) % world]
    held = torch.stack((k, v))
    out = lse = None
    for step in range(world):
        owner = (rank - step) % world
        pending, incoming = None, None
        if step < world - 1:
            incoming = torch.empty_like(held)
            ops = [dist.P2POp(dist.isend, held, send_to, group),
                   dist.P2POp(dist.irecv, incoming, receive_from, group)]
            pending = dist.batch_isend_irecv(ops)
        rows = layout.valid_rows(owner)
        if rows > 0:
            part, part_lse = attention_with_lse(q, held[0, :, :rows], held[1, :, :rows])
            out, lse = merge(out, lse, part, part_lse)
        if pending is not None:
            # the time counted is what the transfer adds beyond this step's attention
            with stats.timed("ring", held.numel() * held.element_size()):
                for request in pending:
                    request.wait()
            held = incoming
    return out.to(q.dtype)
