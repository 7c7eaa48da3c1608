"""LoRA files: every key format we read is detected from its keys and placed on the model's
parameters; anything else is refused by name, before any weight is touched."""

import warnings
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from wan_enhanced.checkpoints.reader import CheckpointError
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit
from wan_enhanced.lora.file import LoraError, check_lora_keys, open_lora
from wan_enhanced.lora.patches import Difference, LowRank
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.tiny import FORMATS, block_modules, lora_state, random_lora, write_lora

CONFIG = TINY_DIT["t2v"]
SHAPES = dit_shapes(CONFIG)
DIFFS = ("blocks.0.norm3.weight", "blocks.1.ffn.0.bias", "head.head.weight")


def read_all(lora):
    """{our key: (kind, tensors..., scale)} of an opened LoRA."""
    out = {}
    for key, patch in lora.patches.items():
        if isinstance(patch, LowRank):
            out[key] = ("pair", lora.tensor(patch.up), lora.tensor(patch.down), patch.scale)
        else:
            out[key] = ("diff", lora.tensor(patch.key))
    return out


def same(a, b):
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            for x, y in zip(a[k], b[k])) for k in a)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "kohya"])
def test_every_format_reads_as_the_same_lora(tmp_path, fmt):
    content = random_lora(CONFIG, seed=1, alpha=2.0, diffs=DIFFS)
    with open_lora(write_lora(tmp_path / "k.safetensors", content, "kohya"), SHAPES) as ref, \
            open_lora(write_lora(tmp_path / f"{fmt}.safetensors", content, fmt), SHAPES) as lora:
        assert same(read_all(lora), read_all(ref))
        assert len(lora.patches) == 20 + len(DIFFS)
        assert lora.patches["blocks.0.self_attn.q.weight"].scale == 2.0 / 4
        assert isinstance(lora.patches["blocks.1.ffn.0.bias"], Difference)


def test_styles_are_named(tmp_path):
    content = random_lora(CONFIG, seed=1)
    expected = {"kohya": "kohya", "kohya_fun": "kohya", "generic": "generic",
                "generic_down_up": "generic", "bare": "generic", "diffusers": "diffusers"}
    for fmt, style in expected.items():
        with open_lora(write_lora(tmp_path / f"{fmt}.safetensors", content, fmt), SHAPES) as f:
            assert f.styles == (style,) and f"{style} names" in f.summary()


def test_other_prefixes_and_pth_files(tmp_path):
    content = random_lora(CONFIG, seed=2, modules=["blocks.0.ffn.2"])
    state = lora_state(content, "bare")
    for prefix in ("model.diffusion_model.", "base_model.model.", "transformer."):
        path = tmp_path / f"{prefix}safetensors"
        save_file({prefix + k: v for k, v in state.items()}, str(path))
        with open_lora(path, SHAPES) as lora:
            assert list(lora.patches) == ["blocks.0.ffn.2.weight"]
    with open_lora(write_lora(tmp_path / "l.pth", content, "generic"), SHAPES) as lora:
        assert list(lora.patches) == ["blocks.0.ffn.2.weight"]


def test_ranks_per_layer_and_partial_coverage(tmp_path):
    modules = block_modules(CONFIG, blocks=[1])[:3] + ["text_embedding.0", "patch_embedding"]
    ranks = {m: i + 1 for i, m in enumerate(modules)}
    content = random_lora(CONFIG, seed=3, modules=modules, rank=ranks)
    with open_lora(write_lora(tmp_path / "p.safetensors", content, "generic"), SHAPES) as lora:
        assert {k: p.rank for k, p in lora.patches.items()} == \
            {f"{m}.weight": r for m, r in ranks.items()}
        assert all(p.scale == 1.0 for p in lora.patches.values())  # no alpha: scale 1
        assert "rank 1..5" in lora.summary()


@pytest.mark.parametrize("key, named", [
    ("lora_unet_blocks_0_ffn_0.oft_diag", "LyCORIS OFT in its first layout"),
    ("diffusion_model.blocks.0.ffn.0.oft_R", "BOFT in its first layout"),
    ("diffusion_model.blocks.0.ffn.0.lora_mid.weight", "Tucker"),
    ("diffusion_model.blocks.0.ffn.0.reshape_weight", "a reshaping patch"),
])
def test_other_formats_are_refused_naming_the_first_key_of_a_known_format(tmp_path, key, named):
    """The refusal is decided over all the keys: an unknown key sorting first does not decide
    the message when another key names a format we know of."""
    state = lora_state(random_lora(CONFIG, seed=4, modules=["blocks.0.ffn.0"]), "generic")
    state[key] = torch.zeros(3)
    state["aaa.unknown_too"] = torch.zeros(3)
    path = tmp_path / "other.safetensors"
    save_file(state, str(path))
    for check in (lambda: check_lora_keys(path), lambda: open_lora(path, SHAPES)):
        with pytest.raises(LoraError) as caught:
            check()
        message = str(caught.value)
        assert str(path) in message and repr(key) in message and named in message
        assert "2 of its 4 keys are of no format we read" in message
        assert "'aaa.unknown_too'" not in message and "kohya/musubi" in message
        assert "full model" not in message


def test_a_model_weight_inside_a_lora_is_named_as_such_not_as_a_full_model(tmp_path):
    state = lora_state(random_lora(CONFIG, seed=4, modules=["blocks.0.ffn.0"]), "generic")
    state["model.diffusion_model.blocks.0.ffn.0.weight"] = torch.zeros(3)
    path = tmp_path / "mixed.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError) as caught:
        open_lora(path, SHAPES)
    message = str(caught.value)
    assert ("1 of its 3 keys is of no LoRA format this package reads; the first is "
            "'model.diffusion_model.blocks.0.ffn.0.weight' (it looks like a model's own weight)"
            in message)
    assert "full model" not in message


