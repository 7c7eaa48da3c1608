"""Scenario workflows: every API file validates against the registered nodes, every UI file in
example_workflows/ describes the same graph as its API twin, and the demo runs end to end."""

import json
import time
from pathlib import Path

import pytest
import torch

from wan_enhanced import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, host
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_clip_vision, write_dit, write_models_folder
from wan_enhanced.lora.tiny import lightx2v_lora, random_lora, write_lora
from wan_enhanced.profiling.events import EventLog
from wan_enhanced.runner.cli import main
from wan_enhanced.runner.headless_nodes import local_registry
from wan_enhanced.runner.ui_format import api_to_ui, ui_to_api
from wan_enhanced.runner.workflow import WorkflowError, validate

ROOT = Path(__file__).resolve().parent.parent
API = sorted((ROOT / "api_workflows").glob("*.json"))
SCENARIOS = {"wan22_ti2v_5b_speed_preview", "wan22_ti2v_5b_efficiency", "wan22_ti2v_5b_max_quality",
             "wan22_ti2v_5b_long_duration", "wan21_t2v_1_3b_memory_baseline",
             "wan21_tiled_decode_comparison", "wan22_ti2v_5b_image_to_video",
             "wan22_i2v_a14b_image_to_video", "wan21_i2v_14b_image_to_video",
             "wan22_t2v_a14b_4step_lora", "wan22_ti2v_5b_distill", "wan21_t2v_14b_distill"}
