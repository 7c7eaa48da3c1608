"""Merged weights equal ComfyUI's own LoRA arithmetic: tests/data/lora holds a tiny random Wan
DiT (float32, and the same weights in bf16), LoRA files in every key format we read (low-rank
pairs under every naming, LightX2V's extractor layout with `.diff_m`, LoHa, LoKr, kohya DoRA,
LyCORIS names, PEFT lora_B biases and DoRA magnitudes) and, for chains of them at several
strengths, the weights ComfyUI computes (conformance/make_lora_reference.py ran
comfy.sd.load_lora_for_models and comfy.lora.calculate_weight on them) or, for PEFT's DoRA,
which ComfyUI does not read, the weights PEFT merges (conformance/make_peft_dora_reference.py).
Our merge while loading must give the same weights to 1e-5 relative on a float32 base (on a
bf16 base: their float32 result rounded to bf16), change exactly the weights the reference
changes, and leave every other weight as the file has it.
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
PEFT_CASES = DESCRIPTION["peft_cases"]
REFERENCES = {"reference.safetensors", "reference_peft.safetensors"}


def reference(case: str, file: str = "reference.safetensors") -> dict[str, torch.Tensor]:
    with safe_open(str(DATA / file), "pt") as f:
        return {k.split("/", 1)[1]: f.get_tensor(k) for k in f.keys()
                if k.split("/", 1)[0] == case}


def base_dtype(spec) -> torch.dtype:
    return torch.bfloat16 if spec["base"] == "base_bf16.safetensors" else torch.float32


@pytest.fixture(scope="module")
def bases():
    return {name: load_dit(DATA / name, dtype)
            for name, dtype in (("base.safetensors", torch.float32),
                                ("base_bf16.safetensors", torch.bfloat16))}


@pytest.fixture(scope="module")
def base(bases):
    return bases["base.safetensors"]


def merged(chain, config, dtype=torch.float32, quantization=None, base="base.safetensors"):
    loras = [(open_lora(DATA / name, dit_shapes(config)), strength) for name, strength in chain]
    try:
        return load_dit(DATA / base, dtype, quantization, Merge.of(loras))[0]
    finally:
        for lora, _ in loras:
            lora.close()


def assert_equals_reference(ours: torch.Tensor, expected: torch.Tensor, key: str) -> None:
    """float32: within 1e-5 of the reference's largest value; bf16: the float32 reference
    rounded to bf16, up to one unit in the last place where the two float32 results straddle a
    rounding boundary (at most 1% of the elements)."""
    if ours.dtype == torch.float32:
        assert relative(ours, expected) < 1e-5, key
        return
    assert ours.dtype == torch.bfloat16, key
    rounded = expected.to(torch.bfloat16)
    off = ours != rounded
    assert off.float().mean() <= 0.01, key
    spacing = torch.finfo(torch.bfloat16).eps * expected.abs().clamp_min(1e-30)
    assert torch.all((ours.float() - expected).abs()[off] <= spacing[off]), key


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def check_case(spec, expected, bases):
    model_base, info = bases[spec["base"]]
    assert expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every module of these files fits the model
        model = merged(spec["loras"], info.config, base_dtype(spec), base=spec["base"])
    ours = model.state_dict()
    original = model_base.state_dict()
    changed = {k for k in ours if not torch.equal(ours[k], original[k])}
    assert changed == set(expected)
    for key, value in expected.items():
        assert_equals_reference(ours[key], value, key)


@pytest.mark.parametrize("case", list(CASES))
def test_merged_weights_equal_comfyui(case, bases):
    check_case(CASES[case], reference(case), bases)


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_dora_merges_as_peft_does(case, bases):
    check_case(PEFT_CASES[case], reference(case, "reference_peft.safetensors"), bases)


def test_lightx2v_modulation_differences_are_the_intended_differences(base):
    """`blocks.N.diff_m` / `head.diff_m` (LightX2V's extractor) change the modulation tables by
    exactly strength times the stored difference, in float32."""
    model_base, info = base
    with safe_open(str(DATA / "lightx2v.safetensors"), "pt") as f:
        diffs = {k.removeprefix("diffusion_model.")[:-len(".diff_m")] + ".modulation":
                 f.get_tensor(k) for k in f.keys() if k.endswith(".diff_m")}
    assert sorted(diffs) == ["blocks.0.modulation", "blocks.1.modulation", "head.modulation"]
    for strength in (1.0, -0.7):
        ours = merged([("lightx2v.safetensors", strength)], info.config).state_dict()
        for key, diff in diffs.items():
            assert ours[key].dtype == torch.float32
            assert torch.equal(ours[key], torch.add(model_base.state_dict()[key], diff,
                                                    alpha=strength)), key


def test_formats_comfyui_does_not_read_merge_as_their_twins(base):
    """Bare official names and diffusers names hold the same LoRA as a prefixed twin: merged,
    they give the twin's weights bit for bit."""
    _, info = base
    for case in ("bare", "diffusers", "stack_unread_by_comfyui", "lightx2v", "lycoris",
                 "peft_bias"):
        spec = CASES[case]
        assert spec["loras"] != spec["comfyui_reads"]
        ours = merged(spec["loras"], info.config).state_dict()
        twin = merged(spec["comfyui_reads"], info.config).state_dict()
        assert all(torch.equal(ours[k], twin[k]) for k in ours), case


def test_the_reference_covers_every_format_and_several_strengths():
    files = {name for spec in [*CASES.values(), *PEFT_CASES.values()]
             for name, _ in spec["loras"]}
    assert files == {f"{n}.safetensors" for n in
                     ("kohya", "kohya_fun", "generic", "distill", "bare", "diffusers",
                      "lightx2v", "loha", "lokr", "lycoris", "dora", "peft_bias", "peft_dora",
                      "oft", "set", "glora", "boft")}
    assert {spec["base"] for spec in CASES.values()} == {"base.safetensors",
                                                         "base_bf16.safetensors"}
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
        if path.name in REFERENCES:
            continue
        with safe_open(str(path), "pt") as committed, \
                safe_open(str(tmp_path / path.name), "pt") as fresh:
            assert list(committed.keys()) == list(fresh.keys()), path.name
            assert all(torch.equal(committed.get_tensor(k), fresh.get_tensor(k))
                       for k in committed.keys()), path.name
