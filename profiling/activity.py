"""A background GPU activity monitor: SM activity, memory, power and SM clock through NVML.

    with ActivityMonitor() as monitor:      # samples every 0.05 s (20 Hz) in its own thread
        run_the_workflow()
    log.attach_activity(monitor.result())   # saved under the event log's "activity" key

NVML comes from the optional package nvidia-ml-py (`pip install comfyui-wan-enhanced[nvml]`).
Without it, without a GPU, or when NVML fails to start, the monitor logs one warning per process
and records the CPU side instead (system CPU utilisation and this process's RSS) at the same rate.

Bounded memory by decimation: at most `max_samples` samples are kept, spread evenly over the whole
run. When the buffer fills, every second stored sample is dropped and from then on only every
second new one is kept (then every fourth, …). The summary does not depend on it: it is
accumulated over every sample taken.

The sampling thread never raises: an error stops sampling, is logged once, and is reported in the
result's "error" field; what was sampled until then is kept.

Result (the event log's "activity" object):

    {
      "source": "nvml" | "cpu",
      "device": "cuda:0" | null,
      "reason": null | "pynvml is not installed …",   why the CPU side was recorded instead
      "unsupported": ["power_w", …],                  NVML fields this device does not report
      "interval_s": 0.05,
      "started_monotonic": …, "stopped_monotonic": … | null,   time.monotonic(), as events
      "max_samples": 20000, "samples_taken": 1234, "kept_every": 1,   decimation state
      "error": null | "NVMLError: …",
      "summary": {
        "duration_s": …,                  monitored time, start to stop
        "samples": 1234,                  samples taken (all of them, kept or not)
        "mean_sm_activity": 63.5 | null,  mean utilization.gpu, percent
        "compute_load": 12.7 | null,      duration_s * mean_sm_activity / 100, GPU-seconds
        "max_memory_used_bytes": …,       NVML (device, every process)
        "mean_power_w": …, "max_power_w": …,
        "mean_sm_clock_mhz": …, "max_sm_clock_mhz": …
        -- or, for the CPU source --
        "mean_cpu_percent": …, "max_cpu_percent": …, "max_rss_bytes": …
      },
      "samples": [
        {"monotonic": …, "sm_activity": %, "memory_used_bytes": …, "power_w": …,
         "sm_clock_mhz": …}                              NVML
        {"monotonic": …, "cpu_percent": %, "rss_bytes": …}   CPU
      ]
    }

Fields the device cannot report are null in every sample and in the summary; so is the CPU
source's first cpu_percent (its interval is too short to mean anything).
"""

from __future__ import annotations

import logging
import threading
import time

from .activity_sources import CpuSource, NvmlSource, SourceUnavailable

DEFAULT_INTERVAL_S = 0.05
DEFAULT_MAX_SAMPLES = 20_000  # ~17 minutes at 20 Hz before the first decimation, ~3 MB of JSON

logger = logging.getLogger(__name__)

_fallback_warned = False
_fallback_lock = threading.Lock()


class DecimatingBuffer:
    """At most `capacity` items, spread evenly over everything added."""

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self.capacity = capacity
        self.kept_every = 1
        self.added = 0
        self._items: list = []

    def add(self, item) -> None:
        # Kept items are always those whose position is a multiple of kept_every, so halving
        # (dropping every second kept item) keeps the spacing even.
        if self.added % self.kept_every == 0:
            self._items.append(item)
            if len(self._items) >= self.capacity:
                del self._items[1::2]
                self.kept_every *= 2
        self.added += 1

    def items(self) -> list:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


class RunningStats:
    """Count, sum, min and max of each field, over every sample (nulls skipped)."""

    def __init__(self, fields):
        self._stats = {name: [0, 0.0, None, None] for name in fields}

    def add(self, sample: dict) -> None:
        for name, entry in self._stats.items():
            value = sample.get(name)
            if value is None:
                continue
            entry[0] += 1
            entry[1] += value
            entry[2] = value if entry[2] is None else min(entry[2], value)
            entry[3] = value if entry[3] is None else max(entry[3], value)

    def mean(self, name: str) -> float | None:
        count, total, _, _ = self._stats[name]
        return total / count if count else None

    def max(self, name: str):
        return self._stats[name][3]


