"""A fixed ring of device buffers that transformer blocks pass through while the model runs.

The device holds `slots` flat buffers, each the size of one block's packed bytes, allocated once.
A side stream fills the next block's slot while the current block computes; the compute stream
waits on an event for the fill, and the side stream waits on an event for the compute that last
read the slot before overwriting it. No allocation happens per block, so the allocator does not
churn and memory stays flat from step to step.

The ring's blocks run in the same cyclic order in every forward (the model's block order), so
after a block has run, its slot is refilled with the block `slots` places further on in that
cycle — for the last blocks of a forward that is the first blocks of the next one.

While a ring block computes, its tensors' `.data` are views into its slot; afterwards they are
its idle data again. Where a fill comes from is the subclass's concern: pinned CPU memory (block
swap, offload/block_swap.py) or the shards of the other ranks (distributed/sharded_blocks.py).
The ring is used for one run and closed (`with`), which releases the slots and leaves every
block on its idle data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn as nn

from .packed_blocks import BlockLayout


@dataclass
class RingBlock:
    """What the ring needs of one block: its tensors (the module's own objects), their data
    between uses, where each sits in the packed bytes, and how many bytes a fill writes."""
    tensors: list[torch.Tensor]
    idle: list[torch.Tensor]
    layout: BlockLayout
    fill_bytes: int


class BlockRing:
    """Streams `blocks[i]` for each i in `ring` through `slots` device buffers; the other blocks
    are expected to be resident on `device` already. Use `blocks()` as the model's block
    sequence, once per forward."""

    name = "block ring"  # what errors call the subclass

    def __init__(self, blocks: Sequence[nn.Module], ring: Sequence[int], entries: list[RingBlock],
                 device: torch.device | str, slots: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.all_blocks = list(blocks)
        self.ring = self.indices(len(self.all_blocks), ring)
        if slots < 1:
            raise ValueError(f"{self.name}: at least one device slot is needed, got {slots}")
        if len(entries) != len(self.ring):
            raise ValueError(f"{self.name}: {len(entries)} packed blocks for {len(self.ring)} "
                             f"ring positions")
        self.entries = entries
        self._position = {index: p for p, index in enumerate(self.ring)}
        count = min(slots, len(entries))
        slot_bytes = max((e.fill_bytes for e in entries), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(count)]
        self._holds: list[int | None] = [None] * count  # the position each slot holds
        self._slot_of: dict[int, int] = {}  # position -> slot, for filled or filling blocks
        self._ready: list[torch.cuda.Event | None] = [None] * count
        self._free: list[torch.cuda.Event | None] = [None] * count
        self._bound: int | None = None  # the position whose tensors are slot views now
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda else None
        for position in range(count):
            self._fill(position, position)

    @classmethod
    def indices(cls, count: int, ring: Sequence[int]) -> list[int]:
        """`ring` sorted, each once, checked against a model of `count` blocks."""
        indices = sorted(set(ring))
        if any(not 0 <= i < count for i in indices):
            raise ValueError(f"{cls.name}: block indices {indices} outside 0..{count - 1}")
        return indices

    def _transfer(self, target: torch.Tensor, position: int) -> None:
        """Write the packed bytes of the block at `position` into `target` (uint8, its
        fill_bytes), queued on the current stream."""
        raise NotImplementedError

    # -- the ring -----------------------------------------------------------------------------

    def _fill(self, slot: int, position: int) -> None:
        """Fill `slot` with the block at `position` (asynchronously on a GPU)."""
        previous = self._holds[slot]
        if previous == position:
            return  # already there: fewer ring blocks than slots
        if previous is not None:
            self._slot_of.pop(previous, None)
        target = self.slots[slot][:self.entries[position].fill_bytes]
        if self.cuda:
            with torch.cuda.stream(self.side_stream):
                if self._free[slot] is not None:
                    self.side_stream.wait_event(self._free[slot])
                self._transfer(target, position)
                self._ready[slot] = self.side_stream.record_event()
        else:
            self._transfer(target, position)
        self._holds[slot] = position
        self._slot_of[position] = slot

    def _bind(self, position: int, slot: int) -> None:
        entry = self.entries[position]
        for tensor, view in zip(entry.tensors, entry.layout.views(self.slots[slot])):
            tensor.data = view
        self._bound = position

    def _unbind(self) -> None:
        if self._bound is None:
            return
        entry = self.entries[self._bound]
        for tensor, idle in zip(entry.tensors, entry.idle):
            tensor.data = idle
        self._bound = None

    # -- use ------------------------------------------------------------------------------------

    def blocks(self) -> Iterator[nn.Module]:
        """The model's blocks in order, each ring block resident in a slot while it is used."""
        for index, block in enumerate(self.all_blocks):
            position = self._position.get(index)
            if position is None:
                yield block
                continue
            slot = self._slot_of.get(position)
            if slot is None:  # not in flight (a forward that stopped half way): fetch it now
                slot = self._holds.index(None) if None in self._holds else 0
                self._fill(slot, position)
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
            self._bind(position, slot)
            try:
                yield block
            finally:
                self._unbind()
            if not self.slots:
                return  # closed while this forward was suspended (it failed half way)
            # the block's kernels are queued: the slot may be refilled once they have run
            if self.cuda:
                self._free[slot] = torch.cuda.current_stream(self.device).record_event()
            self._fill(slot, (position + len(self.slots)) % len(self.entries))

    def device_bytes(self) -> int:
        """The slots' bytes."""
        return sum(s.numel() for s in self.slots)

    def close(self) -> None:
        """Blocks back on their idle data; the slots released once no fill is in flight."""
        self._unbind()
        if self.cuda and self.side_stream is not None:
            self.side_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self.slots.clear()
        self._holds.clear()
        self._slot_of.clear()
        self._ready.clear()
        self._free.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
