"""GPU activity monitor: sampling rate, summary math, CPU fallback, bounded memory, clean stop,
and the trace saved in the event log. NVML is a fake module: no driver is ever called."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import types

import pytest

from wan_enhanced.profiling import activity as activity_module
from wan_enhanced.profiling.activity import (
    DEFAULT_INTERVAL_S, ActivityMonitor, DecimatingBuffer, RunningStats, summarize)
from wan_enhanced.profiling.events import EventLog

GIB = 1 << 30


class FakeNvml(types.ModuleType):
    """pynvml with fixed readings; `fail` maps a field to the call number from which it raises."""

    NVML_CLOCK_SM = 1

    def __init__(self, sm=40, used=3 * GIB, power_mw=250_000, clock=1755, fail=None):
        super().__init__("pynvml")
        self.readings = {"sm": sm, "used": used, "power": power_mw, "clock": clock}
        self.fail = fail or {}
        self.calls = {"init": 0, "shutdown": 0, "sm": 0, "used": 0, "power": 0, "clock": 0}

    def _read(self, field):
        self.calls[field] += 1
        if field in self.fail and self.calls[field] >= self.fail[field]:
            raise RuntimeError(f"NVML {field} failed")
        return self.readings[field]

    def nvmlInit(self):
        self.calls["init"] += 1

    def nvmlShutdown(self):
        self.calls["shutdown"] += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", uuid)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self._read("sm"), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self._read("used"), total=80 * GIB)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._read("power")

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return self._read("clock")


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """No real NVML, and the once-per-process fallback warning not yet given."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(activity_module, "_fallback_warned", False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def install(monkeypatch, fake: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def run_for(monitor: ActivityMonitor, seconds: float) -> dict:
    with monitor:
        time.sleep(seconds)
    return monitor.result()


def test_nvml_samples_at_least_ten_per_second(monkeypatch):
    assert DEFAULT_INTERVAL_S <= 0.1
    install(monkeypatch, FakeNvml())
    result = run_for(ActivityMonitor(device=0), 0.5)
    assert result["source"] == "nvml" and result["device"] == "cuda:0"
    assert result["reason"] is None and result["error"] is None
    samples = result["samples"]
    span = samples[-1]["monotonic"] - samples[0]["monotonic"]
    assert (len(samples) - 1) / span >= 10
    assert result["summary"]["samples"] / result["summary"]["duration_s"] >= 10
    times = [s["monotonic"] for s in samples]
    assert times == sorted(times)
    assert samples[0] == {"monotonic": samples[0]["monotonic"], "sm_activity": 40.0,
                          "memory_used_bytes": 3 * GIB, "power_w": 250.0,
                          "sm_clock_mhz": 1755.0}


def test_summary_math():
    stats = RunningStats(["sm_activity", "memory_used_bytes", "power_w", "sm_clock_mhz"])
    for sm, used, power in [(0, 1 * GIB, 100.0), (50, 5 * GIB, 300.0), (100, 2 * GIB, 200.0)]:
        stats.add({"sm_activity": sm, "memory_used_bytes": used, "power_w": power,
                   "sm_clock_mhz": None})
    summary = summarize("nvml", stats, samples=3, duration_s=4.0)
    assert summary["mean_sm_activity"] == 50.0
    assert summary["compute_load"] == 4.0 * 50.0 / 100 == 2.0  # GPU-seconds
    assert summary["max_memory_used_bytes"] == 5 * GIB
    assert summary["mean_power_w"] == 200.0 and summary["max_power_w"] == 300.0
    assert summary["mean_sm_clock_mhz"] is None  # no readings: null, not zero
    assert summary["duration_s"] == 4.0 and summary["samples"] == 3


def test_monitor_summary_is_duration_times_mean_activity(monkeypatch):
    install(monkeypatch, FakeNvml(sm=40))
    summary = run_for(ActivityMonitor(interval_s=0.02, device=0), 0.2)["summary"]
    assert summary["mean_sm_activity"] == 40.0
    assert summary["compute_load"] == pytest.approx(summary["duration_s"] * 0.40)
    assert 0.2 <= summary["duration_s"] < 1.0
    assert summary["max_power_w"] == 250.0 and summary["max_sm_clock_mhz"] == 1755.0


def test_without_nvml_it_records_the_cpu_and_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger=activity_module.__name__):
        first = run_for(ActivityMonitor(device=0), 0.3)
        second = run_for(ActivityMonitor(device=0), 0.1)
    warnings = [r for r in caplog.records if "CPU" in r.getMessage()]
    assert len(warnings) == 1
    assert "pynvml is not installed" in warnings[0].getMessage()
    for result in (first, second):
        assert result["source"] == "cpu" and result["device"] is None
        assert "pynvml" in result["reason"]
    samples = first["samples"]
    assert set(samples[0]) == {"monotonic", "cpu_percent", "rss_bytes"}
    assert samples[0]["cpu_percent"] is None  # its interval is too short to mean anything
    assert all(s["rss_bytes"] > 0 and 0 <= s["cpu_percent"] <= 100 for s in samples[1:])
    assert (len(samples) - 1) / (samples[-1]["monotonic"] - samples[0]["monotonic"]) >= 10
    summary = first["summary"]
    assert summary["mean_sm_activity"] is None and summary["compute_load"] is None
    assert summary["max_rss_bytes"] == max(s["rss_bytes"] for s in samples)


