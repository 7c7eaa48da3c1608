"""Mistakes that used to surface only after sampling and decoding are refused in validation,
before any model loads: an output folder that is a file or not writable, a filename prefix that
leaves it, NaN or infinity in a FLOAT input, a Wan2.1 VAE with TI2V-5B, frames that are not 4n+1
and sizes off the model's stride. The nodes' VALIDATE_INPUTS (what ComfyUI's /prompt calls) say
the same, and the nodes still refuse a bad value that arrives through a link."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from wan_enhanced import host
from wan_enhanced.checkpoints import tiny
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.pipeline import loading
from wan_enhanced.runner import cli

WORKFLOW = Path(__file__).resolve().parent.parent / "api_workflows" / \
    "wan22_ti2v_5b_speed_preview.json"
DIT, VAE22, VAE21, TE = ("wan2.2_ti2v_5B_fp16.safetensors", "wan2.2_vae.safetensors",
                         "wan_2.1_vae.safetensors", "umt5_xxl_fp16.safetensors")
SMALL = {"1.weight_dtype": "fp32", "2.dtype": "fp32", "2.device": "cpu", "3.dtype": "fp32",
         "5.width": 64, "5.height": 64, "5.frames": 5}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny.write_models_folder(root, dit_name=DIT, vae_name=VAE22, text_encoder_name=TE,
                             kind="ti2v")
    tiny.write_models_folder(root, dit_name="t2v.safetensors", vae_name=VAE21,
                             text_encoder_name=TE, kind="t2v")
    return root


@pytest.fixture
def loads(monkeypatch):
    """Every model load, recorded (a refused workflow must load none)."""
    calls = []
    for name in ("load_model", "load_vae_handle", "load_text_encoder_handle"):
        original = getattr(loading, name)

        def record(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(loading, name, record)
    yield calls
    host.set_headless_folders(models="models", output="output")


def run(tmp_path, models, out, **changes) -> int:
    workflow = json.loads(WORKFLOW.read_text())
    for key, value in {**SMALL, **changes}.items():
        node_id, name = key.split(".")
        workflow[node_id]["inputs"][name] = value
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(workflow))  # NaN and Infinity as Python's json writes them
    return cli.main(["run", str(path), "--models", str(models), "--out", str(out), "--quiet"])


def refused(capsys, *expected) -> str:
    err = capsys.readouterr().err
    assert "is invalid" in err, err
    for text in expected:
        assert text in err, err
    return err


def test_the_small_workflow_runs(tmp_path, models, loads):
    assert run(tmp_path, models, tmp_path / "out") == 0
    assert loads and list((tmp_path / "out" / "wan").glob("*.mp4"))


def test_output_folder_that_is_a_file(tmp_path, models, loads, capsys):
    out = tmp_path / "out"
    out.write_text("a file")
    assert run(tmp_path, models, out) == 2
    refused(capsys, 'node 8 (WanEnhancedSaveVideo', 'input "filename_prefix"', "is a file")
    assert loads == [] and out.read_text() == "a file"


def test_output_folder_that_is_not_writable(tmp_path, models, loads, capsys, unwritable_folder):
    assert run(tmp_path, models, unwritable_folder) == 2
    refused(capsys, 'input "filename_prefix"')
    assert loads == []
    assert not unwritable_folder.exists() or list(unwritable_folder.iterdir()) == []


@pytest.mark.parametrize("prefix", ["../escape", "/tmp/escape", "wan/../../escape"])
def test_filename_prefix_leaving_the_folder(tmp_path, models, loads, capsys, prefix):
    assert run(tmp_path, models, tmp_path / "out", **{"8.filename_prefix": prefix}) == 2
    refused(capsys, 'input "filename_prefix"', "outside the output folder")
    assert loads == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["8.fps", "6.cfg", "6.shift", "6.denoise", "7.vram_budget_gb"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan"])
def test_non_finite_floats(tmp_path, models, loads, capsys, key, value):
    assert run(tmp_path, models, tmp_path / "out", **{key: value}) == 2
    refused(capsys, f'input "{key.split(".")[1]}"')
    assert loads == []


def test_wan21_vae_with_ti2v_5b(tmp_path, models, loads, capsys):
    assert run(tmp_path, models, tmp_path / "out", **{"3.vae_name": VAE21}) == 2
    refused(capsys, 'node 7 (WanEnhancedTiledDecode', 'input "vae"', "is a Wan2.1 VAE",
            "only the Wan2.2 VAE decodes")
    assert loads == []


@pytest.mark.parametrize("changes, expected", [
    ({"5.frames": 6}, ('input "frames"', "4n+1", "5 or 9")),
    ({"5.width": 72}, ('input "width"', "multiple of 16")),
    ({"5.width": 80}, ('input "width"', "multiple of 32", "64 or 96")),  # TI2V-5B's stride
    ({"7.mode": "tiled", "7.stride_x": 272}, ('input "stride_x"', "smaller than tile_x")),
])
def test_sizes_decided_before_models_load(tmp_path, models, loads, capsys, changes, expected):
    assert run(tmp_path, models, tmp_path / "out", **changes) == 2
    refused(capsys, *expected)
    assert loads == []


def test_validate_inputs_say_the_same_for_comfyui():
    """ComfyUI skips its own min/max for inputs VALIDATE_INPUTS names, and lets NaN pass."""
    save, sampler = NODES["WanEnhancedSaveVideo"], NODES["WanEnhancedSampler"]
    latent, decode = NODES["WanEnhancedEmptyLatent"], NODES["WanEnhancedTiledDecode"]
    assert "fps: nan is not a finite number" in save.VALIDATE_INPUTS("wan/x", math.nan)
    assert "fps: 500.0 is bigger than the maximum" in save.VALIDATE_INPUTS("wan/x", 500.0)
    assert "filename_prefix" in save.VALIDATE_INPUTS("../x", 16.0)
    assert sampler.VALIDATE_INPUTS(5.0, 5.0, 1.0) is True
    assert "cfg_low_noise: inf" in sampler.VALIDATE_INPUTS(5.0, 5.0, 1.0, cfg_low_noise=math.inf)
    assert "denoise: nan" in sampler.VALIDATE_INPUTS(5.0, 5.0, math.nan)
    assert sampler.VALIDATE_INPUTS(None, None, None) is True  # linked: decided when it runs
    assert latent.VALIDATE_INPUTS(64, 64, 5, 1) is True
    assert latent.VALIDATE_INPUTS(64, 64, 6, 1).startswith("frames: 6 is not of the form 4n+1")
    assert "width: 9000 is bigger than the maximum 8192" in latent.VALIDATE_INPUTS(9000, 64, 5, 1)
    assert decode.VALIDATE_INPUTS(272, 272, 144, 128, "tiled", 3.0) is True
    assert "mode: 'fast'" in decode.VALIDATE_INPUTS(272, 272, 144, 128, "fast", 3.0)


def test_linked_non_finite_value_is_refused_when_the_node_runs(models, tmp_path):
    from wan_enhanced.nodes.common import NodeInputError

    host.set_headless_folders(models=models, output=tmp_path / "out")
    try:
        (model,) = NODES["WanEnhancedModelLoader"]().load(DIT, "fp32", "sdpa")
        (latent,) = NODES["WanEnhancedEmptyLatent"]().make(model, 64, 64, 5, 1)
        import torch
        rows = [[torch.zeros(1, 4, model.config.text_dim), {}]]
        with pytest.raises(NodeInputError, match="Wan Sampler: cfg: nan is not a finite"):
            NODES["WanEnhancedSampler"]().run(model, rows, rows, latent, 1, 1, math.nan, 5.0,
                                              "unipc", 1.0)
    finally:
        host.set_headless_folders(models="models", output="output")
