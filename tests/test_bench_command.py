"""The benchmark command end to end on tiny models (the real sizes run on a GPU machine), and
the numbers it derives from the event log."""

import json

import torch

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


# the 1.3B baseline shrunk to run on a CPU in seconds
TINY_1_3B = ["--tiny", "--max-steps", "2", "--set", "5.width=64", "--set", "5.height=64",
             "--set", "5.frames=5", "--set", "2.device=cpu", "--set", "1.weight_dtype=fp32"]


def test_bench_runs_a_scenario_on_tiny_models(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", *TINY_1_3B, "--scenario", "t2v_1_3b_baseline", "--models",
                 str(tmp_path / "models"), "--out", str(out)])
    assert code == 0
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert rows[0]["status"] == "ok" and rows[0]["steps"] == 2
    assert rows[0]["steps_in_workflow"] == 50 and rows[0]["seconds_per_step"] > 0
    log = json.loads((out / "t2v_1_3b_baseline-events.json").read_text())
    assert "activity" in log
    assert list(out.glob("videos/**/*.mp4"))


def test_a_stop_signal_ends_the_bench_with_the_rows_so_far(tmp_path, monkeypatch, capsys,
                                                           stray_sigterm):
    """`kill` (SIGTERM) while the second of three scenarios runs: that row says interrupted,
    the third does not run, the table of the two is written and the command exits 1."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    from wan_enhanced.runner import executor

    calls = []

    def workflow(workflow, registry, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises KeyboardInterrupt at once
            except KeyboardInterrupt:
                raise executor.RunInterrupted("interrupted") from None  # as execute() does
            raise AssertionError("the signal did not stop the run")
        return SimpleNamespace(peak=None, files=[])

    monkeypatch.setattr(executor, "run_workflow", workflow)
    out = tmp_path / "out"
    code = main(["bench", *TINY_1_3B, *["--scenario", "t2v_1_3b_baseline"] * 3,
                 "--models", str(tmp_path / "models"), "--out", str(out)])
    assert code == 1 and len(calls) == 2 and stray_sigterm == []
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert [r["status"] for r in rows] == ["ok", "interrupted"]
    assert "| interrupted |" in next(out.glob("bench-*.md")).read_text()
    assert "interrupted: no further scenario runs" in capsys.readouterr().err


def test_a_model_set_cut_short_is_written_again(tmp_path, monkeypatch, capsys, stray_sigterm):
    """A stop while the DiT's shards are written: no row, the command exits 1, and the folder
    gets no config.json (written last), so the next run writes the set again and runs."""
    import os
    import signal

    from wan_enhanced.checkpoints import tiny

    real_save = tiny._atomic_save
    saves = []

    def save(state, path, metadata=None):
        saves.append(path)
        if len(saves) == 2:  # the second shard
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(state, path, metadata)

    monkeypatch.setattr(tiny, "_atomic_save", save)
    models, out = tmp_path / "models", tmp_path / "out"
    args = ["bench", *TINY_1_3B, "--scenario", "t2v_1_3b_baseline", "--models", str(models),
            "--out", str(out)]
    assert main(args) == 1
    dit = models / "diffusion_models" / "Wan2.1-T2V-1.3B"
    assert dit.is_dir() and not (dit / "config.json").exists()
    assert json.loads(next(out.glob("bench-*.json")).read_text()) == []
    monkeypatch.setattr(tiny, "_atomic_save", real_save)
    for table in out.glob("bench-*"):
        table.unlink()
    assert main(args) == 0
    assert (dit / "config.json").is_file()
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert [r["status"] for r in rows] == ["ok"]


def test_phases_split_a_run_by_node_class_and_the_sampler_by_its_steps():
    from wan_enhanced.runner.bench_phases import NodeTime, run_phases

    nodes = [NodeTime("1", "WanEnhancedModelLoader", 100.0, 2.0),
             NodeTime("9", "WanEnhancedLoRALoader", 102.0, 0.5),
             NodeTime("2", "WanEnhancedTextEncoderLoader", 102.5, 1.0, cached=True),
             NodeTime("4", "WanEnhancedTextEncode", 103.5, 0.7),
             NodeTime("5", "WanEnhancedEmptyLatent", 104.2, 0.1),
             NodeTime("6", "WanEnhancedSampler", 104.3, 10.0),
             NodeTime("7", "WanEnhancedTiledDecode", 114.3, 3.0),
             NodeTime("8", "WanEnhancedSaveVideo", 117.3, 1.5)]
    steps = [{"stage": "sample", "node": "6", "time": t, "extra": {"step": i}}
             for i, t in enumerate((108.3, 109.3, 110.3, 111.3), 1)]
    other = [{"stage": "sample", "node": "66", "time": 105.0, "extra": {"step": 1}}]
    phases = run_phases(nodes, steps + other, 19.0)
    assert phases == {"load": 2.5, "text_encode": 0.7, "first_step": 4.0, "steady_steps": 3.0,
                      "sample_rest": 3.0, "decode": 3.0, "video_write": 1.5, "other": 0.1,
                      "total": 19.0, "steady_step_count": 3}


def test_phases_split_the_decode_and_save_node_at_its_decode_done_event():
    from wan_enhanced.runner.bench_phases import NodeTime, run_phases

    nodes = [NodeTime("7", "WanEnhancedDecodeSaveVideo", 114.0, 4.0)]
    events = [{"stage": "decode", "node": "7", "label": "decode starts", "time": 114.0},
              {"stage": "decode", "node": "7", "label": "decode done", "time": 117.25},
              {"stage": "decode", "node": "8", "label": "decode done", "time": 117.75}]
    phases = run_phases(nodes, events, 4.0)
    assert (phases["decode"], phases["video_write"]) == (3.25, 0.75)
    # without the event (an older log), all of it is decoding
    assert run_phases(nodes, events[:1], 4.0)["decode"] == 4.0


def test_bench_distill_scenario_cold_then_warm_on_tiny_models(tmp_path, capsys):
    """--warm: the second run in the same process reuses the loaded models and the encoded
    prompt (no load, no text encoding) and samples again with the next seed."""
    out = tmp_path / "out"
    code = main(["bench", "--tiny", "--warm", "--scenario", "ti2v_5b_distill",
                 "--set", "5.width=64", "--set", "5.height=64", "--set", "5.frames=5",
                 "--set", "2.device=cpu", "--set", "1.weight_dtype=fp32", "--set",
                 "1.attention=sdpa", "--models", str(tmp_path / "models"), "--out", str(out)])
    assert code == 0
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert [(r["case"], r["run"], r["status"]) for r in rows] == [
        ("ti2v_5b_distill", "cold", "ok"), ("ti2v_5b_distill", "warm", "ok")]
    cold, warm = (r["phases"] for r in rows)
    assert cold["load"] > 0 and cold["text_encode"] > 0
    assert warm["load"] == 0 and warm["text_encode"] == 0
    for phases in (cold, warm):
        assert phases["steady_step_count"] == 3  # 4 steps
        assert phases["decode"] > 0 and phases["video_write"] > 0
        parts = sum(v for k, v in phases.items() if k not in ("total", "steady_step_count"))
        assert parts <= phases["total"] * 1.001 + 0.01
    assert len(list(out.glob("videos/**/*.mp4"))) == 2
    table = next(out.glob("bench-*.md")).read_text()
    assert "ti2v_5b_distill (warm)" in table and "| ti2v_5b_distill | warm |" in table


def test_accuracy_runs_the_scenario_in_full_first_and_measures_the_distance(tmp_path, capsys):
    """--accuracy: a full run (cache off) and then the run as set; the cached run's row gets its
    latent's and its video's distance to the full run's, and the table prints them with the
    caveat. Without a cache the two runs are the same computation: distance 0."""
    common = [*TINY_1_3B, "--max-steps", "8", "--scenario", "t2v_1_3b_baseline", "--models",
              str(tmp_path / "models"), "--accuracy"]
    out = tmp_path / "cached"
    assert main(["bench", *common, "--set", "6.cache=easycache", "--set",
                 "6.cache_threshold=3.0", "--out", str(out)]) == 0
    rows = json.loads(next(out.glob("bench-*.json")).read_text())
    assert [(r["run"], r["status"]) for r in rows] == [("full", "ok"), (None, "ok")]
    accuracy = rows[1]["accuracy"]
    assert 0 < accuracy["latent_max_rel"] and accuracy["video_psnr_db"] < 100
    table = next(out.glob("bench-*.md")).read_text()
    assert "t2v_1_3b_baseline (full)" in table and "video PSNR dB" in table
    assert "mechanical checks" in table
    same = tmp_path / "same"
    assert main(["bench", *common, "--out", str(same)]) == 0
    rows = json.loads(next(same.glob("bench-*.json")).read_text())
    assert rows[1]["accuracy"] == {"latent_max_rel": 0.0, "video_psnr_db": float("inf")}


def test_memory_cap_caps_the_gpu_or_is_refused_by_name(monkeypatch, capsys, tmp_path):
    """--memory-cap GIB: the process's allocations on the compute GPU capped at GIB (the fraction
    of the device's memory PyTorch's allocator enforces); refused before anything runs without
    a GPU or with a cap the device cannot hold."""
    import types

    from wan_enhanced import host
    from wan_enhanced.runner import bench_command

    assert main(["bench", "--tiny", "--memory-cap", "8", "--out", str(tmp_path)]) == 2
    assert "--memory-cap 8: it caps a CUDA device's memory" in capsys.readouterr().err
    assert not list(tmp_path.glob("bench-*"))

    set_to = []
    monkeypatch.setattr(host, "compute_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: set_to.append((fraction, device)))
    assert bench_command.apply_memory_cap(8) is None
    assert set_to == [(0.1, torch.device("cuda", 0))]
    assert "at most the device's 80.0 GiB" in bench_command.apply_memory_cap(81)
    assert "more than 0" in bench_command.apply_memory_cap(0)
    assert bench_command.apply_memory_cap(None) is None and len(set_to) == 1