def test_without_a_gpu_or_a_working_driver_it_falls_back(monkeypatch):
    fake = install(monkeypatch, FakeNvml())
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert run_for(ActivityMonitor(), 0.05)["reason"] == "no CUDA device"

    def broken_init():
        raise RuntimeError("driver not loaded")

    fake.nvmlInit = broken_init
    result = run_for(ActivityMonitor(device=0), 0.05)
    assert result["source"] == "cpu" and "driver not loaded" in result["reason"]


def test_fields_the_device_lacks_are_null(monkeypatch):
    install(monkeypatch, FakeNvml(fail={"power": 1}))  # power fails from the first call
    result = run_for(ActivityMonitor(interval_s=0.02, device=0), 0.1)
    assert result["unsupported"] == ["power_w"] and result["error"] is None
    assert all(s["power_w"] is None and s["sm_activity"] == 40.0 for s in result["samples"])
    assert result["summary"]["mean_power_w"] is None


def test_decimating_buffer_stays_bounded_and_even():
    buffer = DecimatingBuffer(10)
    for number in range(1000):
        buffer.add(number)
        assert len(buffer) < 10
    items = buffer.items()
    assert items[0] == 0 and buffer.added == 1000
    steps = {b - a for a, b in zip(items, items[1:])}
    assert steps == {buffer.kept_every}  # evenly spread over the whole run
    assert 999 - items[-1] < 2 * buffer.kept_every  # up to the end of the run


def test_monitor_memory_is_bounded_but_the_summary_counts_every_sample(monkeypatch):
    install(monkeypatch, FakeNvml())
    result = run_for(ActivityMonitor(interval_s=0.002, device=0, max_samples=8), 0.2)
    assert len(result["samples"]) < 8
    assert result["samples_taken"] > 8 and result["kept_every"] > 1
    assert result["summary"]["samples"] == result["samples_taken"]


def test_stop_is_clean(monkeypatch):
    fake = install(monkeypatch, FakeNvml())
    before = threading.active_count()
    monitor = ActivityMonitor(interval_s=0.01, device=0).start()
    assert monitor.running
    time.sleep(0.05)
    result = monitor.stop()
    assert not monitor.running and threading.active_count() == before
    taken = result["samples_taken"]
    time.sleep(0.05)
    assert monitor.result()["samples_taken"] == taken  # nothing after stop
    assert monitor.stop()["samples_taken"] == taken  # a second stop is harmless
    assert fake.calls["init"] == fake.calls["shutdown"] == 1
    assert result["stopped_monotonic"] >= result["started_monotonic"]
    with pytest.raises(RuntimeError, match="runs once"):
        monitor.start()


def test_leaving_the_block_by_an_exception_stops_it(monkeypatch):
    install(monkeypatch, FakeNvml())
    monitor = ActivityMonitor(interval_s=0.01, device=0)
    with pytest.raises(KeyError):
        with monitor:
            raise KeyError("the run failed")
    assert not monitor.running and monitor.result()["stopped_monotonic"] is not None


def test_a_sampling_error_stops_sampling_and_is_reported_once(monkeypatch, caplog):
    install(monkeypatch, FakeNvml(fail={"sm": 4}))  # the start probe is call 1
    with caplog.at_level(logging.WARNING, logger=activity_module.__name__):
        monitor = ActivityMonitor(interval_s=0.01, device=0).start()
        time.sleep(0.1)
        assert not monitor.running  # the thread ended by itself, raising nothing
        result = monitor.stop()
    assert result["error"] == "RuntimeError: NVML sm failed"
    assert len(result["samples"]) == 2  # what came before the error is kept
    assert len([r for r in caplog.records if "stopped sampling" in r.getMessage()]) == 1


def test_the_trace_is_saved_under_activity_in_the_event_log(monkeypatch, tmp_path):
    install(monkeypatch, FakeNvml())
    log = EventLog(tmp_path / "log.json")
    log.record("before", stage="load")
    trace = run_for(ActivityMonitor(interval_s=0.02, device=0), 0.1)
    log.attach_activity(trace)
    path = log.save()
    data = json.loads(path.read_text())
    assert list(data)[:3] == ["schema", "run", "events"]  # the existing keys, unchanged
    assert data["activity"] == json.loads(json.dumps(trace))
    assert data["events"][0]["label"] == "before"
    lines = path.read_text().splitlines()
    assert sum('"sm_activity"' in line for line in lines) == len(trace["samples"])  # one a line
    assert EventLog.load(path).to_dict()["activity"] == data["activity"]
    with pytest.raises(ValueError, match="ActivityMonitor result"):
        log.attach_activity([1, 2])


def test_a_log_without_activity_has_no_activity_key(tmp_path):
    log = EventLog(tmp_path / "log.json")
    assert "activity" not in json.loads(log.save().read_text())
