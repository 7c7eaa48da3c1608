"""The numbers of a memory report, computed from a saved event log (no plotting here).

Stages: an event's peak covers the interval since the previous event (profiling/events.py), so
each event's peak counts for the stage it names. Rows are the stages in order of first
appearance, with every sampling step (a "sample" event whose extra carries "step") and every
probe label ("probe: <label>": whatever ran since the previous event, native nodes included) a
row of its own, and an "initial" row first: the counters when the log began (run.initial), or, in logs older
than that key, the first event's current values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .events import SCHEMA, EventLog

GIB = float(1 << 30)
COMPONENT_ORDER = ("dit", "text_encoder", "clip_vision", "vae")
OTHER = "other"
EXPECTED = f"a memory event log (JSON of schema {SCHEMA}, as the Wan Memory Probe, " \
           f"`wan-enhanced demo` or `wan-enhanced bench` write it)"


class ReportError(ValueError):
    """The events file cannot be reported on; the message names it and what was expected."""


# -- reading -----------------------------------------------------------------------------------

def read_log(source) -> tuple[dict, Path | None]:
    """(the log as a dict, its path) from an EventLog, a dict, or the path of a saved log."""
    if isinstance(source, EventLog):
        return source.to_dict(), source.path
    if isinstance(source, dict):
        return check_log(source, "the event log"), None
    path = Path(source)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ReportError(f"{path} {what}; expected {EXPECTED}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not a text file; expected {EXPECTED}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}); expected {EXPECTED}") from None
    return check_log(data, str(path)), path


def check_log(data, name: str) -> dict:
    if not isinstance(data, dict) or not isinstance(data.get("schema"), str):
        raise ReportError(f"{name} has no \"schema\" key; expected {EXPECTED}")
    schema = data["schema"]
    if schema.rpartition("/")[0] != SCHEMA.rpartition("/")[0]:
        raise ReportError(f"{name} is not a memory event log (schema {schema!r}); "
                          f"expected {EXPECTED}")
    if schema != SCHEMA:
        raise ReportError(f"{name} uses {schema}; this version reads {SCHEMA}")
    if not isinstance(data.get("run"), dict):
        raise ReportError(f"{name} has no \"run\" object; expected {EXPECTED}")
    events = data.get("events")
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ReportError(f"{name}: \"events\" must be a list of event objects; expected "
                          f"{EXPECTED}")
    for event in events:
        if not isinstance(event.get("monotonic"), (int, float)):
            raise ReportError(f"{name}: event {event.get('index', '?')} has no \"monotonic\" "
                              f"time; expected {EXPECTED}")
    return data


def uses_cuda(events: list[dict]) -> bool:
    return any(e.get("cuda_allocated_bytes") is not None for e in events)


# -- (a) load-phase breakdown by component -----------------------------------------------------

@dataclass
class ComponentRow:
    component: str
    bytes: int
    share: float  # percent of the total
    files: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)


@dataclass
class Breakdown:
    rows: list[ComponentRow]       # the components in order, then "other"
    total_bytes: int               # sum of the rows
    resident_bytes: int | None     # process RSS + CUDA allocated after the last load event
    unsized: list[str]             # loader events without a "bytes" extra (older logs)


def component_breakdown(data: dict) -> Breakdown:
    loads = [e for e in data["events"] if e.get("stage") == "load"]
    sizes: dict[str, int] = {}
    files: dict[str, list[str]] = {}
    dtypes: dict[str, list[str]] = {}
    seen, unsized = set(), []
    for event in loads:
        extra = event.get("extra") or {}
        component = extra.get("component")
        if component is None:
            continue
        if not isinstance(extra.get("bytes"), int):
            unsized.append(event.get("label", component))
            continue
        key = (component, extra.get("file") or event.get("label"))
        if key in seen:  # the same file loaded again (a rerun in the same log) counts once
            continue
        seen.add(key)
        sizes[component] = sizes.get(component, 0) + extra["bytes"]
        files.setdefault(component, []).append(str(extra.get("file") or event.get("label")))
        if extra.get("dtype") and extra["dtype"] not in dtypes.setdefault(component, []):
            dtypes[component].append(extra["dtype"])
    resident = None
    if loads:
        last = loads[-1]
        resident = (last.get("rss_bytes") or 0) + (last.get("cuda_allocated_bytes") or 0)
    named = sum(sizes.values())
    # Memory-mapped weights not yet read are not resident: "other" never goes below zero.
    other = max((resident or 0) - named, 0)
    total = named + other
    order = sorted(sizes, key=lambda c: (COMPONENT_ORDER.index(c) if c in COMPONENT_ORDER
                                         else len(COMPONENT_ORDER), c))
    rows = [ComponentRow(c, sizes[c], _share(sizes[c], total), files[c], dtypes.get(c, []))
            for c in order]
    if loads:
        rows.append(ComponentRow(OTHER, other, _share(other, total)))
    return Breakdown(rows, total, resident, unsized)


def _share(part: int, total: int) -> float:
    return 100.0 * part / total if total else 0.0


# -- (b) peaks per stage -----------------------------------------------------------------------

@dataclass
class StageRow:
    name: str
    events: int
    peak_allocated: int | None
    peak_reserved: int | None
    rss: int | None        # the largest RSS read at the row's events
    start_s: float         # seconds from the run's origin: the first event's interval start
    end_s: float           # the row's last event


def origin(data: dict) -> float:
    """Time zero of the run's plots: when the log began, else its first event (monotonic)."""
    initial = data["run"].get("initial") or {}
    times = [e["monotonic"] for e in data["events"]]
    if isinstance(initial.get("monotonic"), (int, float)):
        times.append(initial["monotonic"])
    return min(times) if times else 0.0


