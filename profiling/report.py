"""A memory report from an event log: Markdown with PNG plots beside it.

    build_report("output/memory_events.json")            # -> output/memory_events-report.md
    build_report(current_log(), "output/reports")

Files, named after the events file (or the run id for a log never saved), all written
atomically into the output folder:

    <name>-report.md        host, component breakdown, peaks per stage, step statistics, the
                            ranks of a several-GPU run, activity
    <name>-components.png   (a) what each loaded component occupies, and "other"
    <name>-stages.png       (b) peak allocated / reserved per stage (RSS without CUDA)
    <name>-timeline.png     (d) allocated, reserved, NVML used and RSS over time, stages shaded
    <name>-activity.png     (e) SM activity, power, clock and memory, when a trace is attached

The Markdown embeds the PNGs by relative path. Without matplotlib the Markdown is still written
and says the plots were skipped. Bad input raises ReportError naming the file and what was
expected.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from ..atomic_files import write_atomically
from .report_data import (ReportError, activity, component_breakdown, read_log, stage_peaks,
                          step_statistics, uses_cuda)
from .report_markdown import Analysis, render
from .report_ranks import rank_runs

logger = logging.getLogger(__name__)


def build_report(events, out_dir: str | Path | None = None) -> Path:
    """Write the report of `events` (a saved log's path, or an EventLog) into `out_dir` (default:
    the events file's folder) and return the Markdown file's path."""
    data, source = read_log(events)
    if out_dir is not None:
        out = Path(out_dir)
    else:  # beside the file (for an EventLog: where it saves)
        out = source.parent if source is not None else Path(".")
    name = source.stem if source is not None else str(data["run"].get("id", "memory"))
    analysis = analyse(data)
    images, note = draw(data, analysis, out, name)
    report = out / f"{name}-report.md"
    write_atomically(report, render(data, source, analysis, images, note).encode("utf-8"),
                     "the memory report")
    return report


def analyse(data: dict) -> Analysis:
    return Analysis(breakdown=component_breakdown(data), stages=stage_peaks(data),
                    steps=step_statistics(data), activity=activity(data),
                    cuda=uses_cuda(data["events"]), ranks=rank_runs(data))


def draw(data: dict, analysis: Analysis, out: Path, name: str) -> tuple[dict, str | None]:
    """The plots there is data for: {plot: relative path}, and a note when none could be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("memory report: matplotlib is not installed; writing the report "
                       "without plots")
        return {}, "Plots skipped: matplotlib is not installed (pip install matplotlib)."
    from . import report_plots as plots
    jobs = {}
    if analysis.breakdown.rows:
        jobs["components"] = lambda p: plots.plot_components(analysis.breakdown, p)
    if analysis.stages:
        jobs["stages"] = lambda p: plots.plot_stage_peaks(analysis.stages, analysis.cuda, p)
    if data["events"]:
        jobs["timeline"] = lambda p: plots.plot_timeline(data, analysis.cuda, p)
    if analysis.activity is not None and analysis.activity["samples"]:
        jobs["activity"] = lambda p: plots.plot_activity(data, analysis.activity, p)
    images = {}
    for plot, make in jobs.items():
        filename = f"{name}-{plot}.png"
        make(out / filename)
        images[plot] = filename
    return images, None


__all__ = ["build_report", "analyse", "ReportError"]
