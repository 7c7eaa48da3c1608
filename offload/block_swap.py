"""Block swap: some transformer blocks stay in (pinned) CPU memory and stream through a fixed
ring of device buffers while the model runs (offload/block_ring.py: the slots, the side stream
and its events).

A swapped block's CPU tensors are packed into one flat (pinned) buffer (offload/packed_blocks.py),
so each fill is one copy of one contiguous buffer, asynchronous at full bus speed. The first
blocks are the swapped ones (pipeline/dit_placement.py), so that the copies for the next forward
overlap the resident blocks and the head at the end of this one. Between uses a swapped block's
tensors are its CPU masters again.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .block_ring import BlockRing, RingBlock
from .packed_blocks import PackedBlock, pack_block


class BlockSwap(BlockRing):
    """Streams `blocks[i]` for each i in `swapped` from CPU memory through `slots` device
    buffers."""

    name = "block swap"

    def __init__(self, blocks: Sequence[nn.Module], swapped: Sequence[int],
                 device: torch.device | str, slots: int = 2):
        device = torch.device(device)
        blocks = list(blocks)
        indices = self.indices(len(blocks), swapped)
        self.packs: list[PackedBlock] = [pack_block(blocks[i], pinned=device.type == "cuda")
                                         for i in indices]
        entries = [RingBlock(p.tensors, p.masters, p.layout, p.layout.total) for p in self.packs]
        super().__init__(blocks, indices, entries, device, slots)

    def _transfer(self, target: torch.Tensor, position: int) -> None:
        target.copy_(self.packs[position].buffer, non_blocking=self.cuda)
