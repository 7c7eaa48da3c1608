"""Per-rank metrics of one request, gathered to rank 0: what the memory event log records for
each rank (profiling/events.py) and the reports show.

    rank, device
    request_total_seconds   the request on this rank, from receiving it to its result
    forwards, forward_seconds, compute_seconds   model forwards; compute = forwards less the
                            communication inside them
    all_to_all_*, ring_*, gather_*, cfg_*        seconds, bytes and calls (comm_stats.py)
    reserved_peak_bytes, allocated_peak_bytes    the torch allocator's peaks (GPU; None on CPU)
    rss_peak_bytes          the process's peak resident memory
    weight_bytes            the model weights this rank holds (its shards, with fsdp)
    fsdp_fill               with fsdp, how a block's chunks come together: "peer copies" or
                            "all-gathers" (None without fsdp)
    outside_allocator_bytes device memory held outside the torch allocator (with fsdp on GPUs:
                            the store of this rank's chunks, in symmetric memory), not in the
                            allocator's peaks
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from .comm_stats import CommStats


class RankMeter:

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, torch.device(device)
        self.stats = CommStats(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.began = time.perf_counter()
        self.weight_bytes = 0
        self.outside_allocator_bytes = 0
        self.fsdp_fill: str | None = None

    def held(self, models) -> None:
        """What this rank's models (models.RankModel) hold: their weights, the device memory
        outside the allocator, how fsdp fills their blocks."""
        self.weight_bytes = sum(m.weight_bytes() for m in models)
        self.outside_allocator_bytes = sum(m.outside_allocator_bytes() for m in models)
        self.fsdp_fill = models[0].fsdp_fill() if models else None

    def finish(self) -> dict:
        summary = self.stats.summary()  # synchronizes the GPU first
        cuda = self.device.type == "cuda"
        return {"rank": self.rank, "device": str(self.device),
                "request_total_seconds": round(time.perf_counter() - self.began, 6),
                **summary,
                "reserved_peak_bytes": torch.cuda.max_memory_reserved(self.device) if cuda
                else None,
                "allocated_peak_bytes": torch.cuda.max_memory_allocated(self.device) if cuda
                else None,
                "rss_peak_bytes": peak_rss_bytes(), "weight_bytes": self.weight_bytes,
                "outside_allocator_bytes": self.outside_allocator_bytes,
                "fsdp_fill": self.fsdp_fill}


def peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # Windows: the current RSS is what there is
        import psutil
        return int(psutil.Process().memory_info().rss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def gather_metrics(metrics: dict, group=None) -> list[dict]:
    """Every rank's metrics, in rank order (on every rank)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics, group=group)
    return gathered