IMAGE_TO_VIDEO = sorted(name for name in SCENARIOS if name.endswith("image_to_video"))
TINY_CLIP = dict(hidden=64, layers=2, heads=1, intermediate=128, image_size=28, patch=14)
# the A14B experts and their 4-step LoRAs of the LoRA example
EXPERTS = {"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors":
           "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
           "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors":
           "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny files under every model name the workflows use, so file inputs validate."""
    root = tmp_path_factory.mktemp("models")
    write_models_folder(root, dit_name="wan2.2_ti2v_5B_fp16.safetensors",
                        vae_name="wan2.2_vae.safetensors",
                        text_encoder_name="umt5_xxl_fp16.safetensors", kind="ti2v")
    write_models_folder(root, dit_name="wan2.1_t2v_1.3B_fp16.safetensors",
                        vae_name="wan_2.1_vae.safetensors",
                        text_encoder_name="umt5_xxl_fp16.safetensors", kind="t2v")
    for seed, (expert, lora) in enumerate(EXPERTS.items()):
        write_dit(root / "diffusion_models" / expert, TINY_DIT["t2v"], "comfy_fp8", seed=seed)
        write_lora(root / "loras" / lora, random_lora(TINY_DIT["t2v"], seed=seed), "generic")
    # the distill scenarios: LightX2V-layout LoRAs, a 14B fp8-scaled file
    write_lora(root / "loras" / "wan2.2_ti2v_5b_lightx2v_4step_lora_rank64.safetensors",
               lightx2v_lora(TINY_DIT["ti2v"], seed=3, rank=4), "lightx2v")
    write_dit(root / "diffusion_models" / "wan2.1_t2v_14B_fp8_scaled.safetensors",
              TINY_DIT["t2v"], "comfy_fp8", seed=4)
    write_lora(root / "loras" / "lightx2v_t2v_14b_cfg_step_distill_v2_lora_rank64_bf16.safetensors",
               lightx2v_lora(TINY_DIT["t2v"], seed=5, rank=4), "lightx2v", dtype=torch.bfloat16)
    for dit, kind in (("wan2.2_i2v_high_noise_14B_fp16.safetensors", "i2v_a14b"),
                      ("wan2.2_i2v_low_noise_14B_fp16.safetensors", "i2v_a14b"),
                      ("wan2.1_i2v_480p_14B_fp16.safetensors", "i2v")):
        write_models_folder(root, dit_name=dit, vae_name="wan_2.1_vae.safetensors",
                            text_encoder_name="umt5_xxl_fp16.safetensors", kind=kind)
    write_clip_vision(root / "clip_vision" / "clip_vision_h.safetensors", TINY_CLIP)
    images = root / "input"
    images.mkdir()
    write_test_image(images / "example.png")
    host.set_headless_folders(models=root, input=images)
    yield root
    host.set_headless_folders(models="models", input="input")


def write_test_image(path: Path, width: int = 40, height: int = 24) -> Path:
    """A small RGBA picture: a colour gradient, its alpha a left-to-right ramp."""
    from PIL import Image

    pixels = [(x * 6 % 256, y * 10 % 256, (x + y) * 4 % 256, x * 255 // (width - 1))
              for y in range(height) for x in range(width)]
    image = Image.new("RGBA", (width, height))
    image.putdata(pixels)
    image.save(path)
    return path


def test_every_scenario_is_there():
    assert {p.stem for p in API} == SCENARIOS
    assert {p.stem for p in (ROOT / "example_workflows").glob("*.json")} == SCENARIOS


@pytest.mark.parametrize("path", API, ids=lambda p: p.stem)
def test_api_workflow_validates(path, models):
    validated = validate(json.loads(path.read_text()), local_registry(), str(path))
    assert validated.output_nodes and not validated.warnings


@pytest.mark.parametrize("path", API, ids=lambda p: p.stem)
def test_ui_twin_is_the_same_graph(path):
    api = json.loads(path.read_text())
    ui = json.loads((ROOT / "example_workflows" / path.name).read_text())
    assert ui_to_api(ui, local_registry()) == api
    # and it is what our converter writes (links, slots, widget order)
    assert api_to_ui(api, local_registry()) == ui


def test_node_contracts():
    assert set(NODE_CLASS_MAPPINGS) == set(NODE_DISPLAY_NAME_MAPPINGS)
    for node_id, cls in NODE_CLASS_MAPPINGS.items():
        assert node_id.startswith("WanEnhanced")
        spec = cls.INPUT_TYPES()
        assert set(spec) <= {"required", "optional", "hidden"}
        assert callable(getattr(cls(), cls.FUNCTION))
        assert len(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)) == len(cls.RETURN_TYPES)
        for name, entry in {**spec.get("required", {}), **spec.get("optional", {})}.items():
            kind = entry[0]
            assert isinstance(kind, (str, list)), (node_id, name)
            if isinstance(kind, list) and len(entry) > 1 and "default" in entry[1]:
                assert entry[1]["default"] in kind, (node_id, name)


def test_wrong_workflow_reports_every_problem(models):
    api = json.loads((ROOT / "api_workflows" / "wan22_ti2v_5b_speed_preview.json").read_text())
    api["6"]["inputs"]["steps"] = 0
    api["6"]["inputs"]["scheduler"] = "ddim"
    api["7"]["inputs"]["vae"] = ["99", 0]
    with pytest.raises(WorkflowError) as info:
        validate(api, NODE_CLASS_MAPPINGS)
    text = str(info.value)
    assert "3 errors" in text
    assert 'input "steps"' in text and 'input "scheduler"' in text and "node 99" in text


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    start = time.perf_counter()
    assert main(["demo", "--out", str(out), "--quiet"]) == 0
    seconds = time.perf_counter() - start
    videos = sorted(out.glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 1000
    log = EventLog.load(out / "memory_events.json")
    stages = {e["stage"] for e in log.events}
    assert {"load", "text_encode", "sample", "decode", "save"} <= stages
    assert sum(1 for e in log.events if e["label"].startswith("step ")) == 5
    assert seconds < 120, f"the demo took {seconds:.0f} s"
    report = out / "memory_events-report.md"
    assert report.is_file() and "memory_events-timeline.png" in report.read_text()


def test_ui_file_saved_before_an_optional_widget_existed():
    """A probe saved with two widget values (before write_report was appended) still converts,
    the missing trailing optional widget taking its default, as ComfyUI's frontend does."""
    ui = json.loads((ROOT / "example_workflows" / "wan21_t2v_1_3b_memory_baseline.json").read_text())
    for node in ui["nodes"]:
        if node["type"] == "WanEnhancedMemoryProbe":
            node["widgets_values"] = node["widgets_values"][:2]
    api = ui_to_api(ui, NODE_CLASS_MAPPINGS)
    probes = [n for n in api.values() if n["class_type"] == "WanEnhancedMemoryProbe"]
    assert probes and all(p["inputs"]["write_report"] is False for p in probes)


@pytest.mark.parametrize("name", IMAGE_TO_VIDEO)
def test_image_to_video_workflow_runs_headless_from_load_image(name, models, tmp_path, capsys):
    """The same file ComfyUI runs: its LoadImage reads the input folder here too."""
    out = tmp_path / "out"
    code = main(["run", str(ROOT / "api_workflows" / f"{name}.json"), "--models", str(models),
                 "--input", str(models / "input"), "--out", str(out), "--quiet",
                 "--set", "5.width=64", "--set", "5.height=32", "--set", "5.frames=5",
                 "--set", "6.steps=2", "--set", "1.weight_dtype=fp32"])
    assert code == 0, capsys.readouterr().err
    (video,) = out.rglob("*.mp4")
    from wan_enhanced.pipeline.video_io import read_mp4
    frames, _ = read_mp4(video)
    assert tuple(frames.shape) == (5, 32, 64, 3)


def test_load_image_reads_like_comfyui(tmp_path):
    """RGB in 0..1 and MASK = 1 - alpha; names outside the input folder are refused."""
    from PIL import Image

    from wan_enhanced.runner.headless_nodes import LoadImage

    path = write_test_image(tmp_path / "ramp.png")
    host.set_headless_folders(input=tmp_path)
    try:
        image, mask = LoadImage().load_image("ramp.png")
        assert LoadImage.INPUT_TYPES()["required"]["image"][0] == ["ramp.png"]
        assert LoadImage.VALIDATE_INPUTS("ramp.png") is True
        assert "not a file of the input folder" in LoadImage.VALIDATE_INPUTS("gone.png")
        assert "image:" in LoadImage.VALIDATE_INPUTS("../ramp.png")
    finally:
        host.set_headless_folders(input="input")
    import numpy as np
    rgba = torch.from_numpy(np.array(Image.open(path)).astype("float32"))
    assert image.shape == (1, 24, 40, 3) and mask.shape == (1, 24, 40)
    assert torch.allclose(image[0], rgba[..., :3] / 255) and torch.allclose(mask[0],
                                                                           1 - rgba[..., 3] / 255)
    rgb = tmp_path / "plain.jpg"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(rgb)
    _, plain_mask = LoadImage().load_image(str(rgb))  # headless: an absolute path
    assert plain_mask.shape == (1, 64, 64) and not plain_mask.any()
