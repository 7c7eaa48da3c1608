"""Block swap: some transformer blocks stay in (pinned) CPU memory and stream through a fixed
ring of device buffers while the model runs.

The device holds `slots` flat buffers, each the size of one block, allocated once per run. A
side stream copies the next swapped block into a free slot while the current block computes;
the compute stream waits on an event for the copy, and the copy stream waits on an event for the
compute that last read the slot before overwriting it. No allocation happens per block, so the
allocator does not churn and memory stays flat from step to step.

The swapped blocks run in the same cyclic order in every forward (the model's block order), so
after a block has run, its slot is refilled with the block `slots` places further on in that
cycle — for the last blocks of a forward that is the first blocks of the next one, which then
arrive while the resident blocks and the head compute.

While a swapped block computes, its parameters' `.data` are views into its slot; afterwards they
are its CPU masters again. The engine is used for one sampling run and closed (`with`), which
releases the slots and leaves every block as it found it (on the CPU, packed).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn as nn

from .packed_blocks import PackedBlock, pack_block


class BlockSwap:
    """Streams `blocks[i]` for each i in `swapped` through `slots` device buffers.

    `blocks` are all of the model's blocks in forward order; the others are expected to be
    resident on `device` already (placed by the caller). Use `blocks()` as the model's block
    sequence, once per forward.
    """

    def __init__(self, blocks: Sequence[nn.Module], swapped: Sequence[int],
                 device: torch.device | str, slots: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.all_blocks = list(blocks)
        self.swapped = sorted(set(swapped))
        if any(not 0 <= i < len(self.all_blocks) for i in self.swapped):
            raise ValueError(f"block swap: block indices {self.swapped} outside "
                             f"0..{len(self.all_blocks) - 1}")
        if slots < 1:
            raise ValueError(f"block swap: at least one device slot is needed, got {slots}")
        self._position = {index: p for p, index in enumerate(self.swapped)}
        self.packs: list[PackedBlock] = [pack_block(self.all_blocks[i], pinned=self.cuda)
                                         for i in self.swapped]
        count = min(slots, len(self.packs))
        slot_bytes = max((p.layout.total for p in self.packs), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(count)]
        self._holds: list[int | None] = [None] * count  # the position each slot holds
        self._slot_of: dict[int, int] = {}  # position -> slot, for copied or copying blocks
        self._ready: list[torch.cuda.Event | None] = [None] * count
        self._free: list[torch.cuda.Event | None] = [None] * count
        self._bound: int | None = None  # the position whose tensors are slot views now
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        for position in range(count):
            self._fill(position, position)

    # -- the ring -----------------------------------------------------------------------------

    def _fill(self, slot: int, position: int) -> None:
        """Copy the block at `position` into `slot` (asynchronously on a GPU)."""
        previous = self._holds[slot]
        if previous == position:
            return  # already there: fewer swapped blocks than slots
        if previous is not None:
            self._slot_of.pop(previous, None)
        pack = self.packs[position]
        target = self.slots[slot][:pack.layout.total]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if self._free[slot] is not None:
                    self.copy_stream.wait_event(self._free[slot])
                target.copy_(pack.buffer, non_blocking=True)
                self._ready[slot] = self.copy_stream.record_event()
        else:
            target.copy_(pack.buffer)
        self._holds[slot] = position
        self._slot_of[position] = slot

    def _bind(self, position: int, slot: int) -> None:
        pack = self.packs[position]
        for tensor, view in zip(pack.tensors, pack.layout.views(self.slots[slot], pack.tensors)):
            tensor.data = view
        self._bound = position

    def _unbind(self) -> None:
        if self._bound is None:
            return
        pack = self.packs[self._bound]
        for tensor, master in zip(pack.tensors, pack.masters):
            tensor.data = master
        self._bound = None

    # -- use ------------------------------------------------------------------------------------

    def blocks(self) -> Iterator[nn.Module]:
        """The model's blocks in order, each swapped one resident in a slot while it is used."""
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
            self._fill(slot, (position + len(self.slots)) % len(self.packs))

    def device_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def close(self) -> None:
        """Blocks back on their CPU masters; the slots released once no copy is in flight."""
        self._unbind()
        if self.cuda and self.copy_stream is not None:
            self.copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self.slots.clear()
        self._holds.clear()
        self._slot_of.clear()
        self._ready.clear()
        self._free.clear()

    def __enter__(self) -> "BlockSwap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
