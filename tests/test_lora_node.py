"""The Wan LoRA Loader node: the A14B 4-step LoRA example runs on tiny models (one LoRA loader
per expert), bad LoRA inputs are refused in validation before any model loads (the file, the
strength, the mode, and a LoRA for another model size through the graph check), and chains of
the node record their LoRAs on the handle without touching the model."""

from __future__ import annotations

import json
import inspect
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.checkpoints import tiny
from wan_enhanced.lora.tiny import lightx2v_lora, random_lora, write_lora
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.pipeline import loading
from wan_enhanced.runner import cli

WORKFLOW = (Path(__file__).resolve().parent.parent / "api_workflows"
            / "wan22_t2v_a14b_4step_lora.json")
HIGH, LOW = "high.safetensors", "low.safetensors"
LORA_HIGH, LORA_LOW = "lora_high.safetensors", "lora_low.safetensors"
TE, VAE = "te.safetensors", "vae21.safetensors"
SMALL = {"1.model_name": HIGH, "2.model_name": LOW, "1.weight_dtype": "fp32",
         "2.weight_dtype": "fp32", "3.lora_name": LORA_HIGH, "4.lora_name": LORA_LOW,
         "5.text_encoder_name": TE, "5.dtype": "fp32", "5.device": "cpu", "6.vae_name": VAE,
         "6.dtype": "fp32", "8.width": 64, "8.height": 64, "8.frames": 5,
         "1.attention": "sdpa", "2.attention": "sdpa"}
CONFIG = tiny.TINY_DIT["t2v"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny.write_models_folder(root, dit_name=HIGH, vae_name=VAE, text_encoder_name=TE,
                             kind="t2v")
    tiny.write_dit(root / "diffusion_models" / LOW, CONFIG, "comfy_fp8", seed=5)
    # one step-distill LoRA per expert, as the Wan2.2 distill releases ship them: LightX2V's
    # extractor layout (pairs, .diff, .diff_b, .diff_m), bf16
    write_lora(root / "loras" / LORA_HIGH, lightx2v_lora(CONFIG, seed=1, rank=8,
                                                         pair_min=60_000), "lightx2v",
               dtype=torch.bfloat16)
    write_lora(root / "loras" / LORA_LOW, lightx2v_lora(CONFIG, seed=2, rank=8,
                                                        pair_min=60_000), "lightx2v",
               dtype=torch.bfloat16)
    write_lora(root / "loras" / "for_14b.safetensors",
               random_lora(replace(CONFIG, dim=384, num_heads=3), seed=3), "generic")
    (root / "loras" / "a_dit.safetensors").write_bytes(
        (root / "diffusion_models" / HIGH).read_bytes())
    return root


@pytest.fixture
def loads(monkeypatch):
    calls = []
    original = loading.load_model

    def record(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)
    monkeypatch.setattr(loading, "load_model", record)
    yield calls
    host.set_headless_folders(models="models", output="output")


def run(tmp_path, models, **changes) -> int:
    workflow = json.loads(WORKFLOW.read_text())
    for key, value in {**SMALL, **changes}.items():
        node_id, name = key.split(".")
        workflow[node_id]["inputs"][name] = value
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(workflow))
    return cli.main(["run", str(path), "--models", str(models), "--out", str(tmp_path / "out"),
                     "--quiet"])


def test_the_four_step_lora_example_runs_with_one_lora_per_expert(tmp_path, models, loads):
    assert run(tmp_path, models) == 0
    assert len(loads) == 2 and list((tmp_path / "out" / "wan").glob("*.mp4"))


@pytest.mark.parametrize("changes, expected", [
    ({"3.lora_name": "missing.safetensors"}, ('input "lora_name"', "not in the 'loras'")),
    ({"3.lora_name": "a_dit.safetensors"},
     ('input "lora_name"', "full model rather than a LoRA")),
    ({"4.lora_name": "for_14b.safetensors"},
     ('node 4 (WanEnhancedLoRALoader', 'input "lora_name"', "'for_14b.safetensors' does not fit "
      "'low.safetensors'", "has shape [384, 4] but the model's blocks.0.cross_attn.k.weight is "
      "[256, 256]")),
    ({"3.strength": math.nan}, ('input "strength"', "finite number")),
    ({"4.mode": "lazy"}, ('input "mode"', '"lazy" is not one of the choices')),
])
def test_bad_lora_inputs_are_refused_before_any_model_loads(tmp_path, models, loads, capsys,
                                                            changes, expected):
    assert run(tmp_path, models, **changes) == 2
    err = capsys.readouterr().err
    assert "is invalid" in err
    for text in expected:
        assert text in err, err
    assert loads == []


