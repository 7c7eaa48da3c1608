"""The memory event log: one JSON file per run, one event per point of interest.

Nodes record events through the current log (`record_event("vae decode done", stage="decode",
node="12")`); the memory probe node and the reports read the saved file. A run is one prompt:
inside ComfyUI (and in our runner) the first event of a new prompt begins a new log carrying the
prompt's id, so a long-running server keeps no log across prompts.

File schema "wan-enhanced-memory-events/1":

    {
      "schema": "wan-enhanced-memory-events/1",
      "run": {
        "id": "20250101-120000-1a2b3c",     sortable, unique per run
        "prompt_id": "6f1c…" | null,        the ComfyUI prompt (or our runner's run) it records
        "started": 1735732800.0,            time.time() when the log began (same clock as events)
        "started_iso": "2025-01-01T12:00:00+00:00",
        "host": {
          "python": "3.12.3", "torch": "2.6.0", "cuda": "12.4" | null,
          "platform": "Linux-…", "pid": 1234,
          "device": "cuda:0" | null, "device_name": "NVIDIA H100 80GB HBM3" | null,
          "device_total_bytes": 85045231616 | null,   total VRAM
          "ram_total_bytes": 135000000000             total RAM
        },
        "initial": {snapshot fields},        the counters when the log began: the baseline
        "max_events": 100000,               the log keeps at most this many events
        "dropped_events": 0                 events dropped (the oldest first) once full
      },
      "events": [
        {
          "index": 0,                       0, 1, 2, … in recording order; a gap after drops
          "label": "sampler start", "stage": "sample", "node": "7",   free text, "" if unset
          "extra": {…} | null,              caller data, stored as JSON (other objects as str)
          "time": …, "monotonic": …, "device": "cuda:0" | null,
          "cuda_allocated_bytes": int | null, "cuda_reserved_bytes": int | null,
          "cuda_max_allocated_bytes": int | null, "cuda_max_reserved_bytes": int | null,
          "rss_bytes": int,
          "nvml_used_bytes": int | null, "nvml_total_bytes": int | null,
          "peak_allocated_bytes": int | null,  torch peak allocated since the previous event
          "peak_reserved_bytes": int | null    (or since the log began, for the first event)
        }
      ],
      "activity": {…}                       only when a GPU activity trace was attached
                                            (attach_activity); its schema is in activity.py
    }

All sizes are bytes; null means "not measurable here" (no CUDA, no NVML). The snapshot fields
are described in profiling/snapshot.py.

Peaks: the log owns torch's peak counters. After each event it calls
torch.cuda.reset_peak_memory_stats, so an event's peak covers exactly the interval since the
previous event; code that measures peaks itself should read them from the events instead.

Extras the nodes record: loaders {"component": "dit" | "text_encoder" | "clip_vision" | "vae",
"bytes": the module's parameter and buffer bytes (what it occupies when placed), "dtype":
"bfloat16" | …, "file": the checkpoint's name}; sampling steps {"step": i}. A sampler run over
several GPUs adds one event per rank (stage "ranks", label "rank N") whose extra holds that
rank's metrics (distributed/metrics.py: "rank", "device", "request_total_seconds",
"compute_seconds", "all_to_all_seconds" / "_bytes", "ring_seconds" / "_bytes",
"reserved_peak_bytes", …) and the run's "gpus", "fsdp" and "cfg_parallel".

Compatibility: readers ignore keys they do not know; new keys ("run.initial", "activity", …)
are added without changing the version. The version changes only when an existing key changes
meaning.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import platform
import secrets
import threading
from pathlib import Path

import psutil
import torch

from .. import host
from ..atomic_files import write_atomically
from ..gpu_support import triton_version
from .snapshot import NVML, cuda_index, reset_cuda_peaks, take_snapshot

SCHEMA = "wan-enhanced-memory-events/1"
DEFAULT_MAX_EVENTS = 100_000
LOG_FOLDER = "wan_memory"  # inside the output folder

logger = logging.getLogger(__name__)


class EventLog:
    """Memory events of one run. Appends are thread-safe; at most `max_events` are kept."""

    def __init__(self, path: str | Path | None = None, max_events: int = DEFAULT_MAX_EVENTS,
                 device=None, prompt_id: str | None = None):
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        self._lock = threading.Lock()
        self._events: collections.deque[dict] = collections.deque(maxlen=max_events)
        self._next_index = 0
        self.dropped_events = 0
        self.max_events = max_events
        self.device = device
        self.activity: dict | None = None
        started = datetime.datetime.now(datetime.timezone.utc)
        self.run = {
            "id": started.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3),
            "prompt_id": prompt_id,
            "started": started.timestamp(),
            "started_iso": started.isoformat(timespec="seconds"),
            "host": host_info(device),
            "initial": take_snapshot(device),
        }
        self.path = Path(path) if path is not None else default_log_path(self.run["id"])
        reset_cuda_peaks(cuda_index(device))  # the first event's peak starts here

    # -- recording ---------------------------------------------------------------------------

    def record(self, label: str, stage: str = "", node: str = "", extra=None) -> dict:
        """Append an event: a snapshot, the torch peak since the previous event, and labels."""
        extra = _as_json(extra)
        with self._lock:
            # Snapshot and reset under the lock so two threads' intervals never overlap.
            index = cuda_index(self.device)
            snapshot = take_snapshot(self.device)
            reset_cuda_peaks(index)
            event = {"index": self._next_index, "label": str(label), "stage": str(stage),
                     "node": str(node), "extra": extra, **snapshot,
                     "peak_allocated_bytes": snapshot["cuda_max_allocated_bytes"],
                     "peak_reserved_bytes": snapshot["cuda_max_reserved_bytes"]}
            self._next_index += 1
            if len(self._events) == self.max_events:
                self._note_drop()
            self._events.append(event)
        return dict(event)  # the caller's copy: changing it leaves the log as recorded

    def _note_drop(self) -> None:
        if self.dropped_events == 0:
            logger.warning("memory event log %s is full (%d events): dropping the oldest events",
                           self.run["id"], self.max_events)
        self.dropped_events += 1

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return [dict(event) for event in self._events]

    def __len__(self) -> int:
        return len(self._events)

    def attach_activity(self, activity: dict) -> None:
        """Keep a GPU activity trace (ActivityMonitor.result()) with the log: it is saved under
        the top-level key "activity". Attaching again replaces the previous trace."""
        if not isinstance(activity, dict) or "source" not in activity:
            raise ValueError("attach_activity takes an ActivityMonitor result (a dict with "
                             f"'source', 'samples' and 'summary'), got {type(activity).__name__}")
        activity = _as_json(activity)
        with self._lock:
            self.activity = activity

    # -- files -------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        with self._lock:
            events = list(self._events)
            run = {**self.run, "max_events": self.max_events,
                   "dropped_events": self.dropped_events}
            activity = self.activity
        if run["host"].get("device_name") is None:
            run["host"] = host_info(self.device)  # CUDA may have come up since the log began
        data = {"schema": SCHEMA, "run": run, "events": events}
        if activity is not None:
            data["activity"] = activity
        return data

    def save(self, path: str | Path | None = None) -> Path:
        """Write the log as JSON, atomically: readers see the previous file or the new one,
        never a partial one. Missing folders are created. Returns the path written."""
        path = Path(path) if path is not None else self.path
        _write_atomically(path, _dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "EventLog":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        schema = data.get("schema", "") if isinstance(data, dict) else ""
        if schema.rpartition("/")[0] != SCHEMA.rpartition("/")[0]:
            raise ValueError(f"{path} is not a memory event log (schema {schema!r})")
        if schema != SCHEMA:
            raise ValueError(f"{path} uses {schema}; this version reads {SCHEMA}")
        run = dict(data["run"])
        log = cls.__new__(cls)
        log._lock = threading.Lock()
        log.max_events = int(run.pop("max_events", DEFAULT_MAX_EVENTS))
        log.dropped_events = int(run.pop("dropped_events", 0))
        log._events = collections.deque(data["events"], maxlen=max(log.max_events, 1))
        log._next_index = log._events[-1]["index"] + 1 if log._events else 0
        log.device = None
        log.activity = data.get("activity")
        log.run = run
        log.path = Path(path)
        return log


# -- the process-wide current log --------------------------------------------------------------

_current: EventLog | None = None
_current_lock = threading.Lock()


def current_log() -> EventLog:
    """The log nodes record into: the current prompt's (host.current_prompt_id). A prompt other
    than the log's begins a new log with its id; a log begun by start_run that is still empty
    takes the prompt's id instead; outside any prompt the log made on first use is kept."""
    global _current
    prompt_id = host.current_prompt_id()
    with _current_lock:
        log = _current
        if log is None:
            log = _current = EventLog(prompt_id=prompt_id)
        elif prompt_id is not None and log.run.get("prompt_id") != prompt_id:
            if log.run.get("prompt_id") is None and len(log) == 0:
                log.run["prompt_id"] = prompt_id
            else:
                log = _current = EventLog(prompt_id=prompt_id)
        return log