def summarize(source: str, stats: RunningStats, samples: int, duration_s: float) -> dict:
    """The summary numbers of a monitored interval."""
    summary = {"duration_s": duration_s, "samples": samples}
    if source == "nvml":
        mean_sm = stats.mean("sm_activity")
        summary.update({
            "mean_sm_activity": mean_sm,
            "compute_load": None if mean_sm is None else duration_s * mean_sm / 100.0,
            "max_memory_used_bytes": stats.max("memory_used_bytes"),
            "mean_power_w": stats.mean("power_w"), "max_power_w": stats.max("power_w"),
            "mean_sm_clock_mhz": stats.mean("sm_clock_mhz"),
            "max_sm_clock_mhz": stats.max("sm_clock_mhz"),
        })
    else:
        summary.update({
            "mean_sm_activity": None, "compute_load": None,
            "mean_cpu_percent": stats.mean("cpu_percent"),
            "max_cpu_percent": stats.max("cpu_percent"),
            "max_rss_bytes": stats.max("rss_bytes"),
        })
    return summary


class ActivityMonitor:
    """Samples GPU (or CPU) activity in a background thread between `start` and `stop`."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, device=None,
                 max_samples: int = DEFAULT_MAX_SAMPLES):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = float(interval_s)
        self.device = device
        self._buffer = DecimatingBuffer(max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._source = None
        self._stats: RunningStats | None = None
        self.reason: str | None = None
        self.error: str | None = None
        self.started: float | None = None
        self.stopped: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "ActivityMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def source(self) -> str | None:
        return None if self._source is None else self._source.name

    def start(self) -> "ActivityMonitor":
        if self._thread is not None:
            raise RuntimeError("an ActivityMonitor runs once; make a new one for the next run")
        self._source = self._open_source()
        self._stats = RunningStats(self._source.fields)
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True,
                                        name="wan-enhanced-activity")
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling (waits for the thread) and return the result. Safe to call twice."""
        if self._thread is not None and self.stopped is None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 10 * self.interval_s))
            self.stopped = time.monotonic()
            if self._thread.is_alive():  # a driver call hangs: leave it, never block the run
                logger.warning("GPU activity monitor: the sampling thread did not stop")
            else:
                self._source.close()
        return self.result()

    def _open_source(self):
        try:
            return NvmlSource(self.device)
        except SourceUnavailable as exc:
            self.reason = str(exc)
        _warn_fallback_once(self.reason)
        return CpuSource()

    # -- sampling ----------------------------------------------------------------------------

    def _sample_until_stopped(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                sample = self._source.read()
                with self._lock:
                    self._buffer.add(sample)
                    self._stats.add(sample)
            except Exception as exc:  # never out of this thread: stop and say so once
                self.error = f"{type(exc).__name__}: {exc}"
                logger.warning("GPU activity monitor stopped sampling: %s", self.error)
                return
            next_at += self.interval_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (a slow read, a busy machine): no burst to catch up
                next_at, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    # -- results -----------------------------------------------------------------------------

    def result(self) -> dict:
        """The samples and summary so far (a copy; callable while running)."""
        if self._source is None:
            raise RuntimeError("the ActivityMonitor was never started")
        end = self.stopped if self.stopped is not None else time.monotonic()
        with self._lock:
            samples = self._buffer.items()
            taken, kept_every = self._buffer.added, self._buffer.kept_every
            summary = summarize(self._source.name, self._stats, taken, end - self.started)
        return {
            "source": self._source.name, "device": self._source.device, "reason": self.reason,
            "unsupported": list(self._source.unsupported), "interval_s": self.interval_s,
            "started_monotonic": self.started, "stopped_monotonic": self.stopped,
            "max_samples": self._buffer.capacity, "samples_taken": taken,
            "kept_every": kept_every, "error": self.error, "summary": summary,
            "samples": samples,
        }


def _warn_fallback_once(reason: str) -> None:
    global _fallback_warned
    with _fallback_lock:
        if _fallback_warned:
            return
        _fallback_warned = True
    logger.warning("GPU activity monitor: %s; recording CPU utilisation and process RSS "
                   "instead", reason)


__all__ = ["ActivityMonitor", "DecimatingBuffer", "RunningStats", "summarize",
           "DEFAULT_INTERVAL_S", "DEFAULT_MAX_SAMPLES"]
