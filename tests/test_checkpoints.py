"""Checkpoint reading: real-size layouts on the meta device, every on-disk layout round-trips
through the tiny-checkpoint factory, and bad files give clear errors."""

import gc
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wan_enhanced.checkpoints import tiny
from wan_enhanced.checkpoints.loader import (inspect_checkpoint, load_dit, load_text_encoder,
                                             load_vae, prepare)
from wan_enhanced.checkpoints.reader import (CheckpointError, SafetensorsSource, TensorSource,
                                             open_checkpoint)
from wan_enhanced.wan.configs import DiTConfig

MANIFESTS = json.loads((Path(__file__).parent / "data" / "key_manifests.json").read_text())


class ManifestSource(TensorSource):
    """Keys and shapes of a real model with no weights behind them."""

    def __init__(self, name):
        self.path = Path(f"<manifest {name}>")
        self._entries = MANIFESTS[name]

    def keys(self):
        return list(self._entries)

    def shape(self, key):
        return tuple(self._entries[key][0])

    def dtype(self, key):
        return getattr(torch, self._entries[key][1])


REAL = {
    "official/wan21_t2v_1.3B": ("dit", "wan2.1-t2v-1.3b"),
    "official/wan21_t2v_14B": ("dit", "wan2.1-t2v-14b / wan2.2-t2v-a14b"),
    "official/wan21_i2v_14B": ("dit", "wan2.1-i2v-14b"),
    "official/wan22_ti2v_5B": ("dit", "wan2.2-ti2v-5b"),
    "official/wan22_i2v_A14B_expert": ("dit", "wan2.2-i2v-a14b"),
    "diffusers/wan21_t2v_1.3B": ("dit", "wan2.1-t2v-1.3b"),
    "diffusers/wan21_t2v_14B": ("dit", "wan2.1-t2v-14b / wan2.2-t2v-a14b"),
    "diffusers/wan22_ti2v_5B": ("dit", "wan2.2-ti2v-5b"),
    "official/vae21": ("vae21", "vae21"),
    "official/vae22": ("vae22", "vae22"),
    "diffusers/vae21": ("vae21", "vae21"),
    "diffusers/vae22": ("vae22", "vae22"),
    "official/umt5_xxl_encoder": ("t5", "umt5-xxl"),
    "hf/umt5_xxl_encoder": ("t5", "umt5-xxl"),
}


@pytest.mark.parametrize("manifest", sorted(REAL))
def test_real_size_layout_loads_strictly_on_meta(manifest):
    component, known = REAL[manifest]
    plan, module = prepare(ManifestSource(manifest))
    assert plan.identity.component == component
    assert plan.info.known_as == known
    # strict load of meta tensors with the file's shapes, both ways
    state = {ours: torch.empty(plan.source.shape(f), device="meta")
             for ours, f in plan.key_map.items()}
    module.load_state_dict(state, strict=True, assign=True)
    # no key of the file is left unread, apart from the tied copy of the T5 embedding
    left = set(plan.source.keys()) - set(plan.key_map.values())
    assert left <= {"encoder.embed_tokens.weight"}


def test_comfy_prefix_on_real_layout():
    class Prefixed(ManifestSource):
        def keys(self):
            return ["model.diffusion_model." + k for k in super().keys()]

        def shape(self, key):
            return super().shape(key.removeprefix("model.diffusion_model."))

        def dtype(self, key):
            return super().dtype(key.removeprefix("model.diffusion_model."))

    plan, _ = prepare(Prefixed("official/wan22_ti2v_5B"))
    assert plan.identity.layout == "comfy"
    assert plan.info.known_as == "wan2.2-ti2v-5b"
    assert plan.info.config.num_heads == 24


# -- round trips through the factory -----------------------------------------------------------

@pytest.mark.parametrize("layout", ["official", "sharded", "comfy", "diffusers"])
def test_dit_layouts_round_trip(tmp_path, layout):
    config = tiny.TINY_DIT["i2v" if layout == "diffusers" else "t2v"]
    state = tiny.random_dit_state(config, seed=3)
    name = "dit.safetensors" if layout == "comfy" else "dit"
    path = tiny.write_dit(tmp_path / name, config, layout, state=state, dtype=torch.float32)
    model, info = load_dit(path, dtype=torch.float32)
    assert info.component == "dit" and info.known_as is None
    assert info.config.dim == config.dim and info.config.num_heads == config.num_heads
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_dit_dtypes_after_load(tmp_path):
    path = tiny.write_dit(tmp_path / "dit.safetensors", tiny.TINY_DIT["t2v"], "comfy")
    model, _ = load_dit(path, dtype=torch.bfloat16)
    assert model.blocks[0].ffn[0].weight.dtype == torch.bfloat16
    assert model.time_projection[1].weight.dtype == torch.bfloat16
    assert model.blocks[0].modulation.dtype == torch.float32
    assert model.blocks[0].self_attn.norm_q.weight.dtype == torch.float32
    assert model.compute_dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())


