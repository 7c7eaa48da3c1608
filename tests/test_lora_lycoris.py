"""LoHa, LoKr, DoRA, LightX2V's `.diff_m` and PEFT's lora_B bias in every path a LoRA takes: the
arithmetic against the formats' definitions where ComfyUI cannot be the reference (Tucker cores
and LoKr on the Conv3d patch embedding: ComfyUI's einsums are written for 2-D convolutions),
unmerged equal to merged, quantized bases, block swap, `lora merge`, and bad input refused by
name before any weight changes. (Equality with ComfyUI's and PEFT's own merges on the same
files: tests/test_lora_conformance.py.)"""

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.reader import open_checkpoint
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit
from wan_enhanced.lora import apply as lora_apply
from wan_enhanced.lora.file import LoraError, open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.layers import LoraLinear, wrappers
from wan_enhanced.lora.merge import Merge
from wan_enhanced.lora.patches import Decomposed, Difference, Hadamard, Kronecker, LowRank
from wan_enhanced.lora.tiny import (LoraContent, add_dora, block_modules, lightx2v_lora,
                                    lora_state, random_lokr, random_loha, random_lora,
                                    write_lora)
from wan_enhanced.pipeline.dit_placement import DiTPlacement
from wan_enhanced.pipeline.loading import load_model
from wan_enhanced.pipeline.lora import with_lora
from wan_enhanced.pipeline.placement import DevicePlacement
from wan_enhanced.quant.rowwise import FP8, INT8, quantize_weight
from wan_enhanced.runner.cli import main

CONFIG = TINY_DIT["t2v"]
SHAPES = dit_shapes(CONFIG)
BLOCK0 = block_modules(CONFIG, blocks=[0])
BLOCK1 = block_modules(CONFIG, blocks=[1])
LAYOUTS = {m: ("w2_ab", "w1_ab", "both_ab", "whole")[i % 4] for i, m in enumerate(BLOCK1)}


def relative(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def peft_bias_content(seed: int) -> LoraContent:
    modules = [m for m in BLOCK1 if ".self_attn." in m]
    content = random_lora(CONFIG, seed=seed, modules=modules, rank=4)
    gen = torch.Generator().manual_seed(seed)
    content.up_bias = {m: 0.05 * torch.randn(SHAPES[f"{m}.bias"], generator=gen)
                       for m in modules}
    return content


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lycoris")
    base = write_dit(root / "base.safetensors", CONFIG, "comfy", dtype=torch.float32)
    weights = load_dit(base, torch.float32)[0].state_dict()
    loha = random_loha(CONFIG, seed=1, modules=BLOCK0[:4] + ["patch_embedding"], rank=4,
                       alpha=2.0, tucker=("patch_embedding",))
    lokr = random_lokr(CONFIG, seed=2, modules=BLOCK1 + ["patch_embedding"], factor=4, rank=3,
                       alpha=4.0, layouts=LAYOUTS)
    dora = add_dora(random_lora(CONFIG, seed=3, modules=BLOCK1, rank=4, alpha=3.0), weights,
                    seed=4, modules=BLOCK1[:5])
    add_dora(dora, weights, seed=5, modules=BLOCK1[5:], axis="columns")
    return {
        "base": base,
        "fp8": write_dit(root / "fp8.safetensors", CONFIG, "comfy_fp8", dtype=torch.float32),
        "loha": write_lora(root / "loha.safetensors", loha, "kohya"),
        "lokr": write_lora(root / "lokr.safetensors", lokr, "lycoris_diffusers"),
        "dora": write_lora(root / "dora.safetensors", dora, "generic"),
        "lightx2v": write_lora(root / "lightx2v.safetensors",
                               lightx2v_lora(CONFIG, seed=6, rank=8, pair_min=60_000),
                               "lightx2v", dtype=torch.bfloat16),
        "peft_bias": write_lora(root / "peft_bias.safetensors", peft_bias_content(7),
                                "diffusers"),
    }


def merged_state(base, loras, dtype=torch.float32, quantization=None):
    opened = [(open_lora(path, SHAPES), strength) for path, strength in loras]
    try:
        return load_dit(base, dtype, quantization, Merge.of(opened))[0]
    finally:
        for lora, _ in opened:
            lora.close()


def inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, CONFIG.in_dim, 3, 4, 6, generator=gen)
    return x, torch.tensor([637.0]), torch.randn(1, 7, CONFIG.text_dim, generator=gen)


