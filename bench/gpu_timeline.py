"""Where a GPU stood idle during a profiled call: the time from the call to the end of its last
kernel against the time some kernel, copy or fill was running, and the longest idle gaps, each
with the kernels on either side, how late the host launched the kernel after it and the host
synchronizations that fell into it.

A gap the host launched late is host-bound (Python, guards, launch overhead); a gap with a
synchronization in it is the host waiting for the GPU and then catching up.
"""

from __future__ import annotations

from dataclasses import dataclass

# gaps shorter than this are the GPU's own launch latency between back-to-back kernels
MIN_GAP_NS = 20_000
SYNC_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpy")  # host calls that wait for the GPU


@dataclass(frozen=True)
class DeviceSpan:
    start_ns: int
    end_ns: int
    name: str
    launched_ns: int | None = None  # when the host call that launched it began


@dataclass(frozen=True)
class Gap:
    ms: float
    before: str
    after: str
    launch_delay_ms: float | None  # the launch call of `after`, counted from the gap's start
    syncs: tuple[str, ...]


@dataclass(frozen=True)
class Idle:
    wall_ms: float  # from the call to the end of its last device span
    busy_ms: float  # the union of the device spans
    before_first_ms: float  # from the call to its first device span
    gaps: tuple[Gap, ...]  # the longest idle gaps between spans, longest first
    gap_count: int  # gaps of MIN_GAP_NS or more

    @property
    def idle_ms(self) -> float:
        return self.wall_ms - self.busy_ms


def idle_of(call_start_ns: int, spans: list[DeviceSpan],
            host_calls: list[tuple[int, int, str]] = (), top: int = 6) -> Idle:
    """The idle time of the device spans of one call that began on the host at call_start_ns.
    host_calls: (start, end, name) of host runtime calls, for the synchronizations in a gap."""
    if not spans:
        raise ValueError("no device activity in the profile")
    spans = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))
    busy = 0
    gaps = []
    end, last = spans[0].start_ns, spans[0]
    for span in spans:
        if span.start_ns > end:
            if span.start_ns - end >= MIN_GAP_NS:
                gaps.append((end, span.start_ns, last, span))
        if span.start_ns < end:  # overlaps what ran before (another stream)
            busy += max(0, span.end_ns - end)
        else:
            busy += span.end_ns - span.start_ns
        if span.end_ns >= end:
            end, last = span.end_ns, span
    gaps.sort(key=lambda g: g[1] - g[0], reverse=True)
    described = []
    for gap_start, gap_end, before, after in gaps[:top]:
        delay = (None if after.launched_ns is None
                 else max(0.0, (after.launched_ns - gap_start) / 1e6))
        syncs = tuple(sorted({name for s, e, name in host_calls
                              if s < gap_end and e > gap_start
                              and any(c in name for c in SYNC_CALLS)}))
        described.append(Gap((gap_end - gap_start) / 1e6, before.name, after.name, delay, syncs))
    return Idle(wall_ms=(end - call_start_ns) / 1e6, busy_ms=busy / 1e6,
                before_first_ms=max(0, spans[0].start_ns - call_start_ns) / 1e6,
                gaps=tuple(described), gap_count=len(gaps))


def idle_of_profile(prof, marker: str, top: int = 6) -> Idle:
    """idle_of for a torch.profiler profile (CPU and CUDA activities) of one call wrapped in
    record_function(marker)."""
    from torch.autograd import DeviceType
    events = list(prof.profiler.kineto_results.events())
    starts = [e.start_ns() for e in events if e.name() == marker]
    if not starts:
        raise ValueError(f"no host event named {marker!r} in the profile")
    runtime = [e for e in events  # the host's CUDA runtime and driver calls
               if e.device_type() == DeviceType.CPU and e.name().startswith(("cuda", "cu"))]
    launched = {e.correlation_id(): e.start_ns() for e in runtime}
    spans = [DeviceSpan(e.start_ns(), e.end_ns(), e.name(),
                        launched.get(e.linked_correlation_id(), launched.get(e.correlation_id())))
             for e in events if e.device_type() == DeviceType.CUDA]
    return idle_of(min(starts), spans, [(e.start_ns(), e.end_ns(), e.name()) for e in runtime],
                   top)


def describe(idle: Idle, name_width: int = 60) -> str:
    """Markdown: one summary line and a table of the longest gaps."""
    in_gaps = idle.idle_ms - idle.before_first_ms
    lines = [f"GPU busy {idle.busy_ms:.1f} of {idle.wall_ms:.1f} ms from the call (idle "
             f"{idle.idle_ms:.1f} ms: {idle.before_first_ms:.1f} before the first kernel, "
             f"{in_gaps:.1f} between kernels; {idle.gap_count} gaps of "
             f"{MIN_GAP_NS // 1000} us or more)"]
    if idle.gaps:
        lines.append("| gap ms | kernel before | kernel after | its launch, ms into the gap "
                     "| host syncs in the gap |\n|---:|---|---|---:|---|")
        for g in idle.gaps:
            delay = "?" if g.launch_delay_ms is None else f"{g.launch_delay_ms:.3f}"
            lines.append(f"| {g.ms:.3f} | `{g.before[:name_width]}` | `{g.after[:name_width]}` | "
                         f"{delay} | {', '.join(g.syncs) or '-'} |")
    return "\n".join(lines)
