"""Run a validated API-format workflow in this process.

Follows ComfyUI's execution semantics where they matter to a node: only the nodes an output node
depends on run, each after its inputs; a node receives only the inputs the workflow gives (its
own defaults apply to the rest) plus the hidden inputs it asks for; the whole run is under
torch.inference_mode(); the method returns a tuple or {"ui": ..., "result": ...}.

Without a cache (the default) nothing is kept between runs, and within a run a node's outputs
are dropped as soon as the last node reading them has finished (like --cache-none): after the
run, or after a failed or interrupted one, nothing the run created stays referenced. A fresh node
instance is made for every run.

With a cache (`cache=NodeCache()`, node_cache.py, the same instance for every run) a run reuses
outputs as a ComfyUI server does with its default cache: a node whose signature (its class, its
IS_CHANGED value, its constant inputs and those of everything upstream, and its node id where its
class declares UNIQUE_ID, as all of this package's nodes do) matches an output of the previous
run is not run. It gets a "cached" RunEvent (no "start"/"finish"), node_seconds 0.0,
its readers get the very objects the cache holds, and its ui dict is the cached one (an
unchanged output node is not run again: its ui names the files an earlier run wrote, as a
server's history does). Every node that finishes is stored in the cache, so the cache keeps all
outputs of the last run, not only those still to be read; at the start of a run the entries that
run cannot use are dropped, so it holds at most one run's outputs. A failed or interrupted run
leaves the outputs of the nodes that finished (the next run reuses them), never a part of the
failed node's. Node instances are kept in the cache and reused, one per node id and class_type,
as ComfyUI's server keeps them.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .. import host
from ..profiling.snapshot import reset_rss_peak, rss_peak
from .node_cache import CachedNode, NodeCache
from .workflow import (Issue, Registry, ValidatedWorkflow, WorkflowError, is_link, node_title,
                       validate)


# -- what a run reports ------------------------------------------------------------------------

@dataclass(frozen=True)
class RunEvent:
    """Progress of one node. kind: "start", "progress", "finish" (in-process and server),
    "cached" (its outputs reused from the server's cache, or in-process from the NodeCache given
    to execute: such a node gets no "start" or "finish", and its seconds are 0)."""

    kind: str
    node_id: str
    class_type: str
    title: str | None = None
    index: int = 0  # 1-based position among the nodes that run; 0 when unknown
    count: int = 0
    value: int = 0  # progress steps, from host.Progress (in-process) or websocket "progress"
    total: int = 0
    seconds: float = 0.0  # wall time of the node so far; its total at "finish"

    @property
    def name(self) -> str:
        return self.title or self.class_type


EventCallback = Callable[[RunEvent], None]


@dataclass(frozen=True)
class MemoryPeak:
    """Peaks over one run, in bytes. allocated/reserved: torch CUDA on the current device (None
    without CUDA). rss: resident memory of the process; when the OS does not let us reset its
    high-water mark, rss_is_lifetime is True and rss is the peak since the process started."""

    allocated: int | None = None
    reserved: int | None = None
    rss: int | None = None
    rss_is_lifetime: bool = False

    def as_dict(self) -> dict:
        return {"allocated": self.allocated, "reserved": self.reserved, "rss": self.rss,
                "rss_is_lifetime": self.rss_is_lifetime}


@dataclass
class RunResult:
    run_id: str
    outputs: dict[str, dict]  # node_id -> the node's "ui" dict (a cached node's: the cached one)
    node_seconds: dict[str, float]  # every node of the run; 0.0 for a node taken from the cache
    seconds: float
    peak: MemoryPeak
    files: list[str] = field(default_factory=list)  # output files the ui dicts name


class RunError(Exception):
    """A node failed; names the node and keeps the formatted traceback (not the frames: they
    would keep the run's tensors alive)."""

    def __init__(self, message: str, node_id: str | None = None, class_type: str | None = None,
                 title: str | None = None, details: str = ""):
        self.message, self.details = message, details
        self.node_id, self.class_type, self.title = node_id, class_type, title
        super().__init__(self._text())

    def _text(self) -> str:
        if self.node_id is None:
            return self.message
        label = self.class_type or ""
        if self.title:
            label += f' "{self.title}"'
        return f"node {self.node_id} ({label}): {self.message}"


class RunInterrupted(RunError):
    """The run was asked to stop (host.request_interrupt, Ctrl-C, ComfyUI's interrupt)."""


# -- entry points ------------------------------------------------------------------------------

def run_workflow(workflow: Mapping, registry: Registry, *, on_event: EventCallback | None = None,
                 run_id: str | None = None, source: str | None = None,
                 extra_pnginfo: dict | None = None,
                 cache: NodeCache | None = None) -> RunResult:
    """Validate, then execute. Raises WorkflowError before anything runs, RunError (or
    RunInterrupted) when a node fails or the run is stopped. `cache`: see execute."""
    validated = validate(workflow, registry, source)
    return execute(validated, registry, on_event=on_event, run_id=run_id,
                   extra_pnginfo=extra_pnginfo, cache=cache)


def execute(validated: ValidatedWorkflow, registry: Registry, *,
            on_event: EventCallback | None = None, run_id: str | None = None,
            extra_pnginfo: dict | None = None, cache: NodeCache | None = None) -> RunResult:
    """Run a validated workflow. `cache`: None runs every node and keeps nothing; a NodeCache
    (the same one for each run) reuses the unchanged nodes' outputs of its previous run and
    keeps this run's (see the module docstring)."""
    check_supported(validated, registry)
    run_id = run_id or uuid.uuid4().hex
    host.clear_interrupt()
    host.begin_prompt(run_id)  # the memory event log of this run (profiling/events.py)
    meter = _PeakMeter()
    started = time.perf_counter()
    run = _Run(validated, registry, on_event, extra_pnginfo, cache)
    host.add_progress_listener(run.on_progress)
    failure: RunError | None = None
    try:
        run.run_all()
    except BaseException as exc:  # KeyboardInterrupt too: the run must still be torn down
        failure = run.describe_failure(exc)
    finally:
        host.remove_progress_listener(run.on_progress)
        host.end_prompt()
        outputs, node_seconds = run.ui, run.node_seconds
        run.drop_everything()
        del run
    seconds = time.perf_counter() - started
    peak = meter.read()
    gc.collect()  # tensors caught in reference cycles
    host.release_cached_memory()
    if failure is not None:
        raise failure
    return RunResult(run_id=run_id, outputs=outputs, node_seconds=node_seconds, seconds=seconds,
                     peak=peak, files=[str(p) for p in local_output_files(outputs)])


# -- one run -----------------------------------------------------------------------------------

class _InterruptCheck(Exception):
    """Wraps whatever host.check_interrupt raised (ours or ComfyUI's exception)."""


HIDDEN_VALUES = ("UNIQUE_ID", "PROMPT", "EXTRA_PNGINFO", "DYNPROMPT", "AUTH_TOKEN_COMFY_ORG",
                 "API_KEY_COMFY_ORG")


class _Run:
    def __init__(self, validated: ValidatedWorkflow, registry: Registry,
                 on_event: EventCallback | None, extra_pnginfo: dict | None,
                 cache: NodeCache | None = None):
        self.validated = validated
        self.cache = cache
        self.nodes = validated.nodes
        self.order = list(validated.order)
        self.registry = registry
        self.on_event = on_event
        self.extra_pnginfo = extra_pnginfo
        self.values: dict[str, tuple] = {}  # outputs still to be read by a later node
        self.readers_left = Counter(link[0] for node_id in self.order
                                    for link in self.nodes[node_id]["inputs"].values()
                                    if is_link(link))
        self.ui: dict[str, dict] = {}
        self.node_seconds: dict[str, float] = {}
        self.current: tuple[str, int, float] | None = None  # node id, index, start time

    def run_all(self) -> None:
        if self.cache is not None:
            self.cache.begin_run(self.validated, self.registry)  # calls IS_CHANGED
        for index, node_id in enumerate(self.order, 1):
            try:
                host.check_interrupt()
            except BaseException as exc:
                raise _InterruptCheck(str(exc) or "interrupted") from exc
            cached = self.cache.lookup(node_id) if self.cache is not None else None
            if cached is not None:
                self._use_cached(node_id, index, cached)
                continue
            self.current = (node_id, index, time.perf_counter())
            self._emit("start", node_id, index)
            self._run_node(node_id)
            seconds = time.perf_counter() - self.current[2]
            self.node_seconds[node_id] = seconds
            self._emit("finish", node_id, index, seconds=seconds)
            self.current = None

    def _use_cached(self, node_id: str, index: int, cached: CachedNode) -> None:
        """A node whose outputs the cache holds: its readers get those very objects."""
        if isinstance(cached.ui, dict):
            self.ui[node_id] = cached.ui
        if self.readers_left[node_id] > 0:
            self.values[node_id] = cached.outputs
        self.node_seconds[node_id] = 0.0
        self._release_inputs(node_id)
        self._emit("cached", node_id, index)

    def _run_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        cls = self.registry[node["class_type"]]
        instance = cls() if self.cache is None else \
            self.cache.node_object(node_id, node["class_type"], cls)
        method = getattr(instance, cls.FUNCTION)
        del instance
        arguments = self._arguments(node_id, cls)
        with torch.inference_mode():
            result = method(**arguments)
            if inspect.isawaitable(result):  # ComfyUI also accepts async node methods
                result = asyncio.run(_awaited(result))
        del arguments
        values, ui = _split_result(result, cls)
        del result
        values = tuple(values)
        if self.cache is not None:  # the node finished: the next run may reuse all its outputs
            self.cache.store(node_id, values, ui)
        if isinstance(ui, dict):
            self.ui[node_id] = ui
        if self.readers_left[node_id] > 0:
            self.values[node_id] = values
        del values
        self._release_inputs(node_id)

    def _arguments(self, node_id: str, cls) -> dict[str, Any]:
        """Only the inputs the workflow gives, as ComfyUI does; hidden inputs on request."""
        declared = cls.INPUT_TYPES()
        names = set(declared.get("required") or {}) | set(declared.get("optional") or {})
        arguments = {}
        for name, value in self.nodes[node_id]["inputs"].items():
            if name not in names:
                continue  # undeclared: ignored, as validation warned
            if is_link(value):
                source, index = value
                value = self.values[source][index]
            arguments[name] = value
        for name, kind in (declared.get("hidden") or {}).items():
            if kind == "UNIQUE_ID":
                arguments[name] = node_id
            elif kind == "PROMPT":
                arguments[name] = self.nodes
            elif kind == "EXTRA_PNGINFO":
                arguments[name] = self.extra_pnginfo
            elif kind in HIDDEN_VALUES:
                arguments[name] = None  # no dynamic prompt or Comfy-org account here
        return arguments

    def _release_inputs(self, node_id: str) -> None:
        """Drop a node's outputs once every node reading them has run."""
        for value in self.nodes[node_id]["inputs"].values():
            if is_link(value):
                source = value[0]
                self.readers_left[source] -= 1
                if self.readers_left[source] <= 0:
                    self.values.pop(source, None)

    def on_progress(self, label: str, value: int, total: int) -> None:
        if self.current is not None:
            node_id, index, start = self.current
            self._emit("progress", node_id, index, value=value, total=total,
                       seconds=time.perf_counter() - start)

    def _emit(self, kind: str, node_id: str, index: int, **extra) -> None:
        if self.on_event is not None:
            node = self.nodes[node_id]
            self.on_event(RunEvent(kind, node_id, node["class_type"], node_title(node), index,
                                   len(self.order), **extra))

    def describe_failure(self, exc: BaseException) -> RunError:
        """A RunError naming the node; the exception's frames are cleared so that their local
        variables (tensors, models) are freed with the run."""
        details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        _clear_frames(exc)
        node_id = self.current[0] if self.current else None
        class_type = self.nodes[node_id]["class_type"] if node_id else None
        title = node_title(self.nodes[node_id]) if node_id else None
        if isinstance(exc, _InterruptCheck):
            return RunInterrupted(f"interrupted before node {self._next_node()} ran",
                                  details=details)
        if _is_interrupt(exc):
            return RunInterrupted("interrupted", node_id, class_type, title, details)
        message = f"{type(exc).__name__}: {exc}"
        return RunError(message, node_id, class_type, title, details)

    def _next_node(self) -> str:
        done = len(self.node_seconds)
        if done < len(self.order):
            node_id = self.order[done]
            return f"{node_id} ({self.nodes[node_id]['class_type']})"
        return "?"

    def drop_everything(self) -> None:
        self.values.clear()
        self.current = None


async def _awaited(awaitable):
    return await awaitable


def _split_result(result: Any, cls) -> tuple[tuple, Any]:
    """(output values, ui) from a tuple or {"ui": ..., "result": ...}."""
    returns = tuple(getattr(cls, "RETURN_TYPES", ()))
    ui = None
    if isinstance(result, dict):
        if "expand" in result:
            raise TypeError("returned a node expansion (\"expand\"), which the in-process runner "
                            "does not support; run the workflow through ComfyUI with --server")
        ui = result.get("ui")
        result = result.get("result", ())
    if result is None:
        result = ()
    if not isinstance(result, (tuple, list)):
        raise TypeError(f"returned {type(result).__name__}; expected a tuple with one value "
                        f"per RETURN_TYPES entry {returns}")
    if len(result) < len(returns):
        raise TypeError(f"returned {len(result)} value(s); RETURN_TYPES declares "
                        f"{len(returns)} {returns}")
    return tuple(result), ui


def _is_interrupt(exc: BaseException) -> bool:
    return isinstance(exc, (host.Interrupted, KeyboardInterrupt)) or \
        type(exc).__name__ == "InterruptProcessingException"


def _clear_frames(exc: BaseException) -> None:
    """Clear the local variables of every finished frame the exception (and its causes) keeps."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def check_supported(validated: ValidatedWorkflow, registry: Registry) -> None:
    """Refuse, before anything runs, node features of ComfyUI's executor this runner leaves
    out (raises WorkflowError)."""
    issues = []
    for node_id in validated.order:
        node = validated.nodes[node_id]
        cls = registry[node["class_type"]]
        where = dict(node_id=node_id, class_type=node["class_type"], title=node_title(node))
        if getattr(cls, "INPUT_IS_LIST", False) or any(getattr(cls, "OUTPUT_IS_LIST", ())):
            issues.append(Issue("uses list processing (INPUT_IS_LIST / OUTPUT_IS_LIST), which "
                                "the in-process runner does not support; run the workflow "
                                "through ComfyUI with --server", **where))
        function = getattr(cls, "FUNCTION", None)
        if not isinstance(function, str) or not callable(getattr(cls, function, None)):
            issues.append(Issue(f"the node class has no method named by FUNCTION ({function!r})",
                                **where))
    if issues:
        raise WorkflowError(issues)


# -- output files ------------------------------------------------------------------------------

def ui_file_entries(outputs: Mapping[str, Mapping]) -> list[dict]:
    """Every {filename, subfolder, type} entry in the ui dicts, under any key ("images", "gifs",
    "videos", ...), in node order, without duplicates."""
    entries, seen = [], set()
    for node_id in outputs:
        ui = outputs[node_id]
        if not isinstance(ui, Mapping):
            continue
        for value in ui.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, Mapping) and isinstance(item.get("filename"), str):
                    entry = {"filename": item["filename"],
                             "subfolder": str(item.get("subfolder") or ""),
                             "type": str(item.get("type") or "output")}
                    key = (entry["filename"], entry["subfolder"], entry["type"])
                    if key not in seen:
                        seen.add(key)
                        entries.append(entry)
    return entries


def local_output_files(outputs: Mapping[str, Mapping]) -> list[Path]:
    """Paths of the "output"-type files the ui dicts name, in the host's output folder."""
    root = host.output_directory()
    return [root / e["subfolder"] / e["filename"] for e in ui_file_entries(outputs)
            if e["type"] == "output"]


# -- memory peaks ------------------------------------------------------------------------------

class _PeakMeter:
    """Peak CUDA memory and peak RSS from the start of a run.

    The memory event log (profiling/events.py) owns torch's peak counters and resets them at
    every event, so the run's CUDA peak is the larger of the counters at the end and the peaks
    of the events recorded during the run."""

    def __init__(self):
        if _cuda_in_use():
            torch.cuda.reset_peak_memory_stats()
        self.rss_reset = reset_rss_peak()
        self.log, self.next_event = _event_log_position()

    def read(self) -> MemoryPeak:
        allocated = reserved = None
        if _cuda_in_use():  # also when a node initialised CUDA during the run
            allocated = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
        for event in _events_since(self.log, self.next_event):
            allocated = _larger(allocated, event.get("peak_allocated_bytes"))
            reserved = _larger(reserved, event.get("peak_reserved_bytes"))
        return MemoryPeak(allocated, reserved, rss_peak(), not self.rss_reset)


def _event_log_position():
    """(the current memory event log, the index its next event will get), or (None, 0)."""
    try:
        from ..profiling import events
        log = events.current_log()
        recorded = log.events
        return log, (recorded[-1]["index"] + 1 if recorded else 0)
    except Exception:  # the event log is optional to this measurement
        return None, 0


def _events_since(log, first_index: int) -> list[dict]:
    try:
        from ..profiling import events
        current = events.current_log()
    except Exception:
        return []
    floor = first_index if current is log else 0  # a node may have begun a new log
    return [e for e in current.events if isinstance(e, dict) and e.get("index", -1) >= floor]


def _larger(a: int | None, b) -> int | None:
    if not isinstance(b, int):
        return a
    return b if a is None else max(a, b)


def _cuda_in_use() -> bool:
    # is_initialized: never create a CUDA context just to measure a CPU run
    return torch.cuda.is_available() and torch.cuda.is_initialized()
