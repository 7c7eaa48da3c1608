"""Memory reports from synthetic event logs (with and without CUDA, with and without an
activity trace): the numbers in the tables, the PNGs, errors for bad files, the command, the
probe node's write_report, and the loaders' component attribution."""

from __future__ import annotations

import json
import re

import pytest
from PIL import Image

from wan_enhanced import host
from wan_enhanced.checkpoints.tiny import write_models_folder
from wan_enhanced.nodes.loaders import WanModelLoader, WanTextEncoderLoader, WanVAELoader
from wan_enhanced.nodes.memory import WanMemoryProbe
from wan_enhanced.pipeline.placement import tensor_bytes
from wan_enhanced.profiling import events as events_module
from wan_enhanced.profiling.activity import RunningStats, summarize
from wan_enhanced.profiling.events import SCHEMA, start_run
from wan_enhanced.profiling.report import ReportError, build_report
from wan_enhanced.profiling.report_data import (
    component_breakdown, read_log, stage_peaks, step_statistics)
from wan_enhanced.runner.cli import main

GIB = 1 << 30
MIB = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 100.0  # monotonic time when the synthetic log began


def event(label, stage, t, alloc=0.5, peak=None, reserved=None, rss=3.0, extra=None,
          cuda=True):
    """One event; memory in GiB. Without CUDA every torch and NVML field is null."""
    peak = alloc if peak is None else peak
    gpu = {"cuda_allocated_bytes": int(alloc * GIB),
           "cuda_reserved_bytes": int((reserved or max(alloc, 0.5)) * GIB),
           "peak_allocated_bytes": int(peak * GIB),
           "peak_reserved_bytes": int((reserved or max(peak, 0.5)) * GIB),
           "nvml_used_bytes": int(((reserved or max(alloc, 0.5)) + 0.5) * GIB)}
    if not cuda:
        gpu = dict.fromkeys(gpu)
    return {"label": label, "stage": stage, "node": "1", "extra": extra, "time": 1e9 + t,
            "monotonic": T0 + t, "device": "cuda:0" if cuda else None,
            "rss_bytes": int(rss * GIB), **gpu}


def loader(component, size_gib, t, rss):
    extra = {"component": component, "bytes": int(size_gib * GIB), "dtype": "bfloat16",
             "file": f"{component}.safetensors"}
    return event(f"loaded {component}.safetensors", "load", t, rss=rss, extra=extra)


def synthetic_log(cuda=True, activity=False) -> dict:
    """A run: three loads, a probe, text encoding, 4 sampling steps, decode, save."""
    e = lambda *a, **k: event(*a, cuda=cuda, **k)  # noqa: E731
    events = [
        loader("dit", 6, 1.0, rss=3.0), loader("text_encoder", 3, 2.0, rss=4.0),
        loader("vae", 1, 3.0, rss=11.0),  # resident 11 + 0.5 GiB: "other" is 1.5 GiB
        e("models loaded", "probe", 3.5, rss=11.0),
        e("text encoded", "text_encode", 5.0, peak=4.0, reserved=4.5, rss=12.0),
        e("sampling starts", "sample", 6.0, rss=12.0),
        e("step 1/4", "sample", 8.0, alloc=7.0, peak=9.0, reserved=10, rss=12.5,
          extra={"step": 1}),
        e("step 2/4", "sample", 9.5, alloc=7.25, peak=8.0, reserved=10, rss=12.75,
          extra={"step": 2}),
        e("step 3/4", "sample", 10.5, alloc=7.0, peak=8.5, reserved=10, rss=12.5,
          extra={"step": 3}),
        e("step 4/4", "sample", 12.5, alloc=7.5, peak=8.0, reserved=10, rss=13.0,
          extra={"step": 4}),
        e("sampling done", "sample", 13.0, peak=7.5, rss=12.0),
        e("decode starts", "decode", 14.0, rss=12.0),
        e("decode done", "decode", 20.0, peak=2.0, reserved=3.0, rss=12.25),
        e("saved video.mp4", "save", 21.0, peak=0.625, rss=12.0),
    ]
    if not cuda:
        for loaded in events[:3]:
            loaded.update({k: None for k in loaded if k.startswith(("cuda_", "peak_", "nvml_"))})
    for index, item in enumerate(events):
        item["index"] = index
    initial = event("", "", 0.0, alloc=0.5, rss=2.0, cuda=cuda)
    data = {"schema": SCHEMA,
            "run": {"id": "20260101-000000-abcdef", "started": 1e9, "started_iso": "2026-01-01",
                    "host": {"python": "3.12.3", "torch": "2.6.0+cu124", "cuda": "12.4",
                             "platform": "Linux", "pid": 1,
                             "device": "cuda:0" if cuda else None,
                             "device_name": "Fake H100" if cuda else None,
                             "device_total_bytes": 80 * GIB if cuda else None,
                             "ram_total_bytes": 128 * GIB},
                    "initial": {k: initial[k] for k in initial
                                if k not in ("label", "stage", "node", "extra")},
                    "max_events": 100000, "dropped_events": 0},
            "events": events}
    if activity:
        data["activity"] = synthetic_activity()
    return data


