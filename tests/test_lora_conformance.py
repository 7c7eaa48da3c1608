"""Merged weights equal ComfyUI's own LoRA arithmetic: tests/data/lora holds a tiny random Wan
DiT, LoRA files in every key format we read and, for chains of them at several strengths, the
weights ComfyUI computes (conformance/make_lora_reference.py ran comfy.sd.load_lora_for_models
and comfy.lora.calculate_weight on them). Our merge while loading must give the same weights to
1e-5 relative, change exactly the weights ComfyUI changes, and leave every other weight as the
file has it.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.lora.file import open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.merge import Merge

DATA = Path(__file__).parent / "data" / "lora"
DESCRIPTION = json.loads((DATA / "cases.json").read_text())
CASES = DESCRIPTION["cases"]


def reference(case: str) -> dict[str, torch.Tensor]:
    with safe_open(str(DATA / "reference.safetensors"), "pt") as f:
        return {k.split("/", 1)[1]: f.get_tensor(k) for k in f.keys()
                if k.split("/", 1)[0] == case}


@pytest.fixture(scope="module")
def base():
    model, info = load_dit(DATA / "base.safetensors", torch.float32)
    return model, info


def merged(chain, config, dtype=torch.float32, quantization=None):
    loras = [(open_lora(DATA / name, dit_shapes(config)), strength) for name, strength in chain]
    try:
        return load_dit(DATA / "base.safetensors", dtype, quantization, Merge.of(loras))[0]
    finally:
        for lora, _ in loras:
            lora.close()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_merged_weights_equal_comfyui(case, base):
    model_base, info = base
    expected = reference(case)
    assert expected, case
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every module of these files fits the model
        model = merged(CASES[case]["loras"], info.config)
    ours = model.state_dict()
    original = model_base.state_dict()
    changed = {k for k in ours if not torch.equal(ours[k], original[k])}
    assert changed == set(expected)
    for key, value in expected.items():
        assert relative(ours[key], value) < 1e-5, key


def test_formats_comfyui_does_not_read_merge_as_their_twins(base):
    """Bare official names and diffusers names hold the same LoRA as a prefixed twin: merged,
    they give the twin's weights bit for bit."""
    _, info = base
    for case in ("bare", "diffusers", "stack_unread_by_comfyui"):
        spec = CASES[case]
        assert spec["loras"] != spec["comfyui_reads"]
        ours = merged(spec["loras"], info.config).state_dict()
        twin = merged(spec["comfyui_reads"], info.config).state_dict()
        assert all(torch.equal(ours[k], twin[k]) for k in ours), case


def test_the_reference_covers_every_format_and_several_strengths():
    files = {name for spec in CASES.values() for name, _ in spec["loras"]}
    assert files == {f"{n}.safetensors" for n in
                     ("kohya", "kohya_fun", "generic", "distill", "bare", "diffusers")}
    strengths = {s for spec in CASES.values() for _, s in spec["loras"]}
    assert len(strengths) >= 5 and any(s < 0 for s in strengths)
    assert max(len(spec["loras"]) for spec in CASES.values()) >= 4


def test_the_committed_inputs_are_what_the_generator_writes(tmp_path):
    """conformance/lora_inputs.py regenerates the model, LoRA files and cases bit for bit (the
    reference was computed on exactly these)."""
    from wan_enhanced.conformance import lora_inputs

    assert lora_inputs.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "cases.json").read_text()) == DESCRIPTION
    for path in sorted(DATA.glob("*.safetensors")):
        if path.name == "reference.safetensors":
            continue
        with safe_open(str(path), "pt") as committed, \
                safe_open(str(tmp_path / path.name), "pt") as fresh:
            assert list(committed.keys()) == list(fresh.keys()), path.name
            assert all(torch.equal(committed.get_tensor(k), fresh.get_tensor(k))
                       for k in committed.keys()), path.name