def forward(handle, block_swap=0):
    x, t, context = inputs()
    with DevicePlacement("cpu") as placement, DiTPlacement(placement, block_swap) as dit:
        dit.place(handle)
        return handle.model(x, t, context, blocks=dit.blocks(handle))


# -- reading -----------------------------------------------------------------------------------

def test_each_kind_is_read_and_summarised(files):
    expected = {"loha": Hadamard, "lokr": Kronecker, "dora": (Decomposed, LowRank)}
    with open_lora(files["loha"], SHAPES) as lora:
        assert {type(p) for p in lora.patches.values()} == {Hadamard}
        assert lora.patches["patch_embedding.weight"].t1 is not None
        assert lora.patches["blocks.0.self_attn.q.weight"].scale == 2.0 / 4
        assert "5 LoHa (rank 4); kohya names" in lora.summary()
    with open_lora(files["lokr"], SHAPES) as lora:
        assert {type(p) for p in lora.patches.values()} == {Kronecker}
        assert len(lora.patches) == len(BLOCK1) + 1 and lora.styles == ("lycoris",)
        both = lora.patches["blocks.1.self_attn.v.weight"]  # both sides decomposed: w2's rank
        assert (both.rank, both.scale) == (3, 4.0 / 3)
        whole = lora.patches["blocks.1.self_attn.o.weight"]  # both whole: no rank, scale 1
        assert (whole.rank, whole.scale) == (None, 1.0)
        assert lora.settings == {"lokr_factor": 4.0} and "lokr_factor=4" in lora.summary()
    with open_lora(files["dora"], SHAPES) as lora:
        dora = [p for p in lora.patches.values() if isinstance(p, Decomposed)]
        assert len(dora) == len(BLOCK1) and all(isinstance(p.inner, LowRank) for p in dora)
        assert "10 DoRA" in lora.summary()
    with open_lora(files["lightx2v"], SHAPES) as lora:
        for key in ("blocks.0.modulation", "blocks.1.modulation", "head.modulation",
                    "patch_embedding.weight", "blocks.1.ffn.2.bias", "blocks.0.norm3.weight"):
            assert isinstance(lora.patches[key], Difference), key
        assert isinstance(lora.patches["blocks.0.ffn.0.weight"], LowRank)
        assert len(lora.patches) == len(SHAPES)  # every tensor of the model
    with open_lora(files["peft_bias"], SHAPES) as lora:
        bias = lora.patches["blocks.1.self_attn.q.bias"]
        assert isinstance(bias, Difference) and bias.key.endswith(".lora_B.bias")
    assert expected  # (the kinds above are the whole set of patch types)


# -- the arithmetic ----------------------------------------------------------------------------

