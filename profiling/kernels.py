"""Device kernels of a torch.profiler profile, summed by name: what each rank of a benchmark
reports when asked to profile (distributed/tasks.py) and what bench tables are made of."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KernelTotal:
    name: str
    ms: float  # summed device time of every call
    calls: int

    def to_dict(self) -> dict:
        return asdict(self)


def kernel_totals(prof, device_type: str = "cuda") -> list[KernelTotal]:
    """Every name with time in the profile, the longest first: device kernels (and copies) of a
    profile of CUDA activity; on a CPU, operators by their own time (children excluded)."""
    def ms(e) -> float:
        return (e.device_time_total if device_type == "cuda" else e.self_cpu_time_total) / 1000

    rows = [KernelTotal(e.key, ms(e), int(e.count)) for e in prof.key_averages() if ms(e) > 0]
    return sorted(rows, key=lambda r: r.ms, reverse=True)


def profiled(fn, device_type: str):
    """(fn's result, its kernel totals): one call of fn under torch.profiler, recording the
    device's activity (the CPU's on a CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device_type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        result = fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    return result, kernel_totals(prof, device_type)
