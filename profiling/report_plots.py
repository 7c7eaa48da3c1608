"""The report's PNG plots.

matplotlib is imported here only, when a report is drawn, and used through its object API with
the Agg canvas: no pyplot, so a host process's own backend and figures are never touched.
Every PNG is rendered in memory and written atomically.
"""

from __future__ import annotations

import io
from pathlib import Path

from ..atomic_files import write_atomically
from .report_data import GIB, OTHER, Breakdown, StageRow, origin

STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                 "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
UNSHADED = ("probe", "(no stage)")  # a probe's interval is whatever ran before it: not a stage


def _figure(width: float, height: float, rows: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return figure, list(axes)


def _save(figure, path: Path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return write_atomically(path, buffer.getvalue(), "a report plot")


def plot_components(breakdown: Breakdown, path: Path) -> Path:
    """(a) What the loaded components occupy: one bar per component, with its share."""
    figure, (axes,) = _figure(7, 3.2)
    rows = breakdown.rows
    names = [row.component for row in rows]
    values = [row.bytes / GIB for row in rows]
    colours = ["#bab0ac" if n == OTHER else STAGE_COLOURS[i % len(STAGE_COLOURS)]
               for i, n in enumerate(names)]
    bars = axes.barh(names[::-1], values[::-1], color=colours[::-1])
    for bar, row in zip(bars, rows[::-1]):
        axes.annotate(f"{row.bytes / GIB:.2f} GiB ({row.share:.1f}%)",
                      (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                      xytext=(4, 0), textcoords="offset points", va="center", fontsize=9)
    axes.set_xlabel("GiB")
    axes.set_xlim(0, max(values + [1e-9]) * 1.35)
    axes.set_title("Loaded components (size when placed)")
    figure.tight_layout()
    return _save(figure, path)


def plot_stage_peaks(rows: list[StageRow], cuda: bool, path: Path) -> Path:
    """(b) Peak memory of each stage: allocated and reserved, or RSS without CUDA."""
    figure, (axes,) = _figure(max(7, 0.45 * len(rows) + 2), 4)
    positions = range(len(rows))
    if cuda:
        width = 0.4
        axes.bar([p - width / 2 for p in positions],
                 [(r.peak_allocated or 0) / GIB for r in rows], width, label="peak allocated")
        axes.bar([p + width / 2 for p in positions],
                 [(r.peak_reserved or 0) / GIB for r in rows], width, label="peak reserved")
        axes.legend(fontsize=8)
        axes.set_title("Peak GPU memory per stage")
    else:
        axes.bar(list(positions), [(r.rss or 0) / GIB for r in rows], 0.6, color="#59a14f")
        axes.set_title("Process RSS per stage (no CUDA in this run)")
    axes.set_xticks(list(positions))
    axes.set_xticklabels([r.name for r in rows], rotation=45, ha="right", fontsize=8)
    axes.set_ylabel("GiB")
    figure.tight_layout()
    return _save(figure, path)


def stage_spans(data: dict) -> list[tuple[str, float, float]]:
    """(stage, start s, end s): consecutive events of one stage, from the previous stage's
    last event (where their first interval begins) to their own last event."""
    zero = origin(data)
    spans: list[list] = []
    previous = zero
    for event in data["events"]:
        stage = event.get("stage") or "(no stage)"
        t = event["monotonic"]
        if stage not in UNSHADED:
            if spans and spans[-1][0] == stage:
                spans[-1][2] = t - zero
            else:
                spans.append([stage, previous - zero, t - zero])
        previous = t
    return [tuple(span) for span in spans]


def _shade_stages(axes, spans, colours: dict) -> None:
    labelled = set()
    for stage, start, end in spans:
        colour = colours.setdefault(stage, STAGE_COLOURS[len(colours) % len(STAGE_COLOURS)])
        axes.axvspan(start, max(end, start + 1e-6), color=colour, alpha=0.15, lw=0,
                     label=None if stage in labelled else stage)
        labelled.add(stage)


def plot_timeline(data: dict, cuda: bool, path: Path) -> Path:
    """(d) Memory over time: allocated, reserved, NVML used and RSS, stages shaded."""
    figure, (axes,) = _figure(11, 4.5)
    zero = origin(data)
    events = data["events"]
    times = [e["monotonic"] - zero for e in events]
    series = [("cuda_allocated_bytes", "allocated"), ("cuda_reserved_bytes", "reserved"),
              ("nvml_used_bytes", "NVML used"), ("rss_bytes", "process RSS")]
    for key, label in series:
        points = [(t, e[key] / GIB) for t, e in zip(times, events) if e.get(key) is not None]
        if points:
            axes.plot(*zip(*points), marker=".", lw=1.2, label=label)
    if cuda:
        peaks = [(t, e["peak_allocated_bytes"] / GIB) for t, e in zip(times, events)
                 if e.get("peak_allocated_bytes") is not None]
        if peaks:
            axes.plot(*zip(*peaks), ls="none", marker="v", ms=4, color="#e15759",
                      label="peak allocated since previous event")
    trace = data.get("activity") or {}
    monitored = [(s["monotonic"] - zero, s["memory_used_bytes"] / GIB)
                 for s in trace.get("samples") or []
                 if s.get("memory_used_bytes") is not None]
    if monitored:
        axes.plot(*zip(*monitored), lw=0.8, alpha=0.7, label="NVML used (monitor)")
    _shade_stages(axes, stage_spans(data), {})
    axes.set_xlabel("seconds since the run began")
    axes.set_ylabel("GiB")
    axes.set_title("Memory timeline" + ("" if cuda else " (no CUDA: RSS only)"))
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return _save(figure, path)


def plot_activity(data: dict, trace: dict, path: Path) -> Path:
    """(e) The activity trace: SM %, power and memory (CPU % and RSS for a CPU trace)."""
    zero = origin(data)
    samples = trace["samples"]
    if trace.get("source") == "nvml":
        panels = [("sm_activity", "SM activity %", 1.0), ("power_w", "power W", 1.0),
                  ("sm_clock_mhz", "SM clock MHz", 1.0), ("memory_used_bytes", "memory GiB", GIB)]
    else:
        panels = [("cpu_percent", "CPU %", 1.0), ("rss_bytes", "process RSS GiB", GIB)]
    panels = [p for p in panels if any(s.get(p[0]) is not None for s in samples)] or panels[:1]
    figure, axes_list = _figure(11, 1.9 * len(panels) + 0.8, rows=len(panels))
    spans = stage_spans(data)
    colours: dict = {}
    for axes, (key, label, scale) in zip(axes_list, panels):
        points = [(s["monotonic"] - zero, s[key] / scale) for s in samples
                  if s.get(key) is not None]
        if points:
            axes.plot(*zip(*points), lw=1)
        axes.set_ylabel(label, fontsize=8)
        _shade_stages(axes, spans, colours)
    axes_list[0].set_title(f"Activity ({trace.get('source')}, every "
                           f"{trace.get('interval_s')} s)")
    if spans:
        axes_list[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes_list[-1].set_xlabel("seconds since the run began")
    figure.tight_layout()
    return _save(figure, path)


__all__ = ["plot_components", "plot_stage_peaks", "plot_timeline", "plot_activity",
           "stage_spans"]