def test_loha_tucker_and_lokr_on_the_conv3d_patch_embedding_follow_their_definitions(files):
    """LoHa with Tucker cores: each factor m[o, i, k] = sum_ab a[a, o] t[a, b, k] b[b, i];
    LoKr on a convolution: delta[p*R + q, r*C + s, k] = w1[p, r] * w2[q, s, k]. Written here
    block by block, independently of lora/patches.py's einsum and kron."""
    base = load_dit(files["base"], torch.float32)[0].state_dict()["patch_embedding.weight"]
    out, into, *kernel = base.shape
    strength = 0.6
    with open_lora(files["loha"], SHAPES) as lora:
        patch = lora.patches["patch_embedding.weight"]
        t = {k: lora.tensor(getattr(patch, k)) for k in ("w1_a", "w1_b", "w2_a", "w2_b", "t1",
                                                          "t2")}
        sides = []
        for a, b, core in (("w1_a", "w1_b", "t1"), ("w2_a", "w2_b", "t2")):
            m = torch.zeros(out, into, math.prod(kernel))
            for k in range(math.prod(kernel)):
                m[:, :, k] = t[a].T @ t[core].flatten(2)[:, :, k] @ t[b]
            sides.append(m.reshape(base.shape))
        loha_delta = patch.scale * sides[0] * sides[1]
    with open_lora(files["lokr"], SHAPES) as lora:
        patch = lora.patches["patch_embedding.weight"]
        w1 = lora.tensor(patch.w1)
        rows, cols = out // w1.shape[0], into // w1.shape[1]
        w2 = (lora.tensor(patch.w2_a) @ lora.tensor(patch.w2_b)).reshape(rows, cols, *kernel)
        lokr_delta = torch.zeros(base.shape)
        for p in range(w1.shape[0]):
            for r in range(w1.shape[1]):
                lokr_delta[p * rows:(p + 1) * rows, r * cols:(r + 1) * cols] = w1[p, r] * w2
        lokr_delta *= patch.scale
    for name, delta in (("loha", loha_delta), ("lokr", lokr_delta)):
        merged = merged_state(files["base"], [(files[name], strength)]).state_dict()
        change = merged["patch_embedding.weight"] - base
        assert relative(change, strength * delta) < 1e-5, name
        assert relative(change, torch.zeros_like(change) + 1e-30) > 0  # it does change


def test_dora_rescales_rows_and_columns_to_its_magnitudes(files):
    """At strength 1 the DoRA result's column norms are the stored magnitudes (per input column);
    per output row, ComfyUI's arithmetic scales W + delta by magnitude / |row of W|."""
    base = load_dit(files["base"], torch.float32)[0].state_dict()
    merged = merged_state(files["base"], [(files["dora"], 1.0)]).state_dict()
    with open_lora(files["dora"], SHAPES) as lora:
        for module in BLOCK1:
            key = f"{module}.weight"
            patch = lora.patches[key]
            magnitude = lora.tensor(patch.magnitude).float()
            changed = base[key] + patch.scale * (lora.tensor(patch.inner.up)
                                                 @ lora.tensor(patch.inner.down))
            if magnitude.shape[0] == 1:  # per input column: the columns' norms are reached
                assert torch.allclose(merged[key].norm(dim=0), magnitude.flatten(), rtol=1e-5)
            else:
                rows = base[key].norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
                assert relative(merged[key], changed * magnitude / rows) < 1e-6


# -- every path --------------------------------------------------------------------------------

CHAIN = [("loha", 0.8), ("lokr", -0.5), ("dora", 0.7), ("lightx2v", 1.0), ("peft_bias", 1.2)]


def test_unmerged_equals_merged_for_every_kind(files):
    handle = load_model(files["base"], "fp32", "sdpa")
    for name, strength in CHAIN:
        handle = with_lora(handle, files[name], strength, "unmerged")
    out = forward(handle)
    expected = merged_state(files["base"], [(files[n], s) for n, s in CHAIN])(*inputs())
    assert relative(out, expected) < 1e-5
    found = wrappers(handle.model)
    assert all(type(w) is LoraLinear for w in found.values())
    # LoHa kept apart as its full difference, LightX2V's pair and bias difference as such;
    # the layers a DoRA rescales (all of block 1) have every change merged in the chain's order
    assert [a.kind for a in found["blocks.0.self_attn.q"].adapters] == [
        "weight_diff", "low_rank", "bias_diff"]
    assert set(found) == set(BLOCK0)
    base_only = forward(load_model(files["base"], "fp32", "sdpa"))
    assert relative(out, base_only) > 0.05


