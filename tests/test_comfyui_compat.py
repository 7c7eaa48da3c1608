"""What a real ComfyUI sees of the package without running one: the template browser's folders,
the memory probe's any-type, and loaders whose default dtype suits the machine."""

import json
from pathlib import Path

import pytest
import torch

from wan_enhanced import NODE_CLASS_MAPPINGS, host
from wan_enhanced.checkpoints import tiny
from wan_enhanced.pipeline import loading
from wan_enhanced import gpu_support

ROOT = Path(__file__).resolve().parent.parent
# app/custom_node_manager.py: every one of these folders is listed in the template browser
TEMPLATE_FOLDERS = ("example_workflows", "example", "examples", "workflow", "workflows")


def test_the_template_browser_finds_one_folder_so_lists_each_workflow_once():
    assert [name for name in TEMPLATE_FOLDERS if (ROOT / name).is_dir()] == ["example_workflows"]
    assert {p.stem for p in (ROOT / "api_workflows").glob("*.json")} == \
        {p.stem for p in (ROOT / "example_workflows").glob("*.json")}


def test_the_probe_sends_star_to_the_editor_and_fits_every_type_in_prompt_checks():
    probe = NODE_CLASS_MAPPINGS["WanEnhancedMemoryProbe"]
    (returned,) = probe.RETURN_TYPES
    assert json.dumps([returned, probe.INPUT_TYPES()["required"]["value"][0]]) == '["*", "*"]'
    for wire in ("WANMODEL", "WANTEXTENCODER", "CONDITIONING", "LATENT", "IMAGE"):
        # comfy_execution/validation.py validate_node_input's first test, both ways round
        assert not returned != wire and not wire != returned


def test_auto_dtype_is_fp32_on_a_cpu_and_bf16_on_a_gpu(tmp_path, monkeypatch):
    assert loading.resolve_dtype("auto", on_gpu=True) == "bf16"
    assert loading.resolve_dtype("auto", on_gpu=False) == "fp32"
    assert loading.resolve_dtype("fp16", on_gpu=True) == "fp16"
    monkeypatch.setattr(gpu_support, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="bf16 weights on the CPU: .*'auto' picks fp32"):
        assert loading.resolve_dtype("bf16", on_gpu=False) == "bf16"

    monkeypatch.setattr(host, "compute_device", lambda: torch.device("cpu"))
    tiny.write_models_folder(tmp_path, dit_name="dit.safetensors", vae_name="vae.safetensors",
                             text_encoder_name="te.safetensors", kind="t2v")
    host.set_headless_folders(models=tmp_path)
    try:
        nodes = {name: NODE_CLASS_MAPPINGS[f"WanEnhanced{name}"]() for name in
                 ("ModelLoader", "VAELoader", "TextEncoderLoader")}
        (model,) = nodes["ModelLoader"].load("dit.safetensors", "auto", "sdpa")
        (vae,) = nodes["VAELoader"].load("vae.safetensors", "auto")
        (encoder,) = nodes["TextEncoderLoader"].load("te.safetensors", "auto", "gpu")
    finally:
        host.set_headless_folders(models="models")
    for handle in (model, vae):
        assert {p.dtype for p in handle.model.parameters()} == {torch.float32}
    # the encoder's token table keeps the file's narrower float type (a lookup widens exactly)
    table = encoder.model.token_embedding.weight
    rest = {n: p.dtype for n, p in encoder.model.named_parameters() if n != "token_embedding.weight"}
    assert set(rest.values()) == {torch.float32}
    assert table.dtype == torch.bfloat16  # the tiny file stores bf16
    for cls in (NODE_CLASS_MAPPINGS[f"WanEnhanced{n}"] for n in
                ("ModelLoader", "VAELoader", "TextEncoderLoader", "CLIPVisionLoader")):
        required = cls.INPUT_TYPES()["required"]
        spec = required.get("weight_dtype") or required["dtype"]
        assert spec[1]["default"] == "auto" and "fp32 on a CPU" in spec[1]["tooltip"]


def test_text_encoding_reports_progress_per_block(tmp_path):
    """A CPU encode of the full umT5 takes minutes: one progress update per block (inside
    ComfyUI its progress bar, which also checks for an interrupt)."""
    tiny.write_models_folder(tmp_path, dit_name="dit.safetensors", vae_name="vae.safetensors",
                             text_encoder_name="te.safetensors", kind="t2v")
    host.set_headless_folders(models=tmp_path)
    seen = []
    listener = lambda label, value, total: seen.append((label, value, total))  # noqa: E731
    host.add_progress_listener(listener)
    try:
        (encoder,) = NODE_CLASS_MAPPINGS["WanEnhancedTextEncoderLoader"]().load(
            "te.safetensors", "fp32", "cpu")
        NODE_CLASS_MAPPINGS["WanEnhancedTextEncode"]().encode(encoder, "a fox", "blurry")
    finally:
        host.remove_progress_listener(listener)
        host.set_headless_folders(models="models")
    blocks = len(encoder.model.blocks)
    assert blocks >= 2 and seen == [("Wan Text Encode", i, blocks) for i in range(1, blocks + 1)]


def test_a_comfyui_outside_the_tested_range_gets_one_line_and_the_nodes(monkeypatch, caplog):
    import importlib
    import logging
    import sys
    import types

    import wan_enhanced

    assert host.TESTED_COMFYUI == ("0.3.64", "0.30.0")
    for inside in ("0.3.64", "0.4.0", "v0.30.0", None, "unknown"):
        assert host.untested_version_note(inside) is None, inside
    for outside in ("0.3.63", "0.30.1", "0.35.0"):
        note = host.untested_version_note(outside)
        assert note == (f"comfyui-wan-enhanced: tested with ComfyUI 0.3.64 to 0.30.0; this is "
                        f"{outside}. The nodes are loaded; report what does not work")
    monkeypatch.setitem(sys.modules, "comfyui_version",
                        types.SimpleNamespace(__version__="0.35.0"))
    assert host.comfyui_version() == "0.35.0"
    with caplog.at_level(logging.WARNING, logger="wan_enhanced"):
        importlib.reload(wan_enhanced)
    assert [r.getMessage() for r in caplog.records] == [host.untested_version_note("0.35.0")]
    assert "WanEnhancedAttentionPatch" in wan_enhanced.NODE_CLASS_MAPPINGS
    monkeypatch.setitem(sys.modules, "comfyui_version",
                        types.SimpleNamespace(__version__="0.30.0"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wan_enhanced"):
        importlib.reload(wan_enhanced)
    assert caplog.records == []
