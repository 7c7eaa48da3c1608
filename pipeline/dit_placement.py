"""Placing a Wan DiT on the compute device for a sampling run, whole or with block swap.

With `block_swap` = N, the model's first N transformer blocks stay in pinned CPU memory and
stream through a ring of `prefetch_blocks + 1` device buffers (offload/block_swap.py); the rest
of the model is placed as usual. The first blocks are the swapped ones so that the copies for
the next forward overlap the resident blocks and the head at the end of this one.

For the Wan2.2 A14B pair only one expert is on the device at a time: placing one takes the
other off, engine included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from .. import host
from ..lora.apply import bring_to
from ..offload.block_swap import BlockSwap
from ..offload.packed_blocks import bytes_to_pin
from .handles import WanModelHandle
from .placement import DevicePlacement, tensor_bytes
from .work_device import merge_work_device


class DiTPlacement:

    def __init__(self, placement: DevicePlacement, block_swap: int = 0, prefetch_blocks: int = 1):
        if block_swap < 0:
            raise ValueError(f"block_swap: {block_swap} is negative; 0 keeps every block on "
                             f"the device")
        if prefetch_blocks < 1:
            raise ValueError(f"prefetch_blocks: {prefetch_blocks}; at least 1 block is copied "
                             f"ahead")
        self.placement = placement
        self.block_swap = block_swap
        self.slots = prefetch_blocks + 1
        self.handle: WanModelHandle | None = None
        self.engine: BlockSwap | None = None

    def place(self, handle: WanModelHandle) -> None:
        """`handle`'s model on the device (the previous one, if any, taken off)."""
        if handle is self.handle:
            return
        self.take_off()
        # the handle's LoRAs, while every tensor is where it waits between runs
        bring_to(handle.model, Path(handle.info.path), handle.quantization, handle.loras,
                 merge_work_device())
        blocks = list(handle.model.blocks)
        on_cpu = all(t.device.type == "cpu" for t in blocks[0].parameters()) if blocks else False
        count = min(self.block_swap, len(blocks)) if on_cpu else 0
        swapped = blocks[:count]
        self.placement.place(handle.model, exclusive=True, skip=swapped)
        if count:
            # (on a CPU run this streams host memory to host memory: no saving, same numbers)
            host.make_room(tensor_bytes(swapped[0]) * min(self.slots, count),
                           self.placement.device)
            if self.placement.device.type == "cuda":  # the swapped blocks are packed pinned
                host.make_room_for_pinned(bytes_to_pin(swapped))
            self.engine = BlockSwap(blocks, range(count), self.placement.device, self.slots)
        self.handle = handle

    def blocks(self, handle: WanModelHandle) -> Iterator[torch.nn.Module] | None:
        """The block sequence for one forward of `handle`'s model (None: its own blocks)."""
        if self.engine is None or handle is not self.handle:
            return None
        return self.engine.blocks()

    def take_off(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.handle is not None:
            self.placement.release(self.handle.model)
            self.handle = None

    def __enter__(self) -> "DiTPlacement":
        return self

    def __exit__(self, *exc) -> None:
        self.take_off()