def test_unmerged_strength_changes_form_no_difference_again(files, monkeypatch, tmp_path):
    files = {**files, **{n: Path(shutil.copy(files[n], tmp_path)) for n in ("loha", "lokr")}}
    formed = []
    real = lora_apply.unscaled_delta
    monkeypatch.setattr(lora_apply, "unscaled_delta",
                        lambda *a, **k: (formed.append(1), real(*a, **k))[1])
    base = load_model(files["base"], "fp32", "sdpa")
    handles = [with_lora(with_lora(base, files["loha"], strength, "unmerged"), files["lokr"],
                         strength, "unmerged") for strength in (1.0, 0.4, -0.9)]
    for handle in handles:
        strength = handle.loras[0].strength
        expected = merged_state(files["base"], [(files["loha"], strength),
                                                (files["lokr"], strength)])(*inputs())
        assert relative(forward(handle), expected) < 1e-5
        # 4 LoHa + 10 LoKr block matrices formed on the first use only
        assert len(formed) == 14


@pytest.mark.parametrize("weight_dtype, fmt", [("int8", INT8), ("fp8_e4m3fn", FP8)])
@pytest.mark.parametrize("file", ["base", "fp8"])
@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_quantized_bases_take_the_merged_weight_and_dora_is_always_merged(
        files, weight_dtype, fmt, file, mode):
    chain = [("lokr", 0.9), ("dora", 0.8), ("lightx2v", 1.0)]
    handle = load_model(files[file], weight_dtype, "sdpa")
    for name, strength in chain:
        handle = with_lora(handle, files[name], strength, mode)
    forward(handle)
    merged = merged_state(files[file], [(files[n], s) for n, s in chain]).state_dict()
    # modulation: float32, exactly the merged value in both modes
    assert torch.equal(handle.model.blocks[0].modulation, merged["blocks.0.modulation"])
    # a layer a DoRA rescales: the whole chain merged into it, then quantized, in both modes
    rescaled = handle.model.blocks[1].self_attn.q
    codes, scales = quantize_weight(merged["blocks.1.self_attn.q.weight"], fmt)
    assert torch.equal(rescaled.weight, codes) and torch.equal(rescaled.weight_scale, scales)
    # a layer with LightX2V's pair only: merged, or its codes as loaded and the pair apart
    layer = handle.model.blocks[0].self_attn.q
    if mode == "merge":
        codes, scales = quantize_weight(merged["blocks.0.self_attn.q.weight"], fmt)
    else:
        layer = layer.base
        loaded = load_model(files[file], weight_dtype, "sdpa").model.blocks[0].self_attn.q
        codes, scales = loaded.weight, loaded.weight_scale
    assert torch.equal(layer.weight, codes) and torch.equal(layer.weight_scale, scales)


def test_block_swap_streams_loha_and_lokr_differences_with_their_block(files):
    handle = with_lora(with_lora(load_model(files["base"], "bf16", "sdpa"), files["loha"], 0.7,
                                 "unmerged"), files["lokr"], 0.5, "unmerged")
    resident = forward(handle)
    assert torch.equal(forward(handle, block_swap=2), resident)
    assert torch.equal(forward(handle, block_swap=1), resident)