def synthetic_activity() -> dict:
    """20 s at 10 Hz, SM activity alternating 20% / 80% (mean 50%)."""
    samples = [{"monotonic": T0 + 0.1 * i, "sm_activity": 20.0 if i % 2 else 80.0,
                "memory_used_bytes": (1 + i % 5) * GIB, "power_w": 100.0 + i % 3 * 100,
                "sm_clock_mhz": 1755.0} for i in range(200)]
    stats = RunningStats(["sm_activity", "memory_used_bytes", "power_w", "sm_clock_mhz"])
    for sample in samples:
        stats.add(sample)
    return {"source": "nvml", "device": "cuda:0", "reason": None, "unsupported": [],
            "interval_s": 0.1, "started_monotonic": T0, "stopped_monotonic": T0 + 20.0,
            "max_samples": 20000, "samples_taken": 200, "kept_every": 1, "error": None,
            "summary": summarize("nvml", stats, 200, 20.0), "samples": samples}


def write(tmp_path, data, name="events.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def table_row(markdown: str, first_cell: str) -> list[str]:
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r} in:\n{markdown}")


def assert_valid_pngs(report):
    markdown = report.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    for relative in images:
        path = report.parent / relative
        assert path.read_bytes()[:8] == PNG_SIGNATURE, relative
        with Image.open(path) as image:
            image.verify()
            assert image.size[0] > 100 and image.size[1] > 100
    assert not list(report.parent.glob(".*.partial"))  # atomic writes leave nothing behind
    return images


# -- the numbers -------------------------------------------------------------------------------

def test_component_breakdown_sizes_and_shares():
    breakdown = component_breakdown(synthetic_log())
    rows = {row.component: row for row in breakdown.rows}
    assert [row.component for row in breakdown.rows] == ["dit", "text_encoder", "vae", "other"]
    assert (rows["dit"].bytes, rows["text_encoder"].bytes, rows["vae"].bytes) == \
        (6 * GIB, 3 * GIB, 1 * GIB)
    assert rows["other"].bytes == int(1.5 * GIB)  # RSS 11 + allocated 0.5 - 10 named
    assert breakdown.total_bytes == int(11.5 * GIB)
    assert rows["dit"].share == pytest.approx(100 * 6 / 11.5)
    assert sum(row.share for row in breakdown.rows) == pytest.approx(100.0)
    assert rows["dit"].dtypes == ["bfloat16"] and rows["vae"].files == ["vae.safetensors"]


def test_other_never_goes_negative_when_weights_are_not_yet_resident():
    data = synthetic_log()
    data["events"][2]["rss_bytes"] = 2 * GIB  # memory-mapped: far less than 10 GiB named
    breakdown = component_breakdown(data)
    assert breakdown.rows[-1].bytes == 0 and breakdown.total_bytes == 10 * GIB
    assert sum(row.share for row in breakdown.rows) == pytest.approx(100.0)


def test_peaks_per_stage():
    rows = {row.name: row for row in stage_peaks(synthetic_log())}
    assert list(rows) == ["initial", "load", "probe: models loaded", "text_encode", "sample",
                          "step 1/4", "step 2/4", "step 3/4", "step 4/4", "decode", "save"]
    expected = {"initial": (0.5, 0.5), "load": (0.5, 0.5), "text_encode": (4.0, 4.5),
                "sample": (7.5, 7.5), "step 1/4": (9.0, 10.0), "step 3/4": (8.5, 10.0),
                "decode": (2.0, 3.0), "save": (0.625, 0.625)}
    for name, (allocated, reserved) in expected.items():
        assert rows[name].peak_allocated == allocated * GIB, name
        assert rows[name].peak_reserved == reserved * GIB, name
    assert rows["load"].events == 3 and rows["decode"].events == 2
    assert rows["decode"].start_s == 13.0 and rows["decode"].end_s == 20.0


