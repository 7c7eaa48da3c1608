"""Opt-in sharding of a DiT's transformer blocks over the worker group (the `fsdp` setting):
between forwards a rank holds 1/world of every block, and a block is whole only while it
computes.

Each block's tensors (its parameters and buffers, whatever their dtypes: bf16 or fp8 matrices,
float32 norms, scales) are packed into one flat byte buffer (offload/packed_blocks.py), padded
to a multiple of world x ALIGNMENT bytes and cut into world equal chunks; a rank keeps its chunk
of every block in one device buffer (ShardStore). A block's fill writes the whole packed block
into a slot of a ring of device buffers (offload/block_ring.py), on a side stream while the
previous block computes, and its tensors are views into the slot while it computes. What the
fill writes is the packed block itself, so nothing is copied out afterwards (FSDP2 gathers
per-parameter shards and copies them out into each parameter), and the compiled blocks run on it
as they do under block swap.

How a fill gets the other ranks' chunks:
- on GPUs, copies from the peers' stores, mapped into this process by PyTorch's symmetric
  memory: the copy engines move the bytes over NVLink and no kernel runs beside the block that
  computes (the chunks never change once stored, so the copies need no handshake);
- otherwise (the CPU, or a GPU setup without symmetric memory: said once on stderr) one
  all-gather of the chunks over the group.
WAN_ENHANCED_FSDP_ALL_GATHER=1 forces the all-gather on GPUs too (for comparison).

Between uses a block's tensors hold empty placeholders: reading a sharded block outside a
forward fails loudly instead of reading another block's bytes. The embeddings, the time
projection and the head stay whole on every rank (about 2% of a model).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Sequence

import torch
import torch.nn as nn

from ..offload.block_ring import BlockRing, RingBlock
from ..offload.packed_blocks import ALIGNMENT, BlockLayout, block_tensors

SLOTS = 2  # the block computing and the next one being gathered
FORCE_ALL_GATHER = "WAN_ENHANCED_FSDP_ALL_GATHER"


def padded_size(layout: BlockLayout, world: int) -> int:
    """A packed block's bytes, padded so that `world` chunks are equal and aligned."""
    unit = world * ALIGNMENT
    return -(-layout.total // unit) * unit


class ShardStore:
    """This rank's chunk of every block, end to end in one device buffer, and the way fills get
    the other ranks' chunks. Collective: every rank of `group` creates it with the same
    layouts."""

    def __init__(self, layouts: Sequence[BlockLayout], device: torch.device | str,
                 rank: int, world: int, group=None):
        if not 0 <= rank < world:
            raise ValueError(f"fsdp: rank {rank} outside a group of {world}")
        self.device = torch.device(device)
        self.rank, self.world, self.group = rank, world, group
        self.layouts = list(layouts)
        self.padded = [padded_size(layout, world) for layout in self.layouts]
        self.offsets, end = [], 0
        for padded in self.padded:
            self.offsets.append(end)
            end += padded // world
        self.peers: list[torch.Tensor] | None = None  # every rank's buffer, mapped here
        self.buffer = self._allocate(end)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        forced = os.environ.get(FORCE_ALL_GATHER) == "1"
        if self.device.type != "cuda" or self.world == 1 or forced:
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        buffer, problem = _symmetric_buffer(nbytes, self.device)
        # every rank takes the same path, or the fills would not pair up
        if not _everyone(problem is None, self.device, self.group):
            print(f"fsdp: {problem or 'another GPU of the group has no symmetric memory'}; the "
                  f"blocks are gathered with NCCL all-gathers", file=sys.stderr)
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.peers = _mapped_peers(buffer, self.world, self.group)
        return buffer.zero_()

    @property
    def peer_copies(self) -> bool:
        return self.peers is not None

    def chunk(self, index: int) -> torch.Tensor:
        """This rank's chunk of block `index`."""
        size = self.padded[index] // self.world
        return self.buffer[self.offsets[index]:self.offsets[index] + size]

    def put(self, index: int, block: nn.Module) -> list[torch.Tensor]:
        """Keep this rank's chunk of `block` (its tensors on any device) and turn its tensors into
        empty placeholders, which are returned."""
        self.keep(index, pack_chunk(block, index, self.layouts[index], self.rank, self.world))
        return to_placeholders(block, self.device)

    def keep(self, index: int, chunk: torch.Tensor) -> None:
        """This rank's chunk of block `index` (pack_chunk's, from any device) into the store."""
        self.chunk(index).copy_(chunk)

    def sealed(self) -> "ShardStore":
        """Every rank's chunks stored before any rank reads a peer's (a barrier)."""
        self._everyone_here()
        return self

    def release(self) -> None:
        """Let the chunks go once no rank can still be copying from them (with peer copies a
        barrier: the other ranks' last fills read this rank's store). Collective, as creating
        the store was."""
        if self.peers is not None:
            self._everyone_here()
        self.peers = None
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def _everyone_here(self) -> None:
        """This rank's queued GPU work done, then a barrier of the group."""
        if self.world > 1:
            import torch.distributed as dist

            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)

    def fill(self, target: torch.Tensor, index: int) -> None:
        """The whole packed block `index` into `target` (uint8 [padded]), queued on the current
        stream."""
        size = self.padded[index] // self.world
        if self.peers is None:
            import torch.distributed as dist

            # the same collective; newer PyTorch renamed it and deprecates the old name
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(target, self.chunk(index), group=self.group)
            return
        begin = self.offsets[index]
        for step in range(self.world):  # each rank starts from another peer
            source = (self.rank + step) % self.world
            target[source * size:(source + 1) * size].copy_(
                self.peers[source][begin:begin + size], non_blocking=True)

    def nbytes(self) -> int:
        return self.buffer.numel()


