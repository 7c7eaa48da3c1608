"""Opt-in sharding of a DiT's transformer blocks over the worker group (the `fsdp` setting):
between forwards a rank holds 1/world of every block, and a block is whole only while it
computes.

Each block's tensors (its parameters and buffers, whatever their dtypes: bf16 or fp8 matrices,
float32 norms, scales) are packed into one flat byte buffer (offload/packed_blocks.py), padded
to a multiple of world x ALIGNMENT bytes and cut into world equal chunks; a rank keeps its chunk
on its device. A block's fill is one all-gather of those chunks into a slot of a ring of device
buffers (offload/block_ring.py), queued on a side stream while the previous block computes, and
its tensors are views into the slot while it computes. What the gather writes is the packed
block itself, so nothing is copied out afterwards (FSDP2 gathers per-parameter shards and copies
them out into each parameter: 14 ms per 14B forward on 4 GPUs), and the compiled blocks run on
it as they do under block swap.

Between uses a block's tensors hold empty placeholders: reading a sharded block outside a
forward fails loudly instead of reading another block's bytes. Every rank runs the blocks in the
same order, so their gathers pair up; the embeddings, the head and the norms outside the blocks
stay whole on every rank (a few percent of the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from ..offload.block_ring import BlockRing, RingBlock
from ..offload.packed_blocks import ALIGNMENT, BlockLayout, block_tensors

SLOTS = 2  # the block computing and the next one being gathered


@dataclass
class ShardedBlock:
    tensors: list[torch.Tensor]  # the block's parameters and buffers (the module's own objects)
    placeholders: list[torch.Tensor]  # their data between uses: empty, same dtype and device
    layout: BlockLayout
    padded: int  # the packed bytes padded to a multiple of world x ALIGNMENT
    shard: torch.Tensor  # uint8 [padded // world]: this rank's chunk, on the device


def shard_block(block: nn.Module, device: torch.device, rank: int, world: int) -> ShardedBlock:
    """Cut `block` (its tensors on any device) into `world` chunks and keep chunk `rank` on
    `device`; the block's tensors become empty placeholders. The whole packed block exists once,
    briefly, on the device its first tensor is on."""
    if not 0 <= rank < world:
        raise ValueError(f"fsdp: rank {rank} outside a group of {world}")
    tensors = block_tensors(block)
    layout = BlockLayout.of(tensors)
    unit = world * ALIGNMENT
    padded = -(-layout.total // unit) * unit
    chunk = padded // world
    home = tensors[0].device if tensors else device
    packed = torch.zeros(padded, dtype=torch.uint8, device=home)
    for tensor, view in zip(tensors, layout.views(packed)):
        view.copy_(tensor.data)
    shard = packed[rank * chunk:(rank + 1) * chunk].to(device, copy=True)
    del packed
    placeholders = [torch.empty(0, dtype=t.dtype, device=device) for t in tensors]
    for tensor, placeholder in zip(tensors, placeholders):
        tensor.data = placeholder
    return ShardedBlock(tensors, placeholders, layout, padded, shard)


class ShardedBlocks(BlockRing):
    """All of a model's blocks, sharded (shard_block), gathered through SLOTS device buffers.
    Collective: every rank of `group` builds it and runs its blocks() in step."""

    name = "fsdp"

    def __init__(self, blocks: Sequence[nn.Module], shards: list[ShardedBlock],
                 device: torch.device | str, group=None, slots: int = SLOTS):
        self.shards = shards
        self.group = group
        entries = [RingBlock(s.tensors, s.placeholders, s.layout, s.padded) for s in shards]
        super().__init__(blocks, range(len(shards)), entries, device, slots)

    def _transfer(self, target: torch.Tensor, position: int) -> None:
        import torch.distributed as dist

        # the same collective; newer PyTorch renamed it and deprecates the old name
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(target, self.shards[position].shard, group=self.group)

    def shard_bytes(self) -> int:
        """The bytes of this rank's chunks."""
        return sum(s.shard.numel() for s in self.shards)
