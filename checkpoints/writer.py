"""Writing a safetensors file tensor by tensor.

Every key, dtype and shape is known before any tensor is made (a model rewritten in its own
layout), so the header is written first and each tensor goes to its place as soon as it exists:
a whole model is never held in memory to save it (safetensors' own save_file takes a dict of
all tensors).
"""

from __future__ import annotations

import json
import math
from typing import BinaryIO

import torch

from .reader import _SAFETENSORS_DTYPES

DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


class SafetensorsWriter:
    """Writes `entries` [(key, dtype, shape), ...] to `file` in that order; `write` each key's
    tensor (in any order), then `finish`."""

    def __init__(self, file: BinaryIO, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.file = file
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for key, dtype, shape in entries:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{key}: dtype {dtype} cannot be stored in safetensors")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + size]}
            self.layout[key] = (dtype, tuple(shape), offset, size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        file.truncate(self.data_start + offset)
        self.written: set[str] = set()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        dtype, shape, offset, size = self.layout[key]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{key}: {tensor.dtype} {list(tensor.shape)} given for the "
                             f"{dtype} {list(shape)} of the header")
        self.file.seek(self.data_start + offset)
        if size:
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self.file.write(memoryview(data.numpy()))
        self.written.add(key)

    def finish(self) -> None:
        missing = [k for k in self.layout if k not in self.written]
        if missing:
            raise ValueError(f"{len(missing)} tensors never written: {', '.join(missing[:4])}")
        self.file.flush()
