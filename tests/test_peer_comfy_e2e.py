"""The ComfyUI end-to-end peer benchmark (bench/peer_comfy_e2e.py): the translation of our
distill workflows into ComfyUI's node calls, as data and without ComfyUI (node names, mapped
values, the A14B experts' KSamplerAdvanced step ranges against our own sampler's split, the
latent node by the model's channels, refusals that name the node), what a warm run reuses, the
phase arithmetic on a synthetic timeline, the result files; and, with a ComfyUI host
(COMFYUI_HOME, as tests/test_comfyui_host.py), the whole script on tiny files on the CPU.
"""

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from wan_enhanced.bench import peer_comfy_e2e as e2e
from wan_enhanced.bench.peer_comfy_e2e import Call, Ref, TranslationError
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit, write_text_encoder, write_vae
from wan_enhanced.lora.tiny import lightx2v_lora, write_lora
from wan_enhanced.sampling.schedules import NUM_TRAIN_TIMESTEPS
from wan_enhanced.sampling.solvers import SOLVER_NAMES, make_schedule
from wan_enhanced.wan.configs import T5Config

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "api_workflows"
SCRIPT = ROOT / "bench" / "peer_comfy_e2e.py"


def load(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def by_node(plan, node: str) -> list:
    return [s for s in plan.steps if s.node == node]


# -- the translation ---------------------------------------------------------------------------

def test_ti2v_5b_distill_becomes_the_5b_template_with_its_lora():
    plan = e2e.comfy_plan(load("wan22_ti2v_5b_distill"))
    assert plan.nodes() == ["UNETLoader", "CLIPLoader", "VAELoader", "LoraLoaderModelOnly",
                            "ModelSamplingSD3", "CLIPTextEncode", "CLIPTextEncode",
                            "Wan22ImageToVideoLatent", "KSampler", "VAEDecode", "CreateVideo",
                            "SaveVideo"]
    unet = plan.step("1")
    assert unet.inputs == {"unet_name": "wan2.2_ti2v_5B_fp16.safetensors",
                           "weight_dtype": "fp8_e4m3fn_fast"}
    assert plan.step("2").inputs == {"clip_name": "umt5_xxl_fp16.safetensors", "type": "wan",
                                     "device": "default"}
    lora = plan.step("9")
    assert lora.inputs == {"model": Ref("1"), "lora_name":
                           "wan2.2_ti2v_5b_lightx2v_4step_lora_rank64.safetensors",
                           "strength_model": 1.0}
    # ModelSamplingSD3 after the LoRA, as the templates place it
    assert plan.step("6.shift").inputs == {"model": Ref("9"), "shift": 5.0}
    latent = plan.step("5")
    assert latent.node == "Wan22ImageToVideoLatent"
    assert latent.inputs == {"vae": Ref("3"), "width": 1280, "height": 704, "length": 121,
                             "batch_size": 1}
    assert "start_image" not in latent.inputs
    sampler = plan.step("6")
    assert sampler.inputs == {"model": Ref("6.shift"), "seed": 42, "steps": 4, "cfg": 1.0,
                              "sampler_name": "euler", "scheduler": "simple",
                              "positive": Ref("4.positive"), "negative": Ref("4.negative"),
                              "latent_image": Ref("5"), "denoise": 1.0}
    assert plan.step("4.positive").inputs["text"].startswith("A red fox")
    assert plan.step("4.negative").inputs["text"].startswith("色调艳丽")
    assert plan.step("7").inputs == {"samples": Ref("6"), "vae": Ref("3")}
    # our node decodes and writes at once: ComfyUI's VAEDecode, then CreateVideo and SaveVideo
    assert plan.step("7.create").inputs == {"images": Ref("7"), "fps": 24.0}
    assert plan.step("7.save").inputs == {"video": Ref("7.create"),
                                          "filename_prefix": "wan/ti2v_5b_distill",
                                          "format": "mp4", "codec": "h264"}
    assert any("crf=19" in note and "no crf input" in note for note in plan.not_translated)


def test_wan21_14b_distill_takes_the_16_channel_empty_latent():
    plan = e2e.comfy_plan(load("wan21_t2v_14b_distill"))
    assert not by_node(plan, "Wan22ImageToVideoLatent")
    (latent,) = by_node(plan, "EmptyHunyuanLatentVideo")
    assert latent.inputs == {"width": 1280, "height": 720, "length": 81, "batch_size": 1}
    assert plan.step("1").inputs["weight_dtype"] == "fp8_e4m3fn_fast"
    assert plan.step("1").inputs["unet_name"] == "wan2.1_t2v_14B_fp8_scaled.safetensors"
    assert plan.step("9").inputs["lora_name"] == \
        "lightx2v_t2v_14b_cfg_step_distill_v2_lora_rank64_bf16.safetensors"
    (sampler,) = by_node(plan, "KSampler")
    assert (sampler.inputs["sampler_name"], sampler.inputs["scheduler"],
            sampler.inputs["steps"], sampler.inputs["cfg"]) == ("euler", "simple", 4, 1.0)
    assert plan.step("7.create").inputs["fps"] == 16.0


def test_a14b_pair_becomes_two_ksampler_advanced_split_two_and_two():
    plan = e2e.comfy_plan(load("wan22_t2v_a14b_4step_lora"))
    assert [s.key for s in by_node(plan, "UNETLoader")] == ["1", "2"]
    assert plan.step("3").inputs["model"] == Ref("1")   # each LoRA on its own expert
    assert plan.step("4").inputs["model"] == Ref("2")
    assert plan.step("3").inputs["lora_name"].endswith("high_noise.safetensors")
    assert plan.step("4").inputs["lora_name"].endswith("low_noise.safetensors")
    assert plan.step("9.shift_high").inputs == {"model": Ref("3"), "shift": 5.0}
    assert plan.step("9.shift_low").inputs == {"model": Ref("4"), "shift": 5.0}
    assert not by_node(plan, "KSampler")
    high, low = by_node(plan, "KSamplerAdvanced")
    assert high.inputs == {"model": Ref("9.shift_high"), "add_noise": "enable",
                           "noise_seed": 42, "steps": 4, "cfg": 1.0, "sampler_name": "euler",
                           "scheduler": "simple", "positive": Ref("7.positive"),
                           "negative": Ref("7.negative"), "latent_image": Ref("8"),
                           "start_at_step": 0, "end_at_step": 2,
                           "return_with_leftover_noise": "enable"}
    assert low.inputs == {"model": Ref("9.shift_low"), "add_noise": "disable",
                          "noise_seed": 0, "steps": 4, "cfg": 1.0, "sampler_name": "euler",
                          "scheduler": "simple", "positive": Ref("7.positive"),
                          "negative": Ref("7.negative"), "latent_image": Ref("9.high"),
                          "start_at_step": 2, "end_at_step": 4,
                          "return_with_leftover_noise": "disable"}
    assert plan.step("10").inputs == {"samples": Ref("9.low"), "vae": Ref("6")}
    (latent,) = by_node(plan, "EmptyHunyuanLatentVideo")
    assert latent.inputs["length"] == 81


def test_our_easycache_becomes_comfyuis_easycache_node_on_each_expert():
    workflow = load("wan22_t2v_a14b_4step_lora")
    workflow["9"]["inputs"].update(cache="easycache", cache_threshold=0.3)
    plan = e2e.comfy_plan(workflow)
    high, low = by_node(plan, "KSamplerAdvanced")
    assert high.inputs["model"] == Ref("9.cache_high") and low.inputs["model"] == Ref("9.cache_low")
    for key, shifted in (("9.cache_high", "9.shift_high"), ("9.cache_low", "9.shift_low")):
        assert plan.step(key).node == "EasyCache"
        assert plan.step(key).inputs == {"model": Ref(shifted), "reuse_threshold": 0.3,
                                         "start_percent": 0.15, "end_percent": 0.95,
                                         "verbose": False}
    single = load("wan22_ti2v_5b_distill")
    single["6"]["inputs"]["cache"] = "easycache"  # the default threshold: -1 -> 0.2
    plan = e2e.comfy_plan(single)
    assert plan.step("6").inputs["model"] == Ref("6.cache")
    assert plan.step("6.cache").inputs["reuse_threshold"] == 0.2
    assert not by_node(e2e.comfy_plan(load("wan22_ti2v_5b_distill")), "EasyCache")


def test_a14b_boundary_and_low_noise_guidance_move_the_split():
    workflow = load("wan22_t2v_a14b_4step_lora")
    workflow["9"]["inputs"].update(steps=20, boundary=0.9, cfg=3.5, cfg_low_noise=2.0,
                                   scheduler="unipc")
    high, low = by_node(e2e.comfy_plan(workflow), "KSamplerAdvanced")
    switch = e2e.expert_switch_step(20, 5.0, 0.9, "unipc")
    assert 0 < switch < 20
    assert (high.inputs["start_at_step"], high.inputs["end_at_step"]) == (0, switch)
    assert (low.inputs["start_at_step"], low.inputs["end_at_step"]) == (switch, 20)
    assert (high.inputs["cfg"], low.inputs["cfg"]) == (3.5, 2.0)
    assert high.inputs["sampler_name"] == low.inputs["sampler_name"] == "uni_pc"


@pytest.mark.parametrize("scheduler", SOLVER_NAMES)
def test_expert_switch_step_is_our_samplers_own_split(scheduler):
    """The high-noise steps: those of our schedule whose timestep is >= boundary * 1000."""
    checked = 0
    for steps in range(1, 61):
        for shift in (1.0, 3.0, 5.0, 8.0, 12.0):
            for boundary in (0.5, 0.875, 0.9, 0.95, 0.999):
                schedule = make_schedule(scheduler, steps, shift)
                ours = int(np.sum(schedule.timesteps.numpy()
                                  >= boundary * NUM_TRAIN_TIMESTEPS))
                assert e2e.expert_switch_step(steps, shift, boundary, scheduler) == ours, \
                    (steps, shift, boundary)
                checked += 1
    assert checked == 60 * 5 * 5


def test_our_scheduler_and_weight_dtype_names_map_to_comfyuis():
    workflow = load("wan21_t2v_14b_distill")
    expected = {"euler": "euler", "unipc": "uni_pc", "dpm++": "dpmpp_2m"}
    assert set(expected) == set(SOLVER_NAMES)   # every scheduler of our sampler is mapped
    for ours, theirs in expected.items():
        changed = e2e.apply_sets(workflow, [f"6.scheduler={ours}"])
        assert by_node(e2e.comfy_plan(changed), "KSampler")[0].inputs["sampler_name"] == theirs
    for ours, theirs in {"auto": "default", "bf16": "default", "fp8_e4m3fn": "fp8_e4m3fn",
                         "fp8_e4m3fn_fast": "fp8_e4m3fn_fast"}.items():
        changed = e2e.apply_sets(workflow, [f"1.weight_dtype={ours}"])
        assert e2e.comfy_plan(changed).step("1").inputs["weight_dtype"] == theirs
    changed = e2e.apply_sets(workflow, ["2.device=cpu", "9.strength=0.5", "6.denoise=0.75"])
    plan = e2e.comfy_plan(changed)
    assert plan.step("2").inputs["device"] == "cpu"
    assert plan.step("9").inputs["strength_model"] == 0.5
    assert plan.step("6").inputs["denoise"] == 0.75


@pytest.mark.parametrize("name", ["wan22_ti2v_5b_distill", "wan21_t2v_14b_distill",
                                  "wan22_t2v_a14b_4step_lora"])
def test_every_plan_runs_in_dependency_and_phase_order(name):
    plan = e2e.comfy_plan(load(name))
    seen, rank = set(), [e2e.PHASES.index(s.phase) for s in plan.steps]
    assert rank == sorted(rank)
    for step in plan.steps:
        assert all(v.step in seen for v in step.inputs.values() if isinstance(v, Ref)), step.key
        assert step.node in e2e.COMFY_MODULES
        seen.add(step.key)
    assert len(seen) == len(plan.steps)
    assert plan.nodes()[-2:] == ["CreateVideo", "SaveVideo"]
    json.dumps([s.as_json() for s in plan.steps])  # the record's plan is JSON


@pytest.mark.parametrize("change, where", [
    (lambda w: w.update({"90": {"class_type": "LoadImage", "inputs": {"image": "x.png"}}}),
     r"node 90 \(LoadImage\): no ComfyUI counterpart"),
    (lambda w: w["1"]["inputs"].update(weight_dtype="int8"),
     r"node 1 \(WanEnhancedModelLoader\): weight_dtype 'int8' has no UNETLoader"),
    (lambda w: w["1"]["inputs"].update(weight_dtype="fp32"),
     r"node 1 \(WanEnhancedModelLoader\): weight_dtype 'fp32'"),
    (lambda w: w["1"]["inputs"].update(compile=True),
     r"node 1 \(WanEnhancedModelLoader\): compile=true"),
    (lambda w: w["6"]["inputs"].update(gpus=2),
     r"node 6 \(WanEnhancedSampler\): gpus > 1"),
    (lambda w: w["6"]["inputs"].update(scheduler="ddim"),
     r"node 6 \(WanEnhancedSampler\): scheduler 'ddim'"),
    (lambda w: w["7"]["inputs"].update(latent=5),
     r"node 7 \(WanEnhancedDecodeSaveVideo\): input 'latent' must be linked"),
])
def test_an_untranslatable_node_or_input_is_refused_by_name(change, where):
    workflow = load("wan21_t2v_14b_distill")
    change(workflow)
    with pytest.raises(TranslationError, match=where):
        e2e.comfy_plan(workflow)


def test_image_to_video_and_partial_denoise_of_a_pair_are_refused():
    with pytest.raises(TranslationError, match=r"\(LoadImage\)"):
        e2e.comfy_plan(load("wan22_ti2v_5b_image_to_video"))
    workflow = load("wan22_t2v_a14b_4step_lora")
    workflow["9"]["inputs"]["denoise"] = 0.5
    with pytest.raises(TranslationError, match=r"node 9 .*KSamplerAdvanced has no denoise"):
        e2e.comfy_plan(workflow)


def test_inputs_without_counterpart_are_listed_not_dropped_silently():
    workflow = load("wan22_ti2v_5b_distill")
    workflow["1"]["inputs"]["attention"] = "sdpa"
    workflow["6"]["inputs"]["block_swap"] = 10
    workflow["9"]["inputs"]["mode"] = "unmerged"
    notes = "\n".join(e2e.comfy_plan(workflow).not_translated)
    for expected in ("attention='sdpa'", "block_swap=10", "mode='unmerged'", "crf=19",
                     "tile settings"):
        assert expected in notes


def test_the_latent_node_follows_the_dit_files_head(tmp_path):
    ti2v = write_dit(tmp_path / "a.safetensors", TINY_DIT["ti2v"], "comfy")
    t2v = write_dit(tmp_path / "b.safetensors", TINY_DIT["t2v"], "comfy_fp8")
    assert (e2e.channels_from_file(ti2v), e2e.channels_from_file(t2v)) == (48, 16)
    # the file decides, not its name
    workflow = load("wan21_t2v_14b_distill")
    plan = e2e.comfy_plan(workflow, lambda name: 48)
    assert plan.step("5").node == "Wan22ImageToVideoLatent"
    assert plan.step("5").inputs["vae"] == Ref("3")
    with pytest.raises(TranslationError, match=r"node 5 .*32-channel"):
        e2e.comfy_plan(workflow, lambda name: 32)


def test_set_takes_an_id_a_class_or_a_title_and_keeps_floats_floats():
    workflow = load("wan22_t2v_a14b_4step_lora")
    changed = e2e.apply_sets(workflow, ["8.width=64", "WanEnhancedSampler.cfg=2",
                                        "Wan Sampler (4 steps, cfg 1).seed=7",
                                        "7.positive=a cat"])
    assert changed["8"]["inputs"]["width"] == 64
    assert changed["9"]["inputs"]["cfg"] == 2.0 and isinstance(changed["9"]["inputs"]["cfg"],
                                                               float)
    assert changed["9"]["inputs"]["seed"] == 7
    assert changed["7"]["inputs"]["positive"] == "a cat"
    assert workflow["8"]["inputs"]["width"] == 1280   # the input is left as it was
    with pytest.raises(TranslationError, match="2 nodes match 'WanEnhancedModelLoader'"):
        e2e.apply_sets(workflow, ["WanEnhancedModelLoader.weight_dtype=auto"])
    with pytest.raises(TranslationError, match="expected NODE.INPUT=VALUE"):
        e2e.apply_sets(workflow, ["width=64"])


# -- what a warm run reuses --------------------------------------------------------------------

@pytest.mark.parametrize("name, rerun", [
    ("wan22_ti2v_5b_distill", {"6", "7", "7.create", "7.save"}),
    ("wan22_t2v_a14b_4step_lora", {"9.high", "9.low", "10", "10.create", "10.save"}),
])
def test_a_second_prompt_with_seed_plus_one_reruns_only_sampling_and_after(name, rerun):
    plan = e2e.comfy_plan(load(name))
    first, second = e2e.for_run(plan, 0), e2e.for_run(plan, 1)
    a, b = e2e.signatures(first), e2e.signatures(second)
    assert {key for key in a if a[key] != b[key]} == rerun
    samplers = [s for s in second.steps if s.node in e2e.SAMPLERS]
    assert samplers[0].inputs.get("seed", samplers[0].inputs.get("noise_seed")) == 43
    if len(samplers) == 2:
        assert samplers[1].inputs["noise_seed"] == 0   # adds no noise: unchanged
    assert e2e.signatures(e2e.for_run(plan, 0)) == a   # deterministic
    # a third run differs from both
    c = e2e.signatures(e2e.for_run(plan, 2))
    assert all(c[key] != a[key] and c[key] != b[key] for key in rerun)


# -- phase arithmetic --------------------------------------------------------------------------

def test_phases_steps_and_total_from_a_synthetic_timeline():
    calls = [
        Call("1", "UNETLoader", "load", 10.0, 12.5),
        Call("9", "LoraLoaderModelOnly", "load", 12.5, 13.0),
        Call("2", "CLIPLoader", "load", 13.0, 13.0, cached=True),
        Call("4.positive", "CLIPTextEncode", "text_encode", 13.0, 14.0, device_load=0.25),
        Call("4.negative", "CLIPTextEncode", "text_encode", 14.0, 14.5),
        Call("5", "EmptyHunyuanLatentVideo", "latent", 14.5, 14.5, cached=True),
        # high expert: model to GPU + first step 3 s, then 1 s
        Call("9.high", "KSamplerAdvanced", "sample", 15.0, 19.5, steps=[18.0, 19.0],
             device_load=2.0),
        # low expert: its first step includes its move (1.5 s), then 1 s
        Call("9.low", "KSamplerAdvanced", "sample", 19.5, 22.5, steps=[21.0, 22.0],
             device_load=1.0),
        Call("10", "VAEDecode", "decode", 22.5, 25.0),
        Call("11.create", "CreateVideo", "video_write", 25.0, 25.25),
        Call("11.save", "SaveVideo", "video_write", 25.25, 26.0),
    ]
    s = e2e.summarize(calls, run_start=9.5, run_end=26.5)
    assert s["phases"] == {"load": 3.0, "text_encode": 1.5, "latent": 0.0, "sample": 7.5,
                           "decode": 2.5, "video_write": 1.0}
    assert s["total"] == 17.0
    assert s["other"] == pytest.approx(17.0 - 15.5)
    assert s["step_times"] == [3.0, 1.0, 1.5, 1.0]
    assert s["first_step"] == 3.0
    assert s["steady_steps"] == 3.5
    assert s["device_load"] == {"text_encode": 0.25, "sample": 3.0}
    assert s["cached"] == ["2", "5"]
    # a warm run: everything before sampling cached
    warm = [dataclasses.replace(c, cached=True) if c.phase in ("load", "text_encode", "latent")
            else c for c in calls]
    w = e2e.summarize(warm, 14.9, 26.1)
    assert w["phases"]["load"] == w["phases"]["text_encode"] == 0.0
    assert w["phases"]["sample"] == 7.5 and w["total"] == pytest.approx(11.2)
    assert w["device_load"] == {"sample": 3.0}


def test_a_sampler_without_progress_reports_no_step_times():
    calls = [Call("6", "KSampler", "sample", 0.0, 2.0)]
    s = e2e.summarize(calls, 0.0, 2.0)
    assert s["step_times"] == [] and s["first_step"] is None and s["steady_steps"] is None
    one = e2e.summarize([Call("6", "KSampler", "sample", 0.0, 2.0, steps=[1.5])], 0.0, 2.0)
    assert one["first_step"] == 1.5 and one["steady_steps"] is None


def record(workflow: str, run: int, total: float) -> dict:
    phases = {phase: 0.5 for phase in e2e.PHASES}
    return {"workflow": workflow, "run": run, "kind": "cold" if run == 1 else "warm",
            "phases": phases, "total": total, "first_step": 0.25, "steady_steps": 0.75,
            "peak_cuda_allocated_gb": None, "peak_host_rss_gb": 1.25,
            "settings": {"seed": 41 + run, "width": 64, "height": 64, "frames": 5,
                         "steps": 4, "scheduler": "euler", "weight_dtype": "auto"},
            "date": "2025-01-01T00:00:00+00:00",
            "environment": {"comfyui": {"version": "0.3.64", "commit": "a125cd84b054"},
                            "device": "cpu", "torch": "2.x"}}


def test_results_replace_the_same_workflow_and_keep_others(tmp_path):
    e2e.write_results(tmp_path, [record("a", 1, 9.0), record("a", 2, 3.0)])
    e2e.write_results(tmp_path, [record("b", 1, 8.0)])
    merged = e2e.write_results(tmp_path, [record("a", 1, 7.0)])
    assert [(r["workflow"], r["run"], r["total"]) for r in merged] == [("b", 1, 8.0),
                                                                      ("a", 1, 7.0)]
    saved = json.loads((tmp_path / "peer_comfy_e2e.json").read_text())["records"]
    assert saved == merged
    md = (tmp_path / "peer_comfy_e2e.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| a ") or
            line.startswith("| b ")]
    assert rows == ["| b | 1 cold | 42 | 0.50 | 0.50 | 0.50 | 0.50 | 0.25 | 0.75 | 0.50 | "
                    "0.50 | 8.00 | - | 1.2 |",
                    "| a | 1 cold | 42 | 0.50 | 0.50 | 0.50 | 0.50 | 0.25 | 0.75 | 0.50 | "
                    "0.50 | 7.00 | - | 1.2 |"]
    assert "ComfyUI 0.3.64 (a125cd84)" in md