def test_validate_inputs_for_comfyui(models, loads):
    """The check names only the inputs it judges (ComfyUI files its verdict under each of them):
    `mode` is left to ComfyUI's choice check."""
    node = NODES["WanEnhancedLoRALoader"]
    host.set_headless_folders(models=models)
    assert inspect.getfullargspec(node.VALIDATE_INPUTS).args[1:] == ["lora_name", "strength"]
    assert node.VALIDATE_INPUTS(LORA_HIGH, 1.0) is True
    assert node.VALIDATE_INPUTS(LORA_HIGH, None) is True  # linked
    assert "strength: inf is not a finite number" in node.VALIDATE_INPUTS(LORA_HIGH, math.inf)
    assert "strength: 500.0 is bigger than the maximum" in node.VALIDATE_INPUTS(LORA_HIGH, 500.0)
    assert "lora_name: '../x.safetensors'" in node.VALIDATE_INPUTS("../x.safetensors", 1.0)


def test_a_chain_of_nodes_records_its_loras_and_leaves_the_model_alone(models, loads):
    host.set_headless_folders(models=models)
    (model,) = NODES["WanEnhancedModelLoader"]().load(HIGH, "fp32", "sdpa")
    saved = {k: v.clone() for k, v in model.model.state_dict().items()}
    lora = NODES["WanEnhancedLoRALoader"]()
    (once,) = lora.load(model, LORA_HIGH, 0.8, "merge")
    (twice,) = lora.load(once, LORA_LOW, -0.5, "unmerged")
    assert [(c.name, c.strength, c.mode) for c in twice.loras] == \
        [(LORA_HIGH, 0.8, "merge"), (LORA_LOW, -0.5, "unmerged")]
    assert once.loras == twice.loras[:1] and model.loras == ()
    assert twice.model is model.model
    assert all(torch.equal(v, saved[k]) for k, v in model.model.state_dict().items())
    assert lora.load(twice, LORA_HIGH, 0.0, "merge")[0] is twice  # strength 0: skipped
    with pytest.raises(NodeInputError, match=r"Wan LoRA Loader: lora_name: lora_high.safetensors "
                                             r"is already applied"):
        lora.load(twice, LORA_HIGH, 1.0, "merge")
    with pytest.raises(NodeInputError, match=r"Wan LoRA Loader: .*for_14b.safetensors: "
                                             r"'diffusion_model.blocks.0.cross_attn.k.lora_B"):
        lora.load(model, "for_14b.safetensors", 1.0, "merge")


def test_each_expert_computes_with_its_own_distill_lora(models, loads):
    """Wan2.2 A14B: the high-noise expert takes the high-noise file at its strength, the
    low-noise expert the low-noise file at its own; their modulation tables change by exactly
    their own file's `.diff_m` (LightX2V's layout)."""
    from safetensors import safe_open

    from wan_enhanced.pipeline.dit_placement import DiTPlacement
    from wan_enhanced.pipeline.placement import DevicePlacement

    host.set_headless_folders(models=models)
    loader, lora = NODES["WanEnhancedModelLoader"](), NODES["WanEnhancedLoRALoader"]()
    experts = {}
    for model_name, lora_name, strength in ((HIGH, LORA_HIGH, 1.0), (LOW, LORA_LOW, 0.6)):
        (model,) = loader.load(model_name, "fp32", "sdpa")
        before = model.model.blocks[1].modulation.detach().clone()
        (handle,) = lora.load(model, lora_name, strength, "merge")
        with safe_open(str(models / "loras" / lora_name), "pt") as f:
            diff = f.get_tensor("diffusion_model.blocks.1.diff_m").float()
        experts[model_name] = (handle, before, diff, strength)
    with DevicePlacement("cpu") as placement, DiTPlacement(placement, 0) as dit:
        for handle, before, diff, strength in experts.values():
            dit.place(handle)
            assert torch.equal(handle.model.blocks[1].modulation,
                               torch.add(before, diff, alpha=strength))
    high, low = (experts[n][2] for n in (HIGH, LOW))
    assert not torch.equal(high, low)


def test_a_lora_whose_scale_overflows_the_forward_stops_the_run_before_decoding(tmp_path, models,
                                                                               loads, capsys):
    """An alpha of 1e38: every tensor finite, the merged weights too, but the forward overflows
    and the sample turns NaN: the run stops at that step with the reason (it gave a black
    video and exit 0)."""
    content = random_lora(CONFIG, seed=9, alpha=1e38)
    write_lora(models / "loras" / "overflowing.safetensors", content, "kohya")
    assert run(tmp_path, models, **{"3.lora_name": "overflowing.safetensors"}) != 0
    err = capsys.readouterr().err
    assert "NaN or infinite values after step 1 of 4 (high_noise expert)" in err
    assert not list((tmp_path / "out").rglob("*.mp4"))