def start_run(path: str | Path | None = None, max_events: int = DEFAULT_MAX_EVENTS,
              device=None) -> EventLog:
    """Begin a new log (a new run) and make it the current one. The previous log is left as it
    is: save it first if it matters."""
    global _current
    log = EventLog(path, max_events=max_events, device=device)
    with _current_lock:
        _current = log
    return log


def record_event(label: str, stage: str = "", node: str = "", extra=None) -> dict:
    return current_log().record(label, stage=stage, node=node, extra=extra)


# -- helpers -----------------------------------------------------------------------------------

def default_log_path(run_id: str) -> Path:
    return host.output_directory() / LOG_FOLDER / f"{run_id}.json"


def host_info(device=None) -> dict:
    index = cuda_index(device)
    name, total = None, None
    try:
        if index is not None and torch.cuda.is_initialized():
            name = torch.cuda.get_device_name(index)
            total = int(torch.cuda.get_device_properties(index).total_memory)
    except Exception:
        pass
    if name is None and index is not None:  # before CUDA is up, ask the driver instead
        name = NVML.device_name(index)
        total = NVML.memory(index)["nvml_total_bytes"]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version(),  # what builds our kernels (they build differently per release)
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "pid": os.getpid(),
        "device": None if index is None else f"cuda:{index}",
        "device_name": name,
        "device_total_bytes": total,
        "ram_total_bytes": psutil.virtual_memory().total,
    }