def test_step_increments_and_durations():
    steps = step_statistics(synthetic_log())
    assert steps.steps == 4 and steps.memory_field == "cuda_allocated_bytes"
    # allocated 7.0, 7.25, 7.0, 7.5 GiB; steps at 8.0, 9.5, 10.5, 12.5 s
    assert steps.increments.count == 3
    assert steps.increments.mean == pytest.approx(0.5 * GIB / 3)
    assert (steps.increments.min, steps.increments.max) == (-0.25 * GIB, 0.5 * GIB)
    assert steps.durations.count == 3
    assert steps.durations.mean == pytest.approx(1.5)
    assert (steps.durations.min, steps.durations.max) == (1.0, 2.0)
    assert steps.first_step_s == [2.0]  # from "sampling starts"


def test_without_cuda_the_numbers_come_from_rss():
    data = synthetic_log(cuda=False)
    rows = {row.name: row for row in stage_peaks(data)}
    assert rows["step 4/4"].peak_allocated is None and rows["step 4/4"].rss == 13 * GIB
    assert rows["initial"].rss == 2 * GIB
    steps = step_statistics(data)
    assert steps.memory_field == "rss_bytes"
    assert steps.increments.mean == pytest.approx(0.5 * GIB / 3)  # 12.5, 12.75, 12.5, 13.0
    breakdown = component_breakdown(data)
    assert breakdown.rows[-1].bytes == 1 * GIB  # RSS 11 - 10 named, no CUDA term
    assert sum(row.share for row in breakdown.rows) == pytest.approx(100.0)


# -- the report files --------------------------------------------------------------------------

def test_report_with_cuda_and_activity(tmp_path):
    path = write(tmp_path, synthetic_log(activity=True))
    report = build_report(path, tmp_path / "report")
    assert report == tmp_path / "report" / "events-report.md"
    markdown = report.read_text()
    assert "run 20260101-000000-abcdef" in markdown
    assert "Fake H100" in markdown and "2.6.0+cu124" in markdown

    assert table_row(markdown, "dit")[1:3] == ["6.00", "52.2%"]
    assert table_row(markdown, "other")[1:3] == ["1.50", "13.0%"]
    shares = [float(table_row(markdown, c)[2].rstrip("%"))
              for c in ("dit", "text_encoder", "vae", "other")]
    assert sum(shares) == pytest.approx(100.0, abs=0.2)

    assert table_row(markdown, "step 1/4")[2:4] == ["9.00", "10.00"]
    assert table_row(markdown, "text_encode")[2:4] == ["4.00", "4.50"]
    assert table_row(markdown, "memory change, MiB")[1:] == ["3", "+170.7", "-256.0", "+512.0"]
    assert table_row(markdown, "step duration, s")[1:] == ["3", "1.500", "1.000", "2.000"]

    assert table_row(markdown, "mean SM activity")[1] == "50.0 %"
    # compute load = duration x mean SM activity = 20 s x 50%
    assert table_row(markdown, "compute load (duration x mean SM activity)")[1] == \
        "10.00 GPU-seconds"
    assert table_row(markdown, "max memory used (NVML)")[1] == "5.00 GiB"

    images = assert_valid_pngs(report)
    assert images == ["events-components.png", "events-stages.png", "events-timeline.png",
                      "events-activity.png"]


def test_report_without_cuda_or_activity(tmp_path):
    path = write(tmp_path, synthetic_log(cuda=False))
    report = build_report(path)  # beside the events file
    assert report == tmp_path / "events-report.md"
    markdown = report.read_text()
    assert "No CUDA in this run" in markdown and "no CUDA device" in markdown
    assert table_row(markdown, "step 4/4")[1:3] == ["1", "13.00"]  # events, RSS GiB
    assert "process RSS (no CUDA in this run)" in markdown
    assert "No activity trace in this log" in markdown
    assert assert_valid_pngs(report) == ["events-components.png", "events-stages.png",
                                         "events-timeline.png"]


def test_report_of_an_old_log_without_sizes_or_initial(tmp_path):
    data = synthetic_log()
    del data["run"]["initial"]
    for loaded in data["events"][:3]:
        del loaded["extra"]["bytes"]
    markdown = build_report(write(tmp_path, data)).read_text()
    assert "initial (at the first event)" in markdown
    assert "Loader events without a size" in markdown


