"""A transformer block's CPU weights packed into one flat (pinned) byte buffer.

Block swap copies a whole block to the GPU at once: one copy of one contiguous buffer instead of
a dozen small ones, and from page-locked memory, which is what lets the copy run asynchronously
on a side stream at full bus speed. Packing rewrites the block's master copy in place: each
tensor becomes a view into the buffer and the old (pageable or memory-mapped) storage is let go,
so host memory holds the weights once, as before. It happens the first time a block is swapped
and is recognised afterwards, so later runs allocate nothing.

Tensors keep their dtypes (bf16, float32 norms, fp8 or int8 weights with their scales): the
buffer is bytes and each tensor's slice starts at an aligned offset, so a quantized block swaps
as its quantized bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# Offsets are multiples of this: any dtype can view its slice, and compiled kernels get inputs
# as aligned as a fresh allocation would be.
ALIGNMENT = 256


def block_tensors(block: nn.Module) -> list[torch.Tensor]:
    """The block's parameters and buffers, each once, in a fixed order."""
    seen: set[int] = set()
    out = []
    for tensor in [*block.parameters(), *block.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class BlockLayout:
    """Where each tensor of a block lives in its flat buffer, with its dtype and shape."""
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[torch.Size, ...]
    total: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "BlockLayout":
        offsets, sizes, end = [], [], 0
        for tensor in tensors:
            offsets.append(end)
            sizes.append(tensor.numel() * tensor.element_size())
            end = _aligned(end + sizes[-1])
        return cls(tuple(offsets), tuple(sizes), tuple(t.dtype for t in tensors),
                   tuple(t.shape for t in tensors), max(end, ALIGNMENT))

    def pack(self, tensors: list[torch.Tensor], buffer: torch.Tensor) -> list[torch.Tensor]:
        """Copy `tensors` into their places in the uint8 `buffer`; their views are returned."""
        views = self.views(buffer)
        for tensor, view in zip(tensors, views):
            view.copy_(tensor.data)
        return views

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's slice of the uint8 `buffer`, with the tensor's dtype and shape."""
        return [buffer[offset:offset + size].view(dtype).view(shape)
                for offset, size, dtype, shape in zip(self.offsets, self.nbytes, self.dtypes,
                                                      self.shapes)]


@dataclass
class PackedBlock:
    """A block whose CPU tensors are views into `buffer`."""
    tensors: list[torch.Tensor]  # the block's parameters and buffers (the module's own objects)
    masters: list[torch.Tensor]  # their CPU data: views into buffer
    layout: BlockLayout
    buffer: torch.Tensor  # uint8 [layout.total], pinned when a GPU is used


def _existing_pack(tensors: list[torch.Tensor], layout: BlockLayout,
                   pinned: bool) -> torch.Tensor | None:
    """The buffer the tensors already live in, when an earlier pack put them there."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    for tensor, offset in zip(tensors, layout.offsets):
        if (tensor.device.type != "cpu" or tensor.untyped_storage().data_ptr() != base
                or tensor.data_ptr() - base != offset or not tensor.is_contiguous()):
            return None
    if storage.nbytes() < layout.total or (pinned and not tensors[0].is_pinned()):
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (layout.total,), (1,))


def bytes_to_pin(blocks: list[nn.Module]) -> int:
    """What packing `blocks` for a GPU would pin anew: the blocks not packed into pinned memory
    by an earlier pack."""
    total = 0
    for block in blocks:
        tensors = block_tensors(block)
        layout = BlockLayout.of(tensors)
        if _existing_pack(tensors, layout, pinned=True) is None:
            total += layout.total
    return total


def pack_block(block: nn.Module, pinned: bool) -> PackedBlock:
    """Pack `block`'s CPU tensors into one buffer (pinned when `pinned`), or find the pack an
    earlier call made. Every tensor must be on the CPU."""
    tensors = block_tensors(block)
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"block swap: a block tensor {list(tensor.shape)} is on "
                             f"{tensor.device}; swapped blocks must wait on the CPU")
    layout = BlockLayout.of(tensors)
    buffer = _existing_pack(tensors, layout, pinned)
    if buffer is None:
        buffer = torch.empty(layout.total, dtype=torch.uint8, pin_memory=pinned)
        for tensor, view in zip(tensors, layout.pack(tensors, buffer)):
            tensor.data = view  # the old storage is freed once nothing else holds it
    masters = [tensor.data for tensor in tensors]
    return PackedBlock(tensors, masters, layout, buffer)