def test_lora_merge_command_writes_what_merging_at_load_gives(files, tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    args = [f"{files[n]}:{s}" for n, s in CHAIN]
    assert main(["lora", "merge", str(files["fp8"]), *args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 LoHa (rank 4)" in printed and "lokr_factor=4" in printed and "10 DoRA" in printed
    written = load_dit(out, torch.float32)[0].state_dict()
    at_load = merged_state(files["fp8"], [(files[n], s) for n, s in CHAIN]).state_dict()
    with open_checkpoint(out) as merged_file, open_checkpoint(files["fp8"]) as source:
        assert merged_file.keys() == source.keys()
        key = "model.diffusion_model.blocks.1.ffn.0.weight"
        assert merged_file.dtype(key) == source.dtype(key) == torch.float8_e4m3fn
    for key in ("blocks.0.modulation", "head.modulation", "blocks.1.self_attn.q.bias",
                "patch_embedding.weight"):
        assert relative(written[key], at_load[key]) < 1e-6, key
    # fp8 block matrices: the merged weight encoded again, to fp8's rounding
    assert relative(written["blocks.1.ffn.0.weight"], at_load["blocks.1.ffn.0.weight"]) < 0.07


# -- bad input ---------------------------------------------------------------------------------

def corrupt(state, key_end, tensor):
    key = next(k for k in state if k.endswith(key_end))
    state[key] = tensor
    return key


@pytest.mark.parametrize("content, fmt, key_end, bad, message", [
    (lambda: random_loha(CONFIG, 1, ["blocks.0.ffn.0"]), "generic", ".hada_w1_b",
     torch.zeros(4, 100), r"\[512, 4\] times .*\[4, 100\] does not make the model's "
                          r"blocks.0.ffn.0.weight \[512, 256\]: expected \[512, rank\] and "
                          r"\[rank, 256\]"),
    (lambda: random_lokr(CONFIG, 1, ["blocks.0.ffn.0"], factor=4, layouts={
        "blocks.0.ffn.0": "whole"}), "generic", ".lokr_w2", torch.zeros(100, 64),
     r"the LoKr factors of blocks.0.ffn.0.weight \(.*lokr_w2' \[100, 64\], expected \[128, 64\]"
     r"\) do not make its shape \[512, 256\]"),
    (lambda: add_dora(random_lora(CONFIG, 1, ["blocks.0.ffn.0"]), {
        "blocks.0.ffn.0.weight": torch.ones(512, 256)}, 1, ["blocks.0.ffn.0"]), "kohya",
     ".dora_scale", torch.ones(500, 1),
     r"'lora_unet_blocks_0_ffn_0.dora_scale' has shape \[500, 1\] but the model's "
     r"blocks.0.ffn.0.weight is \[512, 256\]: a DoRA scale is \[512, 1\] \(per output row\) or "
     r"\[1, 256\] \(per input column\)"),
    (lambda: lightx2v_lora(CONFIG, 1, rank=4), "lightx2v", "blocks.0.diff_m",
     torch.zeros(1, 6, 512), r"'diffusion_model.blocks.0.diff_m' has shape \[1, 6, 512\] but "
                             r"the model's blocks.0.modulation is \[1, 6, 256\]"),
])
def test_factors_that_do_not_make_the_layer_are_refused_naming_key_shapes_and_file(
        files, tmp_path, content, fmt, key_end, bad, message):
    state = lora_state(content(), fmt)
    key = corrupt(state, key_end, bad)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match=message) as caught:
        open_lora(path, SHAPES)
    assert str(path) in str(caught.value) and key in str(caught.value)
    # nothing changes: the model keeps its weights, `lora merge` writes nothing
    base = load_model(files["base"], "fp32", "sdpa")
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    with pytest.raises(Exception, match="bad.safetensors"):
        with_lora(base, path, 1.0)
    assert all(torch.equal(v, before[k]) for k, v in base.model.state_dict().items())
    out = tmp_path / "never.safetensors"
    assert main(["lora", "merge", str(files["base"]), str(path), "--out", str(out)]) == 2
    assert not out.exists() and not list(tmp_path.glob("*.partial*"))


def test_contradicting_keys_are_refused(tmp_path):
    content = lightx2v_lora(CONFIG, 1, rank=4)
    state = lora_state(content, "lightx2v")
    state["diffusion_model.blocks.0.modulation.diff"] = state["diffusion_model.blocks.0.diff_m"] * 2
    path = tmp_path / "twice.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match=r"'diffusion_model.blocks.0.diff_m' and "
                                        r"'diffusion_model.blocks.0.modulation.diff' are the "
                                        r"same diff of module"):
        open_lora(path, SHAPES)
    lokr = lora_state(random_lokr(CONFIG, 1, ["blocks.0.ffn.0"], layouts={
        "blocks.0.ffn.0": "w1_ab"}), "generic")
    lokr["diffusion_model.blocks.0.ffn.0.lokr_w1"] = torch.ones(4, 4)
    save_file(lokr, str(path))
    with pytest.raises(LoraError, match="both give LoKr's w1; which one applies is ambiguous"):
        open_lora(path, SHAPES)
    loha = lora_state(random_loha(CONFIG, 1, ["blocks.0.ffn.0"]), "generic")
    del loha["diffusion_model.blocks.0.ffn.0.hada_w2_b"]
    save_file(loha, str(path))
    with pytest.raises(LoraError, match="has no partner: the file lacks its hada_w2_b key"):
        open_lora(path, SHAPES)


def test_a_file_that_says_dora_without_its_magnitudes_is_refused(tmp_path):
    content = random_lora(CONFIG, 1, ["blocks.0.ffn.0"])
    content.settings["dora"] = 1.0
    path = write_lora(tmp_path / "dora_flag.safetensors", content, "kohya")
    with pytest.raises(LoraError, match="says dora=1 but holds no dora_scale key"):
        open_lora(path, SHAPES)
    content.settings["dora"] = 0.0
    with open_lora(write_lora(path, content, "kohya"), SHAPES) as lora:
        assert lora.settings == {"dora": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        content.settings = {"lokr_factor": 8.0}
        with open_lora(write_lora(path, content, "kohya"), SHAPES) as lora:
            assert "lokr_factor=8" in lora.summary()


# -- OFT ---------------------------------------------------------------------------------------

def test_oft_at_strength_one_is_a_rotation_of_each_block_of_rows(files, tmp_path):
    """Without a constraint, OFT at strength 1 turns each block of output rows by an
    orthogonal matrix: every column's norm within every block is kept, the weight changes."""
    from wan_enhanced.lora.patches import Orthogonal
    from wan_enhanced.lora.tiny import random_oft

    path = write_lora(tmp_path / "oft.safetensors",
                      random_oft(CONFIG, 3, BLOCK1, block_size=16), "kohya")
    with open_lora(path, SHAPES) as lora:
        assert all(isinstance(p, Orthogonal) for p in lora.patches.values())
        assert "10 OFT" in lora.summary()
    base = load_dit(files["base"], torch.float32)[0].state_dict()
    merged = merged_state(files["base"], [(path, 1.0)]).state_dict()
    for module in BLOCK1:
        key = f"{module}.weight"
        before = base[key].view(-1, 16, base[key].shape[1]).norm(dim=1)
        after = merged[key].view(-1, 16, base[key].shape[1]).norm(dim=1)
        assert torch.allclose(after, before, rtol=1e-5), key
        assert not torch.equal(merged[key], base[key])


def test_oft_in_unmerged_mode_is_merged_in_the_chains_order(files, tmp_path):
    from wan_enhanced.lora.tiny import random_oft

    oft = write_lora(tmp_path / "oft.safetensors",
                     random_oft(CONFIG, 4, BLOCK0[:3], block_size=16, constraint=0.5), "kohya")
    chain = [("loha", 0.9), (oft, 0.8)]
    handle = load_model(files["base"], "fp32", "sdpa")
    for name, strength in chain:
        handle = with_lora(handle, files.get(name, name), strength, "unmerged")
    expected = merged_state(files["base"], [(files.get(n, n), s) for n, s in chain])(*inputs())
    assert relative(forward(handle), expected) < 1e-5
    found = wrappers(handle.model)
    # the layers OFT turns are merged whole; the LoHa's fourth layer stays apart
    assert set(found) == {BLOCK0[3]}


@pytest.mark.parametrize("change, message", [
    ("shape", r"has shape \[4, 16, 16\] but the model's blocks.0.ffn.0.weight has 512 output "
              r"rows: OFT blocks are \[k, n, n\] with k \* n = 512"),
    ("rescale", r"'lora_unet_blocks_0_ffn_0.rescale' is OFT's output rescaling, which ComfyUI "
                r"leaves out when it merges OFT; refused rather than ignored"),
    ("dora", r"'lora_unet_blocks_0_ffn_0.dora_scale' beside OFT, BOFT or GLoRA factors"),
])
def test_bad_oft_files_are_refused_by_name(tmp_path, change, message):
    from wan_enhanced.lora.tiny import random_oft

    state = lora_state(random_oft(CONFIG, 5, ["blocks.0.ffn.0"], block_size=16), "kohya")
    if change == "shape":
        state["lora_unet_blocks_0_ffn_0.oft_blocks"] = torch.zeros(4, 16, 16)
    elif change == "rescale":
        state["lora_unet_blocks_0_ffn_0.rescale"] = torch.ones(512, 1)
    else:
        state["lora_unet_blocks_0_ffn_0.dora_scale"] = torch.ones(512, 1)
    path = tmp_path / "bad_oft.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match=message):
        open_lora(path, SHAPES)


def test_a_weight_replacement_sets_the_weight_whatever_the_strength(files, tmp_path):
    content = random_lora(CONFIG, 6, ["blocks.0.ffn.2"], rank=2)
    new = torch.randn(SHAPES["blocks.1.ffn.0.weight"], generator=torch.Generator().manual_seed(7))
    content.replacements = {"blocks.1.ffn.0": new}
    path = write_lora(tmp_path / "set.safetensors", content, "generic")
    with open_lora(path, SHAPES) as lora:
        assert "1 weight replacements (the strength does not apply)" in lora.summary()
    for strength in (1.0, 0.3):
        merged = merged_state(files["base"], [(path, strength)]).state_dict()
        assert torch.equal(merged["blocks.1.ffn.0.weight"], new)
    handle = with_lora(load_model(files["base"], "fp32", "sdpa"), path, 0.3, "unmerged")
    forward(handle)
    assert torch.equal(handle.model.blocks[1].ffn[0].weight, new)  # merged, not a term
    assert set(wrappers(handle.model)) == {"blocks.0.ffn.2"}


# -- non-finite values -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["merge", "unmerged"])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_a_lora_with_non_finite_values_is_refused_naming_file_and_keys(files, tmp_path, mode,
                                                                        poison):
    """A NaN or an infinity stored in a LoRA matrix gave an all-black video and exit 0:
    refused, naming the file and the keys, and the model keeps the weights it had."""
    content = random_lora(CONFIG, 8, ["blocks.0.ffn.0"], rank=4, alpha=4.0)
    state = lora_state(content, "generic")
    state["diffusion_model.blocks.0.ffn.0.lora_A.weight"][1, 3] = float(poison)
    path = tmp_path / "poisoned.safetensors"
    save_file(state, str(path))
    base = load_model(files["base"], "fp32", "sdpa")
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    handle = with_lora(base, path, 1.0, mode)
    with pytest.raises(LoraError, match=r"poisoned.safetensors: .*'diffusion_model.blocks.0."
                                        r"ffn.0.lora_B.weight'.* NaN or infinite values"):
        forward(handle)
    forward(base)  # the model without it computes as before
    after = base.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    out = tmp_path / "never.safetensors"
    assert main(["lora", "merge", str(files["base"]), str(path), "--out", str(out)]) == 2
    assert not out.exists()


def test_a_sample_that_turns_non_finite_stops_the_run_at_that_step():
    from wan_enhanced.sampling.loop import NonFiniteSample, denoise
    from wan_enhanced.sampling.solvers import make_schedule, make_solver

    calls = []

    def model(x, t, cond):
        calls.append(1)
        return torch.full_like(x, float("nan")) if len(calls) == 2 else torch.zeros_like(x)

    solver = make_solver("euler", make_schedule("euler", 4, 5.0))
    with pytest.raises(NonFiniteSample, match="after step 2 of 4"):
        denoise(model, torch.randn(1, 4, 1, 2, 2), solver)
    assert len(calls) == 2


# -- BOFT and GLoRA ----------------------------------------------------------------------------

def test_boft_and_glora_change_the_weight_by_a_function_of_it_in_either_mode(files, tmp_path):
    """BOFT (butterfly rotations) and GLoRA (W a1 a2 + b1 b2) depend on the weight: unmerged,
    the layers they change are merged in the chain's order; the result equals the merged
    chain."""
    from wan_enhanced.lora.patches import Butterfly, Generalized
    from wan_enhanced.lora.tiny import random_boft, random_glora

    boft = write_lora(tmp_path / "boft.safetensors",
                      random_boft(CONFIG, 9, BLOCK0[:2], levels=3, block_size=16, rescale=True),
                      "generic")
    glora = write_lora(tmp_path / "glora.safetensors",
                       random_glora(CONFIG, 10, BLOCK0[2:4], rank=4, alpha=2.0), "kohya")
    with open_lora(boft, SHAPES) as lora:
        assert {type(p) for p in lora.patches.values()} == {Butterfly}
        assert "2 BOFT" in lora.summary()
    with open_lora(glora, SHAPES) as lora:
        patch = lora.patches[f"{BLOCK0[2]}.weight"]
        assert isinstance(patch, Generalized) and not patch.old_layout
        assert patch.scale == 2.0 / 4
    chain = [("lokr", 0.5), (boft, 0.8), (glora, 1.0), ("loha", 0.6)]
    handle = load_model(files["base"], "fp32", "sdpa")
    for name, strength in chain:
        handle = with_lora(handle, files.get(name, name), strength, "unmerged")
    expected = merged_state(files["base"], [(files.get(n, n), s) for n, s in chain])(*inputs())
    assert relative(forward(handle), expected) < 1e-5
    wrapped = set(wrappers(handle.model))
    assert not wrapped & set(BLOCK0[:4])  # what BOFT and GLoRA change: merged, LoHa's too
    assert wrapped == set(BLOCK1)  # LoKr's terms apart


def test_boft_without_an_alpha_applies_unconstrained(files, tmp_path):
    """ComfyUI fails on a BOFT module without an alpha (it compares None with 0) and leaves it
    out; here no alpha means no constraint, as in OFT."""
    from wan_enhanced.lora.tiny import random_boft

    path = write_lora(tmp_path / "boft.safetensors",
                      random_boft(CONFIG, 11, [BLOCK0[0]], levels=2, block_size=16), "generic")
    zero = write_lora(tmp_path / "boft0.safetensors",
                      random_boft(CONFIG, 11, [BLOCK0[0]], levels=2, block_size=16,
                                  constraint=0.0), "generic")
    key = f"{BLOCK0[0]}.weight"
    a = merged_state(files["base"], [(path, 1.0)]).state_dict()[key]
    b = merged_state(files["base"], [(zero, 1.0)]).state_dict()[key]
    base = load_dit(files["base"], torch.float32)[0].state_dict()[key]
    assert torch.equal(a, b) and not torch.equal(a, base)


@pytest.mark.parametrize("change, message", [
    ("boft", r"BOFT blocks are \[m, k, n, n\] with n even, k \* n = 256"),
    ("glora", r"the GLoRA factors of blocks.0.self_attn.q.weight .* do not make its shape "
              r"\[256, 256\]"),
])
def test_boft_and_glora_factors_that_do_not_fit_are_refused(tmp_path, change, message):
    from wan_enhanced.lora.tiny import random_boft, random_glora

    if change == "boft":
        state = lora_state(random_boft(CONFIG, 12, ["blocks.0.self_attn.q"], levels=2,
                                       block_size=16), "generic")
        state["diffusion_model.blocks.0.self_attn.q.oft_blocks"] = torch.zeros(2, 8, 16, 16)
    else:
        state = lora_state(random_glora(CONFIG, 13, ["blocks.0.self_attn.q"], rank=4), "generic")
        state["diffusion_model.blocks.0.self_attn.q.b1.weight"] = torch.zeros(200, 4)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match=message):
        open_lora(path, SHAPES)