def test_a_lora_for_another_model_size_names_file_key_and_both_shapes(tmp_path):
    bigger = replace(CONFIG, dim=384, num_heads=3)
    path = write_lora(tmp_path / "big.safetensors", random_lora(bigger, seed=5), "kohya")
    with pytest.raises(LoraError) as caught:
        open_lora(path, SHAPES)
    message = str(caught.value)
    assert str(path) in message
    assert "'lora_unet_blocks_0_cross_attn_k.lora_up.weight' has shape [384, 4]" in message
    assert "blocks.0.cross_attn.k.weight is [256, 256]" in message


def test_a_difference_of_another_shape_is_refused(tmp_path):
    content = random_lora(CONFIG, seed=6, modules=[], diffs=("blocks.0.modulation",))
    content.diffs["blocks.0.modulation"] = torch.zeros(1, 6, 512)
    path = write_lora(tmp_path / "d.safetensors", content, "generic")
    with pytest.raises(LoraError, match=r"'diffusion_model.blocks.0.modulation.diff' has shape "
                                        r"\[1, 6, 512\] but the model's blocks.0.modulation is "
                                        r"\[1, 6, 256\]"):
        open_lora(path, SHAPES)


def test_keys_matching_nothing_are_listed_and_nothing_at_all_is_an_error(tmp_path):
    state = lora_state(random_lora(CONFIG, seed=7, modules=["blocks.0.ffn.0"]), "kohya")
    extra = {f"lora_te_text_model_encoder_layers_{i}_mlp_fc1.lora_down.weight": torch.zeros(2, 4)
             for i in range(7)}
    extra.update({k.replace("lora_down", "lora_up"): torch.zeros(4, 2) for k in extra})
    path = tmp_path / "partly.safetensors"
    save_file({**state, **extra}, str(path))
    with pytest.warns(RuntimeWarning, match=r"7 LoRA modules fit nothing in this model and are "
                                            r"left out: lora_te_text_model_encoder_layers_0_mlp_fc1"
                                            r".*and 2 more"):
        with open_lora(path, SHAPES) as lora:
            assert list(lora.patches) == ["blocks.0.ffn.0.weight"]
    only_extra = tmp_path / "te_only.safetensors"
    save_file(extra, str(only_extra))
    with pytest.raises(LoraError, match=r"te_only.safetensors: no key of this LoRA fits the model"):
        open_lora(only_extra, SHAPES)


@pytest.mark.parametrize("drop, message", [
    (".lora_down.weight", "has no partner"),
    ("both", "is an alpha without the low-rank pair, LoHa or LoKr factors of its module"),
])
def test_incomplete_pairs_are_refused(tmp_path, drop, message):
    state = lora_state(random_lora(CONFIG, seed=8, modules=["blocks.0.ffn.0"], alpha=4.0),
                       "kohya")
    for key in list(state):
        if key.endswith(".lora_down.weight") or (drop == "both" and key.endswith("up.weight")):
            del state[key]
    path = tmp_path / "half.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match=message):
        open_lora(path, SHAPES)


def test_a_pair_and_a_difference_on_one_module_is_ambiguous(tmp_path):
    state = lora_state(random_lora(CONFIG, seed=9, modules=["blocks.0.ffn.0"]), "generic")
    state["diffusion_model.blocks.0.ffn.0.diff"] = torch.zeros(512, 256)
    path = tmp_path / "both.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match="both a low-rank pair and a full difference"):
        open_lora(path, SHAPES)


def test_corrupt_files_get_the_checkpoint_readers_errors(tmp_path):
    good = write_lora(tmp_path / "good.safetensors", random_lora(CONFIG, seed=10), "kohya")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    text = tmp_path / "notes.safetensors"
    text.write_text("not a LoRA")
    for path in (truncated, text):
        with pytest.raises(CheckpointError, match=r"not a readable safetensors file \(truncated "
                                                  r"or corrupt\?\)"):
            open_lora(path, SHAPES)
    with pytest.raises(CheckpointError, match="no such file"):
        open_lora(tmp_path / "missing.safetensors", SHAPES)
    other = tmp_path / "lora.txt"
    other.write_text("x")
    with pytest.raises(CheckpointError, match="unknown checkpoint format"):
        open_lora(other, SHAPES)


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            import os
            return (os.system, ("echo never",))

    path = tmp_path / "evil.pth"
    torch.save({"diffusion_model.blocks.0.ffn.0.lora_A.weight": Payload()}, path)
    with pytest.raises(CheckpointError, match="refused to load"):
        open_lora(path, SHAPES)


def test_an_empty_file_and_a_non_float_tensor(tmp_path):
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    with pytest.raises(LoraError, match="holds no tensors"):
        open_lora(empty, SHAPES)
    state = lora_state(random_lora(CONFIG, seed=11, modules=["blocks.0.ffn.0"]), "generic")
    state["diffusion_model.blocks.0.ffn.0.lora_A.weight"] = torch.zeros(4, 256, dtype=torch.int8)
    path = tmp_path / "int.safetensors"
    save_file(state, str(path))
    with pytest.raises(LoraError, match="is int8; LoRA tensors are floating point"):
        open_lora(path, SHAPES)


def test_checking_a_model_file_as_a_lora_names_it(tmp_path):
    dit = write_dit(tmp_path / "dit.safetensors", CONFIG, "comfy")
    with pytest.raises(LoraError, match="full model rather than a LoRA"):
        check_lora_keys(dit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lora_keys(write_lora(tmp_path / "ok.safetensors", random_lora(CONFIG), "diffusers"))