def step_number(event: dict) -> int | None:
    """The sampling step an event records (its extra's "step", set by the sampler), or None."""
    if event.get("stage") != "sample":
        return None
    step = (event.get("extra") or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def row_name(event: dict) -> str:
    stage = event.get("stage") or "(no stage)"
    label = event.get("label", "")
    if step_number(event) is not None:
        return label
    if stage == "probe":
        return f"probe: {label}"
    return stage


def stage_peaks(data: dict) -> list[StageRow]:
    zero = origin(data)
    rows = [_initial_row(data, zero)] if data["events"] or data["run"].get("initial") else []
    by_name: dict[str, StageRow] = {}
    previous = zero
    for event in data["events"]:
        name = row_name(event)
        t = event["monotonic"] - zero
        row = by_name.get(name)
        if row is None:
            row = by_name[name] = StageRow(name, 0, None, None, None, previous - zero, t)
            rows.append(row)
        row.events += 1
        row.peak_allocated = _max(row.peak_allocated, event.get("peak_allocated_bytes"))
        row.peak_reserved = _max(row.peak_reserved, event.get("peak_reserved_bytes"))
        row.rss = _max(row.rss, event.get("rss_bytes"))
        row.end_s = t
        previous = event["monotonic"]
    return rows


def _initial_row(data: dict, zero: float) -> StageRow:
    initial = data["run"].get("initial")
    name = "initial"
    if not initial:  # a log from before run.initial: the nearest reading there is
        initial, name = data["events"][0], "initial (at the first event)"
    t = initial.get("monotonic", zero) - zero
    return StageRow(name, 0, initial.get("cuda_allocated_bytes"),
                    initial.get("cuda_reserved_bytes"), initial.get("rss_bytes"), t, t)


def _max(current, value):
    if value is None:
        return current
    return value if current is None else max(current, value)


# -- (c) sampling steps ------------------------------------------------------------------------

@dataclass
class Stats:
    count: int
    mean: float
    min: float
    max: float


@dataclass
class StepStats:
    steps: int                      # step events
    memory_field: str               # "cuda_allocated_bytes", or "rss_bytes" without CUDA
    increments: Stats | None        # change of memory_field from one step to the next, bytes
    durations: Stats | None         # seconds between consecutive steps
    first_step_s: list[float]       # each sampler's first step, from its start event


def step_statistics(data: dict) -> StepStats | None:
    events = data["events"]
    memory_field = "cuda_allocated_bytes" if uses_cuda(events) else "rss_bytes"
    increments, durations, first_steps, steps = [], [], [], 0
    previous_step, previous_sample_event = None, None
    for event in events:
        if event.get("stage") != "sample":
            continue
        number = step_number(event)
        if number is None:
            previous_sample_event, previous_step = event, None  # a sampler starts or ends
            continue
        steps += 1
        if previous_step is not None and number > previous_step[0]:
            before, after = previous_step[1].get(memory_field), event.get(memory_field)
            if before is not None and after is not None:
                increments.append(after - before)
            durations.append(event["monotonic"] - previous_step[1]["monotonic"])
        elif previous_sample_event is not None:
            first_steps.append(event["monotonic"] - previous_sample_event["monotonic"])
        previous_step = (number, event)
        previous_sample_event = None
    if steps == 0:
        return None
    return StepStats(steps, memory_field, _stats(increments), _stats(durations), first_steps)


def _stats(values: list[float]) -> Stats | None:
    if not values:
        return None
    return Stats(len(values), sum(values) / len(values), min(values), max(values))


# -- (e) activity ------------------------------------------------------------------------------

def activity(data: dict) -> dict | None:
    """The attached activity trace, or None. Samples without a "monotonic" time are dropped."""
    trace = data.get("activity")
    if not isinstance(trace, dict):
        return None
    samples = [s for s in trace.get("samples") or [] if isinstance(s, dict)
               and isinstance(s.get("monotonic"), (int, float))]
    return {**trace, "samples": samples, "summary": trace.get("summary") or {}}


def gib(value) -> float | None:
    return None if value is None else value / GIB
