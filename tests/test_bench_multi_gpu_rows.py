"""`wan-enhanced bench --gpus 1,2`: a row per GPU count with the speed-up over one GPU, the
communication time and the ranks' peaks; more GPUs than exist are refused before anything runs."""

import json

import pytest

from wan_enhanced.distributed.group import shutdown_worker_group
from wan_enhanced.runner.bench_command import add_speedup, rank_summary, results_markdown
from wan_enhanced.runner.cli import main

TINY = ["--tiny", "--scenario", "t2v_1_3b_baseline", "--max-steps", "2",
        "--set", "5.width=64", "--set", "5.height=64", "--set", "5.frames=5",
        "--set", "2.device=cpu", "--set", "1.weight_dtype=fp32"]


def test_rows_per_gpu_count_on_gloo_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("WAN_ENHANCED_DEVICE", "cpu")
    out = tmp_path / "out"
    try:
        code = main(["bench", *TINY, "--models", str(tmp_path / "models"), "--out", str(out),
                     "--gpus", "1,2", "--fsdp"])
    finally:
        shutdown_worker_group()
    assert code == 0
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert [(r["gpus"], r["fsdp"], r["status"]) for r in rows] == [(1, False, "ok"),
                                                                    (2, True, "ok")]
    assert rows[0]["speedup"] is None and rows[0]["comm_seconds"] is None
    assert rows[1]["speedup"] == round(rows[0]["seconds_per_step"] / rows[1]["seconds_per_step"],
                                       2)
    assert rows[1]["comm_seconds"] > 0
    assert (out / "t2v_1_3b_baseline-2gpus-fsdp-events.json").is_file()
    table = next(out.glob("bench-*.md")).read_text()
    assert "| 2 fsdp |" in table and "| speed-up |" in table


def test_more_gpus_than_exist_are_refused_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WAN_ENHANCED_DEVICE", "cpu")
    code = main(["bench", *TINY, "--models", str(tmp_path / "models"), "--out",
                 str(tmp_path / "out"), "--gpus", "1,9"])
    assert code == 2
    assert "error: --gpus: 9 asked for; this machine has room for 8 CPU processes" in \
        capsys.readouterr().err
    assert not (tmp_path / "models").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["0", "1,x", ""])
def test_bad_gpu_lists(text, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--gpus", text])
    assert "--gpus" in capsys.readouterr().err


def test_rank_summary_and_speedup():
    events = [{"stage": "ranks", "extra": {"rank": r, "reserved_peak_bytes": 5 + r,
                                           "allocated_peak_bytes": 3, "all_to_all_seconds": 0.5,
                                           "cfg_seconds": 0.25}} for r in (0, 1, 0, 1, 2)]
    assert rank_summary(events) == {"device_peak": 7, "allocated_peak": 3, "comm_seconds": 0.75}
    # with fsdp on GPUs a rank's chunks sit outside the allocator: its device peak counts them
    events[-1]["extra"]["outside_allocator_bytes"] = 4
    assert rank_summary(events)["device_peak"] == 5 + 2 + 4
    assert rank_summary([]) == {}
    rows = [{"case": "a", "gpus": 1, "seconds_per_step": 3.0}]
    row = {"case": "a", "gpus": 2, "seconds_per_step": 1.6}
    add_speedup(row, rows)
    assert row["speedup"] == 1.88
    old_row = {"case": "x", "resolution": "64x64", "frames": 5, "steps": 2,
               "steps_in_workflow": 2, "offload": False, "total_seconds": 1.0,
               "seconds_per_step": 0.5, "peak_allocated_gib": None, "peak_reserved_gib": None,
               "mean_sm_activity": None, "compute_load_gpu_s": None, "status": "ok",
               "device": "cpu"}  # a row from before the GPU columns
    assert "| 1 | None | None | ok |" in results_markdown([old_row])
