"""Memory event log: snapshot fields, peak intervals, bounds, threads, JSON files, NVML."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import types

import pytest
import torch

from wan_enhanced import gpu_support, host
from wan_enhanced.profiling import events as events_module
from wan_enhanced.profiling import snapshot as snapshot_module
from wan_enhanced.profiling.events import (
    SCHEMA, EventLog, current_log, record_event, start_run)
from wan_enhanced.profiling.snapshot import SNAPSHOT_FIELDS, NvmlReader, take_snapshot

MiB = 1 << 20
CUDA_FIELDS = ("cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_max_allocated_bytes",
               "cuda_max_reserved_bytes")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(autouse=True)
def fresh_nvml(monkeypatch):
    """Each test starts with NVML not yet initialised (and no real driver calls)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(snapshot_module, "NVML", NvmlReader())
    monkeypatch.setattr(events_module, "NVML", snapshot_module.NVML)


class FakeAllocator:
    """torch.cuda's counters for one device, with peaks that reset like the real ones."""

    def __init__(self):
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.resets = []

    def allocate(self, size):
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_reserved = max(self.max_reserved, self.reserved)

    def free(self, size):
        self.allocated -= size

    def reset_peaks(self, device=None):
        self.resets.append(device)
        self.max_allocated, self.max_reserved = self.allocated, self.reserved


@pytest.fixture
def fake_cuda(monkeypatch):
    gpu = FakeAllocator()
    fakes = {
        "is_available": lambda: True, "is_initialized": lambda: True,
        "current_device": lambda: 0,
        "memory_allocated": lambda device=None: gpu.allocated,
        "memory_reserved": lambda device=None: gpu.reserved,
        "max_memory_allocated": lambda device=None: gpu.max_allocated,
        "max_memory_reserved": lambda device=None: gpu.max_reserved,
        "reset_peak_memory_stats": gpu.reset_peaks,
        "get_device_name": lambda device=None: "Fake GPU",
        "get_device_properties": lambda device=None: types.SimpleNamespace(
            total_memory=80 << 30, uuid="1234-abcd"),
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    return gpu


def fake_pynvml(used=3 << 30, total=80 << 30, init_error=None):
    calls = {"init": 0, "by_uuid": [], "by_index": []}

    def init():
        calls["init"] += 1
        if init_error is not None:
            raise init_error

    module = types.ModuleType("pynvml")
    module.calls = calls
    module.nvmlInit = init
    module.nvmlDeviceGetHandleByUUID = lambda uuid: calls["by_uuid"].append(uuid) or "handle"
    module.nvmlDeviceGetHandleByIndex = lambda index: calls["by_index"].append(index) or "handle"
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=used, total=total)
    module.nvmlDeviceGetName = lambda handle: b"Fake GPU"
    return module


# -- snapshots and events ----------------------------------------------------------------------

def test_event_fields_present_and_typed(tmp_path, no_cuda):
    log = EventLog(tmp_path / "log.json")
    event = log.record("decode done", stage="decode", node="12", extra={"tiles": 4})
    for name in SNAPSHOT_FIELDS + ("index", "label", "stage", "node", "extra",
                                   "peak_allocated_bytes", "peak_reserved_bytes"):
        assert name in event, name
    assert (event["index"], event["label"], event["stage"], event["node"]) == \
        (0, "decode done", "decode", "12")
    assert event["extra"] == {"tiles": 4}
    assert isinstance(event["time"], float) and isinstance(event["monotonic"], float)
    assert isinstance(event["rss_bytes"], int) and event["rss_bytes"] > 0
    assert log.record("next")["index"] == 1
    assert log.events[1]["stage"] == "" and log.events[1]["extra"] is None


def test_without_cuda_the_gpu_fields_are_none(tmp_path, no_cuda):
    snapshot = take_snapshot()
    assert snapshot["device"] is None
    for name in CUDA_FIELDS + ("nvml_used_bytes", "nvml_total_bytes"):
        assert snapshot[name] is None, name
    event = EventLog(tmp_path / "log.json").record("x")
    assert event["peak_allocated_bytes"] is None and event["peak_reserved_bytes"] is None
    assert take_snapshot("cpu")["cuda_allocated_bytes"] is None
    info = EventLog(tmp_path / "log.json").run["host"]
    assert info["device"] is None and info["device_total_bytes"] is None
    assert info["ram_total_bytes"] > 0 and info["torch"] == torch.__version__
    assert info["triton"] == gpu_support.triton_version()