def test_fp8_scaled_dit_is_dequantized(tmp_path):
    config = tiny.TINY_DIT["t2v"]
    state = tiny.random_dit_state(config, seed=4)
    path = tiny.write_dit(tmp_path / "fp8.safetensors", config, "comfy_fp8", state=state,
                          dtype=torch.float32)
    model, info = load_dit(path, dtype=torch.float32)
    assert info.fp8_scaled
    w = model.blocks[1].ffn[2].weight
    ref = state["blocks.1.ffn.2.weight"]
    # e4m3 keeps 3 mantissa bits: relative error per element below 2^-4 of the tensor's range
    assert (w - ref).abs().max() <= ref.abs().max() / 16
    assert torch.equal(model.head.head.weight, state["head.head.weight"])


@pytest.mark.parametrize("component", ["vae21", "vae22"])
@pytest.mark.parametrize("layout,name", [("official", "vae.safetensors"),
                                         ("official", "vae.pth"), ("diffusers", "vae")])
def test_vae_layouts_round_trip(tmp_path, component, layout, name):
    state = tiny.random_vae_state(component, seed=5)
    path = tiny.write_vae(tmp_path / name, component, layout, state=state)
    model, info = load_vae(path)
    assert info.component == component
    assert info.config == tiny.TINY_VAE[component]
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("layout,name", [("official", "t5.pth"), ("hf", "t5.safetensors")])
def test_text_encoder_layouts_round_trip(tmp_path, layout, name):
    path = tiny.write_text_encoder(tmp_path / name, layout, dtype=torch.float32,
                                   spiece_model=b"not-a-real-model" if layout == "hf" else None)
    model, spiece, info = load_text_encoder(path, dtype=torch.float32)
    assert info.component == "t5" and info.config == tiny.TINY_T5
    assert spiece == (b"not-a-real-model" if layout == "hf" else None)
    state = tiny.random_t5_state(seed=0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_inspect_names_component_and_layout(tmp_path):
    path = tiny.write_vae(tmp_path / "v.safetensors", "vae22")
    info = inspect_checkpoint(path)
    assert (info.component, info.layout) == ("vae22", "official")
    assert "Wan2.2 VAE" in info.description


# -- bad input ---------------------------------------------------------------------------------

def test_truncated_safetensors(tmp_path):
    path = tiny.write_dit(tmp_path / "d.safetensors", tiny.TINY_DIT["t2v"], "comfy")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"d\.safetensors.*truncated or corrupt"):
        load_dit(path)


def test_garbage_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_vae(path)


