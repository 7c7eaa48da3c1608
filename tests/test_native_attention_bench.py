"""bench/native_attention_gpu.py, the patch measured on ComfyUI's own Wan graphs: its parts on
the CPU (the VACE blocks it adds, the steady step, the table), and the whole script on tiny
models in a real ComfyUI (COMFYUI_HOME, as tests/test_comfyui_host.py), where our kernels hand
every call back, so both sides must give the same latent bit for bit, every attention call of
every expert must be counted, and both sides must equal the float32 forward (ComfyUI computes in
float32 on a CPU)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from wan_enhanced.bench import native_attention_gpu as bench
from wan_enhanced.checkpoints.tiny import TINY_DIT
from wan_enhanced.wan.dit import WanDiT

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "native_attention_gpu.py"


def test_vace_blocks_are_text_to_video_blocks_with_their_projections():
    config = TINY_DIT["t2v"]
    with torch.device("meta"):
        state = WanDiT(config).state_dict()  # the shapes are all vace_blocks reads
    extra = bench.vace_blocks(state, config, 2, 7, "cpu")
    block = {k[len("blocks.0."):]: v.shape for k, v in state.items() if k.startswith("blocks.0.")}
    for index in range(2):
        own = {k[len(f"vace_blocks.{index}."):]: v.shape for k, v in extra.items()
               if k.startswith(f"vace_blocks.{index}.")}
        projections = {"after_proj.weight", "after_proj.bias"} | (
            {"before_proj.weight", "before_proj.bias"} if index == 0 else set())
        assert set(own) == set(block) | projections
        assert all(own[k] == block[k] for k in block)
        assert own["after_proj.weight"] == (config.dim, config.dim)
    assert extra["vace_patch_embedding.weight"].shape == (config.dim, bench.VACE_IN_DIM, 1, 2, 2)
    # seeded: the same blocks again
    again = bench.vace_blocks(state, config, 2, 7, "cpu")
    assert all(torch.equal(extra[k], again[k]) for k in extra)


def test_the_steady_step_leaves_out_each_sampler_calls_first():
    assert bench.steady_step([[9.0, 1.0, 3.0, 2.0]]) == 2.0
    assert bench.steady_step([[9.0, 1.0], [8.0, 3.0]]) == 2.0  # an A14B pair, 2 + 2
    assert bench.steady_step([[9.0]]) is None


def test_distances_are_relative_to_the_reference():
    ref = torch.tensor([1.0, -2.0, 4.0])
    out = torch.tensor([1.0, -2.0, 3.0])
    from wan_enhanced.bench.harness import distance  # the one the bench records

    d = distance(out, ref)
    assert d["max_rel"] == pytest.approx(0.25)
    assert d["rel_l2"] == pytest.approx(1 / 21 ** 0.5)


def test_the_cases_are_the_templates_settings_with_four_steps():
    assert bench.STEPS == 4
    five = bench.CASES["ti2v_5b"]
    assert (five.width, five.height, five.length, five.shift, five.sampler, five.cfg) == \
        (1280, 704, 121, 8.0, "uni_pc", 5.0)
    for name in ("t2v_a14b", "i2v_a14b"):
        pair = bench.CASES[name]
        assert (pair.experts, pair.storage, pair.width, pair.height, pair.length, pair.shift,
                pair.sampler, pair.cfg) == (2, "fp8_scaled", 640, 640, 81, 5.0, "euler", 1.0)
    vace = bench.CASES["vace_14b"]
    assert (vace.vace, vace.width, vace.height, vace.length, vace.cfg) == \
        (True, 1280, 720, 81, 1.0)


def test_the_table_gives_each_side_and_the_ratios():
    run = {"step": 2.0, "run_seconds": 8.0}
    record = {"case": "ti2v_5b", "template": "t", "video": "1x1x1", "error_video": "1x1x1",
              "runs": {"comfyui": run, "patched": {"step": 1.5, "run_seconds": 6.0}},
              "step_ratio": 0.75, "run_ratio": 0.75,
              "distance": {"comfyui": {"max_rel": 1e-2, "rel_l2": 2e-3},
                           "patched": {"max_rel": 3e-2, "rel_l2": 4e-3}},
              "calls": {"ours": {"fp8": 3}, "handed_back": {"short keys": 3}}}
    text = bench.table([record])
    assert "| ti2v_5b (t) | 1x1x1 | 2.000 / 1.500 | 0.750 | 8.00 / 6.00 | 0.750 | " \
           "1.00e-02 / 3.00e-02 | 2.00e-03 / 4.00e-03 |" in text
    assert "our kernels took {'fp8': 3}; handed back: {'short keys': 3}" in text


def test_a_folder_without_comfyui_is_refused(tmp_path, capsys):
    assert bench.main(["--comfyui", str(tmp_path), "--out", str(tmp_path / "out"),
                       "--tiny"]) == 2
    assert "not a ComfyUI checkout" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


HOME = Path(os.environ.get("COMFYUI_HOME", "/nonexistent"))
COMFY = HOME / "ComfyUI"
PYTHON = HOME / "venv" / "bin" / "python"
# attention calls of one forward of the tiny models: 2 blocks, self and cross each, and the
# tiny VACE model's one VACE block; forwards on the patched side: one Euler step of the first
# expert, then the 4 steps (cfg 5 batches its two branches into one forward)
CALLS_PER_FORWARD = {"ti2v_5b": 4, "t2v_a14b": 4, "i2v_a14b": 4, "vace_14b": 6}


@pytest.mark.skipif(not (COMFY / "main.py").is_file() or not PYTHON.is_file(),
                    reason="no ComfyUI host (set COMFYUI_HOME; see tools/comfyui_host.sh)")
def test_the_script_in_a_real_comfyui_gives_both_sides_the_same_latent(tmp_path):
    link = tmp_path / "pkg" / "wan_enhanced"
    link.parent.mkdir()
    link.symlink_to(ROOT)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(link.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([str(PYTHON), str(SCRIPT), "--comfyui", str(COMFY), "--out", str(out),
                           "--tiny"], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "native_attention.json").read_text())
    assert data["meta"]["comfyui"]["version"] and data["meta"]["device"] == "cpu"
    records = {r["case"]: r for r in data["records"]}
    assert set(records) == set(bench.CASES)
    for name, r in records.items():
        assert r["equal"], name
        assert r["patched_vs_comfyui"] == {"max_rel": 0.0, "rel_l2": 0.0}
        # ComfyUI computes in float32 on a CPU: both sides are the reference
        assert r["distance"]["comfyui"] == r["distance"]["patched"] == \
            {"max_rel": 0.0, "rel_l2": 0.0}
        assert r["calls"]["ours"] == {}
        (reason, count), = r["calls"]["handed_back"].items()
        assert "cannot run here" in reason
        assert count == CALLS_PER_FORWARD[name] * (1 + bench.STEPS), name
        steps = r["runs"]["patched"]["step_seconds"]
        assert [len(s) for s in steps] == ([2, 2] if r["experts"] == 2 else [4])
        assert all(t > 0 for s in steps for t in s)
    assert "| vace_14b (video_wan_vace_14B_t2v, auto, default weights, eager) | 64x64x9 |" in \
        (out / "native_attention.md").read_text()
    assert {r["setup"] for r in data["records"]} == {"auto, default weights, eager"}
