"""The CLIP image encoder of Wan2.1 image-to-video: conformance with transformers'
CLIPVisionModel (tests/data/clip_vision_reference.safetensors, made by
conformance/make_clip_vision_reference.py), the checkpoint layouts, preprocessing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wan_enhanced.checkpoints import tiny
from wan_enhanced.checkpoints.clip_vision import load_clip_vision
from wan_enhanced.checkpoints.reader import CheckpointError
from wan_enhanced.wan.clip_vision import CLIPVisionConfig, CLIPVisionEncoder, config_from_state

GOLDEN = Path(__file__).parent / "data" / "clip_vision_reference.safetensors"


@pytest.fixture(scope="module")
def golden():
    with safe_open(str(GOLDEN), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    weights = {k.removeprefix("weights."): v for k, v in tensors.items()
               if k.startswith("weights.")}
    return weights, tensors["input.pixels"], tensors["output.penultimate"], metadata


def test_penultimate_hidden_states_match_transformers(golden):
    weights, pixels, expected, metadata = golden
    config = config_from_state(weights)
    reference = json.loads(metadata["config"])
    assert (config.hidden, config.layers, config.heads, config.intermediate, config.image_size,
            config.patch) == (reference["hidden_size"], reference["num_hidden_layers"],
                              reference["num_attention_heads"], reference["intermediate_size"],
                              reference["image_size"], reference["patch_size"])
    model = CLIPVisionEncoder(config)
    model.load_state_dict(weights, strict=True)
    out = model(pixels)
    assert out.shape == expected.shape == (2, config.tokens, config.hidden)
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-5
    # the last layer is left out: with it the output moves far
    with torch.no_grad():
        full = model.vision_model.encoder.layers[-1](out)
    assert float((full - expected).abs().max() / expected.abs().max()) > 0.1


def test_loader_reads_comfyui_layout_and_bare_tower(tmp_path, golden):
    weights, pixels, expected, _ = golden
    prefixed = tmp_path / "clip_vision_h.safetensors"
    save_file({**weights, "visual_projection.weight": torch.zeros(160, 160)}, str(prefixed))
    bare = tmp_path / "bare.safetensors"
    save_file({k.removeprefix("vision_model."): v for k, v in weights.items()}, str(bare))
    for path in (prefixed, bare):
        model = load_clip_vision(path, torch.float32)
        assert float((model(pixels) - expected).abs().max() / expected.abs().max()) < 1e-5
    half = load_clip_vision(prefixed)  # fp16 by default, as the node's default
    assert next(half.parameters()).dtype == torch.float16


def test_official_layout_loads_as_the_same_tower(tmp_path):
    comfy = tiny.write_clip_vision(tmp_path / "clip_vision_h.safetensors", seed=4)
    official = tiny.write_clip_vision(tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge"
                                      "-14.pth", seed=4, layout="official")
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    a, b = load_clip_vision(comfy, torch.float32), load_clip_vision(official, torch.float32)
    assert a.config == b.config
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert torch.equal(a(pixels), b(pixels))


def test_loader_refuses_other_files_by_name(tmp_path, golden):
    weights = golden[0]
    other = tmp_path / "other.safetensors"
    save_file({"model.weight": torch.zeros(2)}, str(other))
    with pytest.raises(CheckpointError, match="other.safetensors: not a CLIP vision checkpoint"):
        load_clip_vision(other)
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in weights.items() if "layers.1." not in k}, str(partial))
    with pytest.raises(CheckpointError, match="partial.safetensors: .*lacks"):
        load_clip_vision(partial)
    text_only = tmp_path / "text_only.safetensors"
    save_file({"visual.head": torch.zeros(4, 4)}, str(text_only))
    with pytest.raises(CheckpointError, match="text_only.safetensors: not a complete CLIP "
                                              "vision tower"):
        load_clip_vision(text_only)


def test_preprocess_scales_the_short_side_and_centre_crops():
    model = CLIPVisionEncoder(CLIPVisionConfig(**tiny.TINY_CLIP_VISION))
    columns = torch.linspace(0, 1, 112)
    image = columns.view(1, 1, 112, 1).expand(1, 56, 112, 3)  # twice as wide as high
    pixels = model.preprocess(image)
    assert pixels.shape == (1, 3, 56, 56)
    # the middle half of the columns survives, normalised with CLIP's statistics
    red = pixels[0, 0, 0] * 0.26862954 + 0.48145466
    assert torch.allclose(red, columns[28:84], atol=1e-5)