def test_an_untranslatable_workflow_stops_before_comfyui_is_imported(tmp_path, capsys):
    workflow = load("wan22_ti2v_5b_image_to_video")
    path = tmp_path / "i2v.json"
    path.write_text(json.dumps(workflow))
    code = e2e.main(["--comfyui", str(tmp_path / "nowhere"), "--workflow", str(path),
                     "--models", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 2
    assert "cannot translate i2v.json: node 9 (LoadImage)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_folder_without_comfyui_is_refused(tmp_path, capsys):
    code = e2e.main(["--comfyui", str(tmp_path), "--workflow",
                     str(WORKFLOWS / "wan21_t2v_14b_distill.json"), "--models", str(tmp_path),
                     "--out", str(tmp_path / "out"), "--cpu"])
    assert code == 2
    assert "not a ComfyUI checkout" in capsys.readouterr().err


# -- the whole script in a real ComfyUI, on tiny files, on the CPU -------------------------------

HOME = Path(os.environ.get("COMFYUI_HOME", "/nonexistent"))
COMFY = HOME / "ComfyUI"
PYTHON = HOME / "venv" / "bin" / "python"
needs_comfyui = pytest.mark.skipif(not (COMFY / "main.py").is_file() or not PYTHON.is_file(),
                                   reason="no ComfyUI host (set COMFYUI_HOME; see "
                                          "tools/comfyui_host.sh)")
# ComfyUI builds the released umt5-xxl shape from its own config whatever the file holds: a
# 24-layer, 4096-wide encoder with one 64-wide head and a 64-wide FFN (44M weights) passes its
# detection, and the script hands ComfyUI these overrides of its config
TINY_UMT5 = T5Config(vocab_size=256, dim=4096, dim_attn=64, dim_ffn=64, num_heads=1,
                     num_layers=24, num_buckets=32)
TE_OVERRIDES = {"d_ff": 64, "num_heads": 1, "d_kv": 64, "vocab_size": 256}
A14B = {"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors":
        "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
        "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors":
        "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"}


def write_comfy_readable_models(root: Path) -> Path:
    """Tiny files under the distill workflows' names that ComfyUI 0.3.64 loads: DiTs with
    ComfyUI's fixed text width (4096), the tiny-head umT5 above, and VAEs of the released shape
    (ComfyUI's VAELoader builds those whatever the file holds)."""
    from wan_enhanced.wan.tiny_tokenizer import build_spiece_model

    dit = {kind: dataclasses.replace(TINY_DIT[kind], text_dim=4096) for kind in ("t2v", "ti2v")}
    for folder in ("diffusion_models", "text_encoders", "vae", "loras"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    write_text_encoder(root / "text_encoders" / "umt5_xxl_fp16.safetensors", "hf",
                       config=TINY_UMT5, seed=2, spiece_model=build_spiece_model(256))
    write_vae(root / "vae" / "wan_2.1_vae.safetensors", "vae21",
              config={"dim": 96, "z_dim": 16}, dtype=torch.bfloat16, seed=1)
    write_vae(root / "vae" / "wan2.2_vae.safetensors", "vae22",
              config={"dim": 160, "dec_dim": 256, "z_dim": 48}, dtype=torch.bfloat16, seed=1)
    write_dit(root / "diffusion_models" / "wan2.2_ti2v_5B_fp16.safetensors", dit["ti2v"],
              "comfy", seed=0)
    write_lora(root / "loras" / "wan2.2_ti2v_5b_lightx2v_4step_lora_rank64.safetensors",
               lightx2v_lora(dit["ti2v"], seed=3, rank=4), "lightx2v")
    for seed, (expert, lora) in enumerate(A14B.items()):
        write_dit(root / "diffusion_models" / expert, dit["t2v"], "comfy_fp8", seed=seed)
        write_lora(root / "loras" / lora, lightx2v_lora(dit["t2v"], seed=seed + 10, rank=4),
                   "lightx2v")
    return root


@pytest.fixture(scope="module")
def comfy_models(tmp_path_factory):
    return write_comfy_readable_models(tmp_path_factory.mktemp("comfy_models"))


@needs_comfyui
@pytest.mark.parametrize("name, latent, steps_per_call", [
    ("wan22_ti2v_5b_distill", "5", [4]),
    ("wan22_t2v_a14b_4step_lora", "8", [2, 2]),
])
def test_the_script_runs_comfyuis_pipeline_cold_then_warm(name, latent, steps_per_call,
                                                          comfy_models, tmp_path):
    from wan_enhanced.pipeline.video_io import read_mp4

    out = tmp_path / "out"
    command = [str(PYTHON), str(SCRIPT), "--comfyui", str(COMFY), "--workflow",
               str(WORKFLOWS / f"{name}.json"), "--models", str(comfy_models), "--out",
               str(out), "--runs", "2", "--cpu", "--set", f"{latent}.width=64", "--set",
               f"{latent}.height=64", "--set", f"{latent}.frames=5",
               "--text-encoder-config", json.dumps(TE_OVERRIDES)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads((out / "peer_comfy_e2e.json").read_text())["records"]
    assert [(r["workflow"], r["run"], r["kind"]) for r in records] == [(name, 1, "cold"),
                                                                        (name, 2, "warm")]
    cold, warm = records
    assert (cold["settings"]["seed"], warm["settings"]["seed"]) == (42, 43)
    for r in records:
        assert r["environment"]["comfyui"]["version"]
        assert r["environment"]["device"] == "cpu"
        phases = r["phases"]
        assert set(phases) == set(e2e.PHASES)
        assert r["total"] >= sum(phases.values()) > 0
        assert 0 <= r["other"] < 0.5
        calls = [c for c in r["calls"] if c["node"] in e2e.SAMPLERS]
        assert [c["steps"] for c in calls] == steps_per_call
        assert len(r["step_times"]) == 4 and all(t > 0 for t in r["step_times"])
        assert r["first_step"] + r["steady_steps"] <= phases["sample"] + 1e-6
        assert phases["sample"] > 0 and phases["decode"] > 0 and phases["video_write"] > 0
        (video,) = r["videos"]
        frames, _ = read_mp4(Path(video))
        assert tuple(frames.shape) == (5, 64, 64, 3)
        assert r["peak_host_rss_gb"] > 0
    # cold: everything ran; warm: loaders, LoRA, ModelSamplingSD3, text and latent reused
    assert cold["cached"] == []
    assert cold["phases"]["load"] > 0 and cold["phases"]["text_encode"] > 0
    assert warm["phases"]["load"] == warm["phases"]["text_encode"] == 0.0
    assert warm["phases"]["latent"] == 0.0
    assert {c["node"] for c in warm["calls"] if c["cached"]} >= {
        "UNETLoader", "CLIPLoader", "VAELoader", "LoraLoaderModelOnly", "ModelSamplingSD3",
        "CLIPTextEncode"}
    assert cold["videos"] != warm["videos"]
    table = (out / "peer_comfy_e2e.md").read_text()
    assert f"| {name} | 1 cold | 42 |" in table and f"| {name} | 2 warm | 43 |" in table
    assert table.splitlines()[-1] in done.stdout