def test_without_matplotlib_the_report_says_so(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    report = build_report(write(tmp_path, synthetic_log()))
    assert "Plots skipped: matplotlib is not installed" in report.read_text()
    assert "![" not in report.read_text() and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ('{"schema": "something-else/1", "events": []}', "is not a memory event log"),
    ('[1, 2]', 'has no "schema" key'),
    ('{"schema": "%s", "run": {}, "events": {}}' % SCHEMA, '"events" must be a list'),
])
def test_bad_files_give_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReportError, match=message) as info:
        build_report(path, tmp_path / "out")
    assert str(path) in str(info.value)
    assert "memory event log" in str(info.value)  # says what was expected
    assert not (tmp_path / "out").exists()


def test_report_command(tmp_path, capsys):
    path = write(tmp_path, synthetic_log(activity=True))
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "events-report.md")
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "missing.json" in error


# -- the nodes ---------------------------------------------------------------------------------

@pytest.fixture
def output_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(events_module, "_current", None)
    host.set_headless_folders(output=tmp_path / "output")
    yield tmp_path / "output"
    host.set_headless_folders(output="output", models="models")


def test_loader_events_carry_the_component_sizes(tmp_path, output_folder):
    write_models_folder(tmp_path / "models", dit_name="dit.safetensors",
                        vae_name="vae.safetensors", text_encoder_name="te.safetensors", kind="t2v")
    host.set_headless_folders(models=tmp_path / "models")
    log = start_run()
    model, = WanModelLoader().load("dit.safetensors", "fp32", "sdpa", unique_id="1")
    encoder, = WanTextEncoderLoader().load("te.safetensors", "bf16", "cpu", unique_id="2")
    vae, = WanVAELoader().load("vae.safetensors", "fp16", unique_id="3")
    extras = [e["extra"] for e in log.events]
    assert extras == [
        {"component": "dit", "bytes": tensor_bytes(model.model), "dtype": "float32",
         "file": "dit.safetensors"},
        {"component": "text_encoder", "bytes": tensor_bytes(encoder.model),
         "dtype": "bfloat16", "file": "te.safetensors"},
        {"component": "vae", "bytes": tensor_bytes(vae.model), "dtype": "float16",
         "file": "vae.safetensors"}]
    breakdown = component_breakdown(read_log(log)[0])
    assert [row.bytes for row in breakdown.rows[:3]] == [e["bytes"] for e in extras]


def test_probe_writes_the_report(output_folder):
    log = start_run()
    log.record("loaded dit.safetensors", stage="load",
               extra={"component": "dit", "bytes": 1 * GIB, "dtype": "bfloat16",
                      "file": "dit.safetensors"})
    probe = WanMemoryProbe()
    out = probe.probe("anything", "after load", write_report=True, unique_id="9")
    assert out["result"] == ("anything",)
    log_path = output_folder / "wan_memory" / f"{log.run['id']}.json"
    assert out["ui"]["memory_log"] == [str(log_path)]
    report = output_folder / "wan_memory" / f"{log.run['id']}-report.md"
    assert out["ui"]["memory_report"] == [str(report)]
    assert "probe: after load" in report.read_text()
    assert_valid_pngs(report)

    named = probe.probe(1, "named", save_log="runs/mine.json", write_report=True)
    assert named["ui"]["memory_report"] == [str(output_folder / "runs" / "mine-report.md")]
    plain = probe.probe(2, "no report")
    assert "memory_report" not in plain["ui"] and "memory_log" not in plain["ui"]


def test_probe_inputs_keep_their_order():
    spec = WanMemoryProbe.INPUT_TYPES()
    assert list(spec["required"]) == ["value", "label"]
    assert list(spec["optional"]) == ["save_log", "write_report"]  # appended, never reordered
    assert spec["optional"]["write_report"] == ("BOOLEAN", spec["optional"]["write_report"][1])
    assert spec["optional"]["write_report"][1]["default"] is False


def test_steps_are_read_from_the_events_extra_not_their_label():
    from wan_enhanced.profiling.report_data import step_number
    assert step_number(event("step 2/4", "sample", 1.0, extra={"step": 2})) == 2
    assert step_number(event("step 9/9", "sample", 1.0)) is None  # a label alone is no step
    assert step_number(event("anything", "sample", 1.0, extra={"step": 3})) == 3
    assert step_number(event("step 1/1", "decode", 1.0, extra={"step": 1})) is None