@pytest.mark.parametrize("form, expected", [
    ("zip", r"zip archive .*torch\.save.*give it its \.pt/\.pth name"),
    ("pickle", r"Python pickle .*give it its \.pt/\.ckpt name"),
    ("gguf", r"GGUF file.*GGUF loader"),
    ("lfs", r"Git LFS pointer"),
    ("html", r"HTML or XML page"),
    ("empty", r"empty \(0 bytes\)"),
])
def test_another_format_named_safetensors_is_named_for_what_it_is(tmp_path, form, expected):
    path = tmp_path / "m.safetensors"
    state = {"w": torch.ones(2)}
    if form == "zip":
        torch.save(state, path)
    elif form == "pickle":
        torch.save(state, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes({"gguf": b"GGUF\x03\x00\x00\x00" + bytes(32),
                          "lfs": b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\n",
                          "html": b"<!DOCTYPE html><html><body>Sign in</body></html>",
                          "empty": b""}[form])
    pattern = r"m\.safetensors: the file is (an? )?" + expected
    with pytest.raises(CheckpointError, match=pattern) as err:
        open_checkpoint(path)
    assert "truncated or corrupt" not in str(err.value)
    if form in ("zip", "pickle"):  # renamed as the message says, the same file is read
        renamed = path.rename(tmp_path / "m.pt")
        with open_checkpoint(renamed) as source:
            assert torch.equal(source.read("w"), state["w"])


def test_vae_given_to_the_model_loader(tmp_path):
    path = tiny.write_vae(tmp_path / "vae.safetensors", "vae21")
    with pytest.raises(CheckpointError, match=r"vae\.safetensors: this file is a Wan2\.1 VAE.*"
                                              r"VAE loader instead of the model loader"):
        load_dit(path)


def test_dit_given_to_the_vae_loader(tmp_path):
    path = tiny.write_dit(tmp_path / "dit.safetensors", tiny.TINY_DIT["t2v"], "comfy")
    with pytest.raises(CheckpointError, match="diffusion model.*not a Wan2.1 VAE or Wan2.2 VAE"):
        load_vae(path)


def test_unknown_layout(tmp_path):
    path = tmp_path / "sd.safetensors"
    save_file({"first_stage_model.decoder.conv_in.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(CheckpointError, match="unknown key layout.*first_stage_model"):
        load_dit(path)


def test_shapes_matching_no_configuration(tmp_path):
    config = tiny.TINY_DIT["t2v"]
    state = tiny.random_dit_state(config)
    state["blocks.1.ffn.0.weight"] = torch.zeros(300, config.dim)  # one block of another size
    state["blocks.1.ffn.0.bias"] = torch.zeros(300)
    state["blocks.1.ffn.2.weight"] = torch.zeros(config.dim, 300)
    path = tiny.write_dit(tmp_path / "odd.safetensors", config, "comfy", state=state)
    with pytest.raises(CheckpointError, match=r"shapes match no known configuration.*"
                                              r"blocks\.1\.ffn\.0\.weight \[300, 256\]"):
        load_dit(path)


def test_width_without_head_count(tmp_path):
    path = tmp_path / "w.safetensors"
    state = tiny.random_dit_state(DiTConfig(dim=200, ffn_dim=64, num_heads=2, num_layers=1))
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="width 200 is not a multiple of the head size"):
        load_dit(path)
    # a declared head count makes it loadable
    save_file(state, str(path), metadata={"config": json.dumps({"num_heads": 2})})
    model, info = load_dit(path, dtype=torch.float32)
    assert info.config.num_heads == 2


def test_missing_key(tmp_path):
    state = tiny.random_vae_state("vae21")
    del state["decoder.head.2.bias"]
    path = tiny.write_vae(tmp_path / "v.safetensors", "vae21", state=state)
    with pytest.raises(CheckpointError, match=r"1 missing \(decoder\.head\.2\.bias\)"):
        load_vae(path)


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pth_needing_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pth"
    torch.save({"weight": torch.zeros(2), "payload": _Payload()}, str(path))
    with pytest.raises(CheckpointError, match="evil.pth: refused to load.*arbitrary code"):
        load_vae(path)
    assert "this must never run" not in capsys.readouterr().out


def test_pickle_without_zip_is_refused(tmp_path):
    path = tmp_path / "old.pth"
    path.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match="old.pth"):
        load_vae(path)


def test_missing_shard(tmp_path):
    folder = tiny.write_dit(tmp_path / "sharded", tiny.TINY_DIT["t2v"], "sharded")
    (folder / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard 'diffusion_pytorch_model-00002-of-00002"
                                              ".safetensors' listed in the index is missing"):
        load_dit(folder)


def test_shard_path_opens_the_whole_set(tmp_path):
    """Naming one shard loads every tensor of the set: the same weights as the same model
    written as one file."""
    config = tiny.TINY_DIT["t2v"]
    folder = tiny.write_dit(tmp_path / "sharded", config, "sharded", seed=3)
    whole = tiny.write_dit(tmp_path / "whole", config, "official", seed=3)
    model, _ = load_dit(folder / "diffusion_pytorch_model-00001-of-00002.safetensors")
    reference, _ = load_dit(whole)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and len(model.blocks) == config.num_layers
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_dit(tmp_path / "nothing.safetensors")


def test_failed_load_leaves_no_tensor_behind(tmp_path, monkeypatch):
    config = tiny.TINY_DIT["t2v"]
    path = tiny.write_dit(tmp_path / "d.safetensors", config, "comfy", dtype=torch.float32)
    real_read = SafetensorsSource.read
    calls = []

    def failing_read(self, key):
        calls.append(key)
        if len(calls) == 20:
            raise CheckpointError("disk went away")
        return real_read(self, key)

    def big_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects()
                   if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type != "meta"
                   and o.numel() >= config.dim * config.dim)

    before = big_tensors()
    monkeypatch.setattr(SafetensorsSource, "read", failing_read)
    with pytest.raises(CheckpointError, match="disk went away"):
        load_dit(path, dtype=torch.float32)
    assert len(calls) == 20
    assert big_tensors() == before
    monkeypatch.setattr(SafetensorsSource, "read", real_read)
    model, _ = load_dit(path, dtype=torch.float32)  # the process stays usable
    assert len(model.blocks) == config.num_layers