def pack_chunk(block: nn.Module, index: int, layout: BlockLayout, rank: int,
               world: int) -> torch.Tensor:
    """Chunk `rank` of `world` of block `index`'s packed bytes, on the device its tensors are
    on. The whole packed block exists once, briefly, beside the block."""
    tensors = block_tensors(block)
    if BlockLayout.of(tensors) != layout:
        raise ValueError(f"fsdp: block {index} is not laid out as the store expects")
    padded = padded_size(layout, world)
    packed = torch.zeros(padded, dtype=torch.uint8,
                         device=tensors[0].device if tensors else "cpu")
    layout.pack(tensors, packed)
    size = padded // world
    return packed[rank * size:(rank + 1) * size].clone()


def to_placeholders(block: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """The block's tensors become empty placeholders on `device` (their dtypes kept), which are
    returned: its weights are let go."""
    tensors = block_tensors(block)
    placeholders = [torch.empty(0, dtype=t.dtype, device=device) for t in tensors]
    for tensor, placeholder in zip(tensors, placeholders):
        tensor.data = placeholder
    return placeholders


def _symmetric_buffer(nbytes: int, device: torch.device):
    """(a uint8 buffer of `nbytes` in symmetric memory, None) or (None, why there is none)."""
    try:
        import torch.distributed._symmetric_memory as symm

        return symm.empty(nbytes, dtype=torch.uint8, device=device), None
    except Exception as exc:  # noqa: BLE001 - any failure falls back, said once
        return None, f"no symmetric memory here ({type(exc).__name__}: {exc})"


def _everyone(ok: bool, device: torch.device, group) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _mapped_peers(buffer: torch.Tensor, world: int, group) -> list[torch.Tensor]:
    """Every rank's symmetric buffer (this rank's own included), mapped into this process."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm

    group = group or dist.group.WORLD
    if hasattr(symm, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op after
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group.group_name)
    handle = symm.rendezvous(buffer, group)
    return [buffer if r == handle.rank else handle.get_buffer(r, (buffer.numel(),), torch.uint8)
            for r in range(world)]


class ShardedBlocks(BlockRing):
    """All of a model's blocks, their chunks in `store`, filled through SLOTS device buffers.
    Every rank of the store's group builds it and runs its blocks() in step."""

    name = "fsdp"

    def __init__(self, blocks: Sequence[nn.Module], store: ShardStore,
                 placeholders: list[list[torch.Tensor]], slots: int = SLOTS):
        self.store = store
        blocks = list(blocks)
        entries = [RingBlock(block_tensors(b), idle, layout, padded)
                   for b, idle, layout, padded in zip(blocks, placeholders, store.layouts,
                                                       store.padded)]
        super().__init__(blocks, range(len(entries)), entries, store.device, slots)

    def _transfer(self, target: torch.Tensor, position: int) -> None:
        self.store.fill(target, position)

    def close(self) -> None:
        """The ring closed (every fill done), then the store released (collective)."""
        super().close()
        self.store.release()

    def shard_bytes(self) -> int:
        """The bytes of this rank's chunks."""
        return self.store.nbytes()
