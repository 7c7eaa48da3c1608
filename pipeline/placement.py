"""Putting a model on the compute device for the duration of one node, and taking it off again.

The CPU copy of the weights is the master: placing a module swaps each parameter's data for a
device copy, and releasing swaps the CPU master back and drops the device copy. Nothing is copied
back from the device, CPU memory stays as it was, and the device holds the weights only while
the node computes. Before placing, the host is asked to make room (ComfyUI evicts its own models).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import host


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


class DevicePlacement:
    """Modules placed on one device; `release` (or leaving the `with` block) takes them all off.

    Used for one module (a text encoder, a VAE) or for the two Wan2.2 A14B experts, of which
    `place(..., exclusive=True)` keeps only one on the device at a time.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._masters: dict[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __enter__(self) -> "DevicePlacement":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def place(self, module: torch.nn.Module, exclusive: bool = False,
              skip: Sequence[torch.nn.Module] = ()) -> torch.nn.Module:
        """Put `module` on the device, except the submodules in `skip` (block swap streams
        those itself)."""
        if module in self._masters:
            return module
        if exclusive:
            self.release()
        skipped = {id(t) for m in skip for t in [*m.parameters(), *m.buffers()]}
        tensors = [t for t in [*module.parameters(), *module.buffers()] if id(t) not in skipped]
        first = next(iter(tensors), None)
        if self.device.type == "cpu" or (first is not None and first.device == self.device):
            self._masters[module] = []  # already there (kept resident by its loader)
            return module
        host.make_room(sum(t.numel() * t.element_size() for t in tensors), self.device)
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._masters[module] = swapped
        for tensor in tensors:
            swapped.append((tensor, tensor.data))
            tensor.data = tensor.data.to(self.device, non_blocking=True)
        return module

    def release(self, module: torch.nn.Module | None = None, empty_cache: bool = True) -> None:
        modules = list(self._masters) if module is None else [module]
        for m in modules:
            for tensor, master in self._masters.pop(m, []):
                tensor.data = master
        if modules and empty_cache and self.device.type == "cuda":
            host.release_cached_memory()

    def stream(self, modules):
        """Yield each module placed on the device, taking it off again before the next one: the
        device holds one module at a time (the allocator reuses its memory for the next)."""
        for module in modules:
            self.place(module)
            try:
                yield module
            finally:
                self.release(module, empty_cache=False)
