"""The report's Markdown: host, component breakdown, stage peaks, steps, timeline, activity."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .report_data import GIB, Breakdown, StageRow, StepStats
from .report_ranks import RankRun, render_ranks

MIB = float(1 << 20)


@dataclass
class Analysis:
    breakdown: Breakdown
    stages: list[StageRow]
    steps: StepStats | None
    activity: dict | None
    cuda: bool
    ranks: list[RankRun] = field(default_factory=list)


def render(data: dict, source: Path | None, analysis: Analysis, images: dict[str, str],
           plot_note: str | None) -> str:
    """`images`: plot name ("components", "stages", "timeline", "activity") -> relative path."""
    run = data["run"]
    parts = [f"# Memory report: run {run.get('id', '?')}", "", *_host(data, source)]
    if plot_note:
        parts += ["", f"> {plot_note}"]
    parts += _components(analysis.breakdown, images.get("components"))
    parts += _stages(analysis.stages, analysis.cuda, images.get("stages"))
    parts += _steps(analysis.steps)
    parts += render_ranks(analysis.ranks)
    parts += ["", "## Memory timeline", ""]
    parts += _image("memory timeline", images.get("timeline"))
    parts += ["", "Stages are shaded from the previous stage's last event to their own last "
              "event (an event's peak covers the time since the previous event); probe events "
              "are not stages."]
    parts += _activity(analysis.activity, images.get("activity"))
    return "\n".join(parts) + "\n"


def _host(data: dict, source: Path | None) -> list[str]:
    run, host = data["run"], data["run"].get("host") or {}
    device = host.get("device_name") or "no CUDA device"
    if host.get("device_total_bytes"):
        device += f" ({_gib(host['device_total_bytes'])} GiB)"
    torch = host.get("torch", "?") + (f" (CUDA {host['cuda']})" if host.get("cuda") else "")
    dropped = run.get("dropped_events", 0)
    rows = [("events file", f"`{source.name}`" if source else "(not saved)"),
            ("started", run.get("started_iso", "?")),
            ("device", device), ("torch", torch),
            ("python", host.get("python", "?")), ("platform", host.get("platform", "?")),
            ("events", f"{len(data['events'])}" + (f" ({dropped} oldest dropped)"
                                                   if dropped else ""))]
    return ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _components(breakdown: Breakdown, image: str | None) -> list[str]:
    lines = ["", "## Loaded components", ""]
    if not breakdown.rows:
        return lines + ["No loader events in this log."]
    lines += ["Size of each loaded component when placed (parameters and buffers); \"other\" is "
              "the rest of what was resident after the last load event (process RSS plus CUDA "
              "allocated: Python, torch, buffers).", "",
              "| component | GiB | share | dtype | files |", "|---|---:|---:|---|---|"]
    for row in breakdown.rows:
        lines.append(f"| {row.component} | {_gib(row.bytes)} | {row.share:.1f}% | "
                     f"{', '.join(row.dtypes)} | {', '.join(row.files)} |")
    lines.append(f"| **total** | **{_gib(breakdown.total_bytes)}** | **100.0%** | | |")
    if breakdown.resident_bytes is not None:
        lines += ["", f"Resident after loading: {_gib(breakdown.resident_bytes)} GiB (process RSS "
                  "+ CUDA allocated). Memory-mapped weights count once they are read, so this "
                  "can be less than the components' sizes."]
    if breakdown.unsized:
        lines += ["", "Loader events without a size (a log from before sizes were recorded): "
                  + ", ".join(breakdown.unsized) + "."]
    return lines + [""] + _image("loaded components", image)


def _stages(rows: list[StageRow], cuda: bool, image: str | None) -> list[str]:
    lines = ["", "## Peak memory per stage", ""]
    if not rows:
        return lines + ["No events in this log."]
    if cuda:
        lines += ["Peak allocated and reserved GPU memory over each stage's events (torch "
                  "counters; \"initial\" is what was held when the log began; a probe's row covers "
                  "whatever ran since the event before it). RSS is the largest process RSS read "
                  "at the stage's events; \"time\" runs from the start of the stage's first "
                  "interval to its last event.", "",
                  "| stage | events | peak allocated GiB | peak reserved GiB | RSS GiB | "
                  "time s |", "|---|---:|---:|---:|---:|---|"]
        for r in rows:
            lines.append(f"| {r.name} | {r.events} | {_gib(r.peak_allocated)} | "
                         f"{_gib(r.peak_reserved)} | {_gib(r.rss)} | {_span(r)} |")
    else:
        lines += ["No CUDA in this run: the table shows the process RSS instead, the largest "
                  "value read at each stage's events (a reading at the event, not a peak over "
                  "the interval).", "",
                  "| stage | events | RSS GiB | time s |", "|---|---:|---:|---|"]
        for r in rows:
            lines.append(f"| {r.name} | {r.events} | {_gib(r.rss)} | {_span(r)} |")
    return lines + [""] + _image("peak memory per stage", image)


def _steps(steps: StepStats | None) -> list[str]:
    lines = ["", "## Sampling steps", ""]
    if steps is None:
        return lines + ["No sampling-step events in this log."]
    memory = ("allocated GPU memory" if steps.memory_field == "cuda_allocated_bytes"
              else "process RSS (no CUDA in this run)")
    lines += [f"{steps.steps} step events. Change of {memory} from one step to the next, and "
              "the time between consecutive steps:", "",
              "| quantity | n | mean | min | max |", "|---|---:|---:|---:|---:|"]
    if steps.increments is not None:
        s = steps.increments
        lines.append(f"| memory change, MiB | {s.count} | {_mib(s.mean)} | {_mib(s.min)} | "
                     f"{_mib(s.max)} |")
    if steps.durations is not None:
        s = steps.durations
        lines.append(f"| step duration, s | {s.count} | {s.mean:.3f} | {s.min:.3f} | "
                     f"{s.max:.3f} |")
    if steps.increments is None and steps.durations is None:
        lines.append("| (a single step: nothing to compare) | 0 | | | |")
    if steps.first_step_s:
        first = ", ".join(f"{t:.3f}" for t in steps.first_step_s)
        lines += ["", f"First step, from the sampler's start (includes placing the model): "
                      f"{first} s."]
    return lines


def _activity(trace: dict | None, image: str | None) -> list[str]:
    lines = ["", "## GPU activity", ""]
    if trace is None:
        return lines + ["No activity trace in this log: the run was not monitored "
                        "(profiling/activity.py, `log.attach_activity(monitor.result())`)."]
    s = trace["summary"]
    if trace.get("source") == "nvml":
        rows = [("duration", _num(s.get("duration_s"), "s", 2)),
                ("mean SM activity", _num(s.get("mean_sm_activity"), "%", 1)),
                ("compute load (duration x mean SM activity)",
                 _num(s.get("compute_load"), "GPU-seconds", 2)),
                ("max memory used (NVML)", _num(_bytes_gib(s.get("max_memory_used_bytes")),
                                                 "GiB", 2)),
                ("mean / max power", f"{_num(s.get('mean_power_w'), '', 0)} / "
                                     f"{_num(s.get('max_power_w'), 'W', 0)}"),
                ("mean / max SM clock", f"{_num(s.get('mean_sm_clock_mhz'), '', 0)} / "
                                        f"{_num(s.get('max_sm_clock_mhz'), 'MHz', 0)}")]
        head = f"Sampled through NVML on {trace.get('device') or 'the GPU'}"
    else:
        rows = [("duration", _num(s.get("duration_s"), "s", 2)),
                ("mean / max CPU utilisation", f"{_num(s.get('mean_cpu_percent'), '', 1)} / "
                                               f"{_num(s.get('max_cpu_percent'), '%', 1)}"),
                ("max process RSS", _num(_bytes_gib(s.get("max_rss_bytes")), "GiB", 2))]
        reason = f" ({trace['reason']})" if trace.get("reason") else ""
        head = f"No GPU monitoring{reason}: CPU utilisation and process RSS were recorded"
    decimated = (trace.get("kept_every") or 1) > 1
    kept = f" ({len(trace['samples'])} kept)" if decimated else ""
    lines += [f"{head}, every {trace.get('interval_s')} s, {s.get('samples', '?')} samples"
              f"{kept}.", "", "| | |", "|---|---:|", *[f"| {k} | {v} |" for k, v in rows]]
    if trace.get("error"):
        lines += ["", f"Sampling stopped early: {trace['error']}."]
    return lines + [""] + _image("activity trace", image)


def _span(row: StageRow) -> str:
    """When the row's intervals ran: from its first interval's start to its last event."""
    return f"{row.start_s:.2f}" if row.end_s == row.start_s else \
        f"{row.start_s:.2f} – {row.end_s:.2f}"


def _image(alt: str, relative: str | None) -> list[str]:
    return [f"![{alt}]({relative})"] if relative else []


def _gib(value) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def _mib(value: float) -> str:
    return f"{value / MIB:+.1f}"


def _bytes_gib(value):
    return None if value is None else value / GIB


def _num(value, unit: str, digits: int) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" + (f" {unit}" if unit else "")
