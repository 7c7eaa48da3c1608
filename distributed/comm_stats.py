"""Per-rank communication and compute counters of a sequence-parallel request.

Each collective the attention runs is timed and its bytes counted: "all_to_all" (Ulysses: q, k
and v out, the attention output back), "ring" (ring attention: keys and values passed to the
next rank), "gather" (the model output gathered once per forward) and "cfg" (the velocities
exchanged between the two halves of a CFG-parallel group). On a GPU the collectives run
asynchronously to the host, so they are timed with CUDA events on the current stream and read
once at the end of the request (`summary`, which synchronizes); on the CPU with the wall clock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

KINDS = ("all_to_all", "ring", "gather", "cfg")
INSIDE_FORWARD = ("all_to_all", "ring", "gather")


class CommStats:

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = {kind: 0 for kind in KINDS}
        self.calls = {kind: 0 for kind in KINDS}
        self._seconds = {kind: 0.0 for kind in KINDS}
        self._events: list[tuple[str, object, object]] = []
        self._forward_seconds = 0.0
        self._forward_events: list[tuple[object, object]] = []
        self.forwards = 0

    @contextmanager
    def timed(self, kind: str, nbytes: int):
        """Time the collective(s) run inside the block and count `nbytes` moved by this rank."""
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        if self.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
        else:
            began = time.perf_counter()
            yield
            self._seconds[kind] += time.perf_counter() - began

    @contextmanager
    def forward(self):
        """Time one model forward (the communication inside it included)."""
        self.forwards += 1
        if self.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._forward_events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._forward_seconds += time.perf_counter() - began

    def _resolve(self) -> None:
        if self._events or self._forward_events:
            torch.cuda.synchronize(self.device)
        for kind, start, end in self._events:
            self._seconds[kind] += start.elapsed_time(end) / 1000
        for start, end in self._forward_events:
            self._forward_seconds += start.elapsed_time(end) / 1000
        self._events, self._forward_events = [], []

    def summary(self) -> dict:
        """Seconds and bytes per kind, forward time and compute time (forward time less the
        communication inside it: all_to_all, ring, gather), for the metrics of one request."""
        self._resolve()
        comm = sum(self._seconds[kind] for kind in INSIDE_FORWARD)
        out = {"forwards": self.forwards,
               "forward_seconds": round(self._forward_seconds, 6),
               "compute_seconds": round(max(0.0, self._forward_seconds - comm), 6)}
        for kind in KINDS:
            out[f"{kind}_seconds"] = round(self._seconds[kind], 6)
            out[f"{kind}_bytes"] = self.bytes[kind]
            out[f"{kind}_calls"] = self.calls[kind]
        return out