def test_each_event_peak_covers_the_interval_since_the_previous_one(tmp_path, fake_cuda):
    gpu = fake_cuda
    gpu.allocate(500 * MiB)
    gpu.free(500 * MiB)  # a peak from before the run: not ours
    log = EventLog(tmp_path / "log.json")
    gpu.allocate(1000 * MiB)
    gpu.free(1000 * MiB)
    first = log.record("after a transient")
    second = log.record("nothing happened")
    gpu.allocate(300 * MiB)
    third = log.record("holding 300 MiB")

    assert first["cuda_allocated_bytes"] == 0
    assert first["peak_allocated_bytes"] == 1000 * MiB
    assert second["peak_allocated_bytes"] == 0
    assert third["peak_allocated_bytes"] == third["cuda_allocated_bytes"] == 300 * MiB
    assert third["peak_reserved_bytes"] == third["cuda_reserved_bytes"] == 1000 * MiB
    assert gpu.resets == [0, 0, 0, 0]  # once when the log began, once per event
    assert first["device"] == "cuda:0"
    assert log.run["host"]["device_name"] == "Fake GPU"
    assert log.run["host"]["device_total_bytes"] == 80 << 30


def test_no_peak_reset_before_cuda_is_initialised(tmp_path, fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    EventLog(tmp_path / "log.json").record("x")
    assert fake_cuda.resets == []  # resetting would create a CUDA context


def test_rss_grows_when_a_big_tensor_is_allocated():
    before = take_snapshot()["rss_bytes"]
    big = torch.ones(96 * MiB // 4)  # written, so its pages are resident
    after = take_snapshot()["rss_bytes"]
    assert after - before > 64 * MiB
    del big


# -- bounds and threads ------------------------------------------------------------------------

def test_a_full_log_drops_the_oldest_events_and_says_so(tmp_path, caplog):
    log = EventLog(tmp_path / "log.json", max_events=3)
    with caplog.at_level(logging.WARNING, logger=events_module.__name__):
        for number in range(5):
            log.record(f"event {number}")
    assert [event["index"] for event in log.events] == [2, 3, 4]
    assert log.dropped_events == 2
    assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1
    saved = json.loads(log.save().read_text())
    assert saved["run"]["dropped_events"] == 2 and saved["run"]["max_events"] == 3


def test_appends_from_many_threads_are_all_kept(tmp_path):
    log = EventLog(tmp_path / "log.json")

    def worker(name):
        for number in range(100):
            log.record(f"{name} {number}", node=name)

    threads = [threading.Thread(target=worker, args=(str(n),)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(event["index"] for event in log.events) == list(range(400))


# -- files -------------------------------------------------------------------------------------

def test_json_round_trip(tmp_path):
    log = EventLog(tmp_path / "runs" / "log.json")  # missing folders are created
    log.record("load", stage="load", node="3", extra={"file": tmp_path, "blocks": [1, 2]})
    log.record("sample", stage="sample")
    path = log.save()
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA == "wan-enhanced-memory-events/1"
    assert set(data["run"]) >= {"id", "started", "host"}
    assert set(data["run"]["host"]) >= {"python", "torch", "device_name", "device_total_bytes",
                                        "ram_total_bytes"}
    assert data["events"][0]["extra"] == {"file": str(tmp_path), "blocks": [1, 2]}

    loaded = EventLog.load(path)
    assert loaded.events == log.events
    assert loaded.run == log.run
    assert loaded.record("after loading")["index"] == 2


def test_load_rejects_other_files(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something-else/1", "events": []}))
    with pytest.raises(ValueError, match="not a memory event log"):
        EventLog.load(other)
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema": "wan-enhanced-memory-events/2", "run": {},
                                 "events": []}))
    with pytest.raises(ValueError, match="/2"):
        EventLog.load(newer)


def test_save_into_a_read_only_folder_raises_and_leaves_nothing(unwritable_folder):
    """Runs as root too: the folder is locked with chattr +i there, or lies below a file."""
    with pytest.raises(OSError, match=unwritable_folder.parent.name):
        EventLog(unwritable_folder / "log.json").save()
    assert not unwritable_folder.exists() or os.listdir(unwritable_folder) == []


def test_save_that_cannot_create_its_file_raises_and_leaves_nothing(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(events_module.os, "open", refuse)
    with pytest.raises(PermissionError, match=str(tmp_path)):
        EventLog(tmp_path / "log.json").save()
    assert os.listdir(tmp_path) == []


def test_save_under_a_file_raises_naming_the_folder(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match="a_file"):
        EventLog(tmp_path / "a_file" / "log.json").save()


def test_a_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    log = EventLog(tmp_path / "log.json")
    log.record("first")
    path = log.save()
    before = path.read_text()
    log.record("second")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(events_module.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        log.save()
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["log.json"]


# -- the current log ---------------------------------------------------------------------------

def test_current_log_api(tmp_path, monkeypatch):
    monkeypatch.setattr(events_module, "_current", None)
    host.set_headless_folders(output=tmp_path)
    try:
        first = current_log()
        assert current_log() is first
        assert first.path.parent == tmp_path / "wan_memory"
        assert first.path.name == f"{first.run['id']}.json"
        run = start_run(tmp_path / "run.json")
        assert current_log() is run and run is not first
        event = record_event("probe", stage="decode", node="9")
        assert run.events == [event] and first.events == []
        assert run.save() == tmp_path / "run.json"
    finally:
        host.set_headless_folders(output="output")


# -- NVML --------------------------------------------------------------------------------------

def test_missing_pynvml_gives_none(fake_cuda):
    snapshot = take_snapshot()
    assert snapshot["nvml_used_bytes"] is None and snapshot["nvml_total_bytes"] is None
    assert snapshot["cuda_allocated_bytes"] == 0  # the torch side still works


def test_pynvml_that_fails_to_initialise_gives_none(fake_cuda, monkeypatch):
    module = fake_pynvml(init_error=RuntimeError("driver not loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    for _ in range(3):
        assert take_snapshot()["nvml_used_bytes"] is None
    assert module.calls["init"] == 1  # a failure is remembered


def test_pynvml_reads_the_current_device_by_uuid(fake_cuda, monkeypatch):
    module = fake_pynvml(used=3 << 30, total=80 << 30)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    for _ in range(3):
        snapshot = take_snapshot()
    assert (snapshot["nvml_used_bytes"], snapshot["nvml_total_bytes"]) == (3 << 30, 80 << 30)
    assert module.calls["init"] == 1
    assert module.calls["by_uuid"] == ["GPU-1234-abcd"]  # looked up once, then cached


def test_pynvml_before_cuda_is_up_follows_cuda_visible_devices(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    module = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert take_snapshot()["nvml_total_bytes"] == 80 << 30
    assert module.calls["by_index"] == [2]
    assert EventLog(None).run["host"]["device_name"] == "Fake GPU"  # named by the driver


def test_each_prompt_gets_a_log_of_its_own_with_its_id(tmp_path, monkeypatch):
    """Inside a long-running ComfyUI the prompt comes from its execution context: a new prompt
    begins a new log; an empty log begun by start_run takes the next prompt; outside a prompt
    the log is kept."""
    monkeypatch.setattr(events_module, "_current", None)
    context = types.SimpleNamespace(prompt_id=None)
    utils = types.SimpleNamespace(
        get_executing_context=lambda: context if context.prompt_id else None)
    monkeypatch.setitem(sys.modules, "comfy_execution", types.SimpleNamespace(utils=utils))
    monkeypatch.setitem(sys.modules, "comfy_execution.utils", utils)
    started = start_run(tmp_path / "bench.json")
    context.prompt_id = "prompt-1"
    record_event("a")
    first = current_log()
    assert first is started and first.run["prompt_id"] == "prompt-1"
    record_event("b")
    context.prompt_id = "prompt-2"
    record_event("c")
    second = current_log()
    assert second is not first and second.run["prompt_id"] == "prompt-2"
    assert [e["label"] for e in first.events] == ["a", "b"]
    assert [e["label"] for e in second.events] == ["c"]
    context.prompt_id = None  # between prompts: the last prompt's log is the current one
    assert current_log() is second
    saved = json.loads(second.save(tmp_path / "p2.json").read_text())
    assert saved["run"]["prompt_id"] == "prompt-2" and len(saved["events"]) == 1


def test_the_runner_gives_each_run_its_own_log(tmp_path, monkeypatch):
    from wan_enhanced import NODE_CLASS_MAPPINGS
    from wan_enhanced.runner.executor import run_workflow

    monkeypatch.setattr(events_module, "_current", None)
    host.set_headless_folders(output=tmp_path)
    workflow = {"1": {"class_type": "WanEnhancedMemoryProbe",
                      "inputs": {"value": 1, "label": "here", "save_log": "run.json"}}}
    try:
        logs = []
        for run_id in ("run-a", "run-b"):
            run_workflow(workflow, NODE_CLASS_MAPPINGS, run_id=run_id)
            logs.append(json.loads((tmp_path / "run.json").read_text()))
    finally:
        host.set_headless_folders(output="output")
    assert [log["run"]["prompt_id"] for log in logs] == ["run-a", "run-b"]
    assert [[e["label"] for e in log["events"]] for log in logs] == [["here"], ["here"]]
    assert host.current_prompt_id() is None