def _as_json(value):
    """A JSON copy of caller data: checked now, not at save time, and detached from the caller."""
    if value is None:
        return None
    return json.loads(json.dumps(value, default=str))


def _dumps(data: dict) -> str:
    """Readable and compact: the header indented, one event (and one activity sample) per
    line."""
    head = json.dumps({k: v for k, v in data.items() if k not in ("events", "activity")},
                      indent=2)
    parts = [head[:-2], _one_per_line("events", data["events"], "  ")]
    if "activity" in data:
        activity = data["activity"]
        fields = [f'    {json.dumps(k)}: {json.dumps(v)}' for k, v in activity.items()
                  if k != "samples"]
        fields.append(_one_per_line("samples", activity.get("samples") or [], "    "))
        parts.append('  "activity": {\n' + ",\n".join(fields) + "\n  }")
    return ",\n".join(parts) + "\n}\n"


def _one_per_line(key: str, items: list, indent: str) -> str:
    if not items:
        return f'{indent}"{key}": []'
    lines = ",\n".join(f"{indent}  " + json.dumps(item) for item in items)
    return f'{indent}"{key}": [\n{lines}\n{indent}]'


def _write_atomically(path: Path, text: str) -> None:
    write_atomically(path, text.encode("utf-8"), "the memory event log")


__all__ = ["SCHEMA", "DEFAULT_MAX_EVENTS", "EventLog", "current_log", "start_run",
           "record_event", "default_log_path", "host_info"]
