"""The benchmark command end to end on tiny models (the real sizes run on a GPU machine), and
the numbers it derives from the event log."""

import json

from wan_enhanced.runner.bench_command import results_markdown, seconds_per_step
from wan_enhanced.runner.cli import main


def test_seconds_per_step_from_events():
    events = [{"stage": "sample", "label": "sampling starts", "time": 10.0}] + [
        {"stage": "sample", "label": f"step {i}/4", "time": 12.0 + 1.5 * i, "extra": {"step": i}}
        for i in range(1, 5)]
    assert seconds_per_step(events) == 1.5
    assert seconds_per_step(events[:2]) == 3.5  # one step: measured from the sampler's start
    assert seconds_per_step([]) is None


def test_table_says_when_a_scenario_was_shortened():
    row = {"case": "x", "resolution": "64x64", "frames": 5, "steps": 3, "steps_in_workflow": 50,
           "offload": True, "total_seconds": 1.0, "seconds_per_step": 0.2,
           "peak_allocated_gib": None, "peak_reserved_gib": None, "mean_sm_activity": None,
           "compute_load_gpu_s": None, "status": "ok", "device": "cpu"}
    assert "| 3 of 50 |" in results_markdown([row])


def test_bench_runs_a_scenario_on_tiny_models(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--tiny", "--scenario", "t2v_1_3b_baseline", "--models",
                 str(tmp_path / "models"), "--out", str(out), "--max-steps", "2",
                 "--set", "5.width=64", "--set", "5.height=64", "--set", "5.frames=5",
                 "--set", "2.device=cpu", "--set", "1.weight_dtype=fp32"])
    assert code == 0
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert rows[0]["status"] == "ok" and rows[0]["steps"] == 2
    assert rows[0]["steps_in_workflow"] == 50 and rows[0]["seconds_per_step"] > 0
    log = json.loads((out / "t2v_1_3b_baseline-events.json").read_text())
    assert "activity" in log
    assert list(out.glob("videos/**/*.mp4"))
