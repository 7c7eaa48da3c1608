"""ComfyUI's mixed-precision quantized files (a `comfy_quant` config per layer, or the
`_quantization_metadata` entry): every format ComfyUI 0.30 writes is read to the values
ComfyUI's own dequantization gives, or refused by name.

tests/data/comfy_quant/ is written by conformance/make_comfy_quant_reference.py with ComfyUI
0.30's layers and comfy-kitchen 0.2.27: the files as ComfyUI saves them and ComfyUI's float32
and bf16 dequantization of each layer."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wan_enhanced.checkpoints import comfy_quant, comfy_quant_write, tiny
from wan_enhanced.checkpoints.clip_vision import load_clip_vision
from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.reader import CheckpointError, open_checkpoint
from wan_enhanced.lora.file import open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.merge import Merge
from wan_enhanced.lora.merge_file import merge_file
from wan_enhanced.lora.tiny import random_lora, write_lora
from wan_enhanced.quant.on_load import dequantize_stored, stored_weight
from wan_enhanced.quant.rowwise import dequantize_weight
from wan_enhanced.quant.schemes import SCHEMES

DATA = Path(__file__).parent / "data" / "comfy_quant"
REFERENCE = load_file(str(DATA / "reference.safetensors"))
PREFIX = "model.diffusion_model."
# ComfyUI's bf16 dequantization of fp8 and nvfp4 multiplies in bf16 (the scale, and nvfp4's
# product of its two scales, rounded to bf16 first): up to 2^-7 of the value from the float32
# result rounded once, which is what we load. int8 and mxfp8 it computes in float32: equal.
BF16_BOUND = {"float8_e4m3fn": 2 ** -7, "float8_e5m2": 2 ** -7, "nvfp4": 2 ** -7,
              "int8_tensorwise": 0, "mxfp8": 0}


def _ours(source, layer, shape):
    """A layer's float32 weight, as the loader reads it (loader.read_float)."""
    if layer.dequantized:
        return comfy_quant.dequantize(source, layer, shape)
    return dequantize_stored(source.read(layer.weight), source.read(layer.keys["weight_scale"]))


@pytest.mark.parametrize("name", ["layers", "metadata"])
def test_each_format_dequantizes_to_comfyuis_values(name):
    source = open_checkpoint(DATA / f"{name}.safetensors")
    layers = comfy_quant.quant_layers(source.path, source)
    assert len(layers) == (9 if name == "layers" else 5)
    for key, layer in layers.items():
        expected = REFERENCE[key[:-len("weight")] + "float32"]
        ours = _ours(source, layer, tuple(expected.shape))
        assert torch.equal(ours, expected), key
        theirs = REFERENCE[key[:-len("weight")] + "bfloat16"].float()
        gap = (ours.to(torch.bfloat16).float() - theirs).abs()
        assert (gap <= BF16_BOUND[layer.format] * theirs.abs()).all(), key


def test_dequantized_formats_requantized_to_our_fp8_within_its_rounding():
    """mxfp8, nvfp4 and int8 convrot loaded as fp8: per-channel e4m3fn codes of ComfyUI's
    values, each within half a step of e4m3fn (2^-4 of the value, or 2^-10 of its row's scale
    below the normal range)."""
    source = open_checkpoint(DATA / "layers.safetensors")
    for key, layer in comfy_quant.quant_layers(source.path, source).items():
        if not layer.dequantized:
            continue
        expected = REFERENCE[key[:-len("weight")] + "float32"]
        stored = stored_weight(SCHEMES["fp8_e4m3fn"], _ours(source, layer, expected.shape), None)
        assert stored.codes.dtype == torch.float8_e4m3fn and not stored.kept_as_stored
        ours = dequantize_weight(stored.codes, stored.scales, torch.float32)
        bound = torch.maximum(expected.abs() * 2 ** -4, stored.scales[:, None] * 2 ** -10)
        assert ((ours - expected).abs() <= bound).all(), key


def test_per_tensor_formats_are_kept_as_stored_in_our_layers_of_their_codes():
    source = open_checkpoint(DATA / "layers.safetensors")
    layers = comfy_quant.quant_layers(source.path, source)
    for key, scheme in (("layers.fp8_e4m3.weight", "fp8_e4m3fn"),
                        ("layers.int8.weight", "int8"), ("layers.int8_rows.weight", "int8")):
        scale = source.read(layers[key].keys["weight_scale"])
        stored = stored_weight(SCHEMES[scheme], source.read(key), scale)
        assert stored.kept_as_stored and torch.equal(stored.codes, source.read(key))
        ours = dequantize_weight(stored.codes, stored.scales, torch.float32)
        assert torch.equal(ours, REFERENCE[key[:-len("weight")] + "float32"]), key


# -- a tiny DiT as a ComfyUI mixed-precision file ----------------------------------------------

CONFIG = tiny.TINY_DIT["t2v"]
FORMATS = {  # block matrices in each format, one embedding and the head; the rest plain
    "blocks.0.self_attn.q.weight": "float8_e4m3fn", "blocks.0.self_attn.k.weight": "float8_e5m2",
    "blocks.0.ffn.0.weight": "int8_tensorwise", "blocks.0.ffn.2.weight": "mxfp8",
    "blocks.1.cross_attn.v.weight": "nvfp4", "blocks.1.ffn.0.weight": "nvfp4",
    "blocks.1.self_attn.o.weight": "mxfp8", "text_embedding.0.weight": "nvfp4",
    "head.head.weight": "mxfp8",
    "blocks.1.ffn.2.weight": {"format": "int8_tensorwise", "convrot": True,
                              "convrot_groupsize": 16},
}
DEQUANTIZED = [k for k, f in FORMATS.items() if f in ("mxfp8", "nvfp4") or isinstance(f, dict)]


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(1, 16, 3, 8, 8, generator=gen), torch.tensor([700.0]),
            torch.randn(1, 20, CONFIG.text_dim, generator=gen))


def _fresh(model):
    """`model` with every tensor in memory of its own: the CPU's matrix products can round
    differently with their operands' alignment, and tensors read from a file keep its offsets."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The tiny DiT's state and a plain float32 file of the values the quantized one holds."""
    state = tiny.random_dit_state(CONFIG, seed=7)
    values = tiny.comfy_quant_values(state, FORMATS, torch.float32)
    path = tiny.write_dit(tmp_path_factory.mktemp("plain") / "plain.safetensors", CONFIG,
                          state=values, dtype=torch.float32)
    return state, path


@pytest.mark.parametrize("layout,metadata", [("comfy", False), ("comfy", True),
                                             ("official", False)])
def test_a_comfy_quant_dit_loads_and_computes_as_its_dequantized_weights(tmp_path, plain,
                                                                         layout, metadata):
    state, plain_path = plain
    name = "dit.safetensors" if layout == "comfy" else "dit"
    path = tiny.write_dit(tmp_path / name, CONFIG, layout, state=state, dtype=torch.float32,
                          comfy_quant=FORMATS, quant_metadata=metadata)
    with pytest.warns(RuntimeWarning) as caught:
        model, info = load_dit(path, torch.float32)
    notes = [str(w.message) for w in caught if "dequantized on load" in str(w.message)]
    assert len(notes) == 1 and "1 int8_tensorwise convrot, 3 mxfp8, 3 nvfp4 layers" in notes[0]
    assert info.comfy_quant == {"float8_e4m3fn": 1, "float8_e5m2": 1, "int8_tensorwise": 2,
                                "mxfp8": 3, "nvfp4": 3}
    reference, _ = load_dit(plain_path, torch.float32)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with torch.inference_mode():
        assert torch.equal(_fresh(model)(*_inputs()), _fresh(reference)(*_inputs()))


def test_comfy_quant_dit_in_our_quantized_layers(tmp_path, plain):
    """Loaded as fp8: float8_e4m3fn layers keep their codes, mxfp8, nvfp4 and int8 convrot
    layers get the codes their dequantized values give; loaded as int8: int8_tensorwise layers
    keep theirs (but the rotated ones)."""
    state, plain_path = plain
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, state=state, dtype=torch.float32,
                          comfy_quant=FORMATS)
    file = load_file(str(path))
    for scheme, kept in (("fp8_e4m3fn", "blocks.0.self_attn.q.weight"),
                         ("int8", "blocks.0.ffn.0.weight")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = load_dit(path, quantization=scheme)
        # one line per file and process: the second load of the same file says nothing more
        notes = [w for w in caught if "dequantized on load" in str(w.message)]
        assert len(notes) == (scheme == "fp8_e4m3fn")
        reference, _ = load_dit(plain_path, quantization=scheme)
        ours, theirs = model.state_dict(), reference.state_dict()
        assert torch.equal(ours[kept], file[PREFIX + kept]), scheme
        assert "1 block matrices kept as stored" in info.quantization_detail
        for key in DEQUANTIZED:
            scale = key[:-len("weight")] + "weight_scale"
            assert torch.equal(ours[key], theirs[key]), (scheme, key)
            assert (scale in ours) == (scale in theirs) == key.startswith("blocks.")
            assert scale not in ours or torch.equal(ours[scale], theirs[scale]), key


def test_padded_block_scaled_weights_load_to_the_layers_shape(tmp_path):
    """ComfyUI pads mxfp8 to 32 and nvfp4 to 16 rows and columns: a layer of another shape is
    read from its padded matrix (rows known from the bias, columns from the model)."""
    config = dataclasses.replace(CONFIG, ffn_dim=520, name="padded")
    state = tiny.random_dit_state(config, seed=2)
    formats = {"blocks.0.ffn.0.weight": "mxfp8", "blocks.0.ffn.2.weight": "nvfp4",
               "blocks.1.ffn.0.weight": "nvfp4", "blocks.1.ffn.2.weight": "mxfp8"}
    path = tiny.write_dit(tmp_path / "dit.safetensors", config, state=state, dtype=torch.float32,
                          comfy_quant=formats)
    assert load_file(str(path))[PREFIX + "blocks.0.ffn.0.weight"].shape == (544, 256)
    with pytest.warns(RuntimeWarning):
        model, info = load_dit(path, torch.float32)
    assert info.config.ffn_dim == 520
    values = tiny.comfy_quant_values(state, formats, torch.float32)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], values[k]) for k in formats)


# -- refusals ----------------------------------------------------------------------------------

def _with_layer_config(tmp_path, config: dict, metadata_form: bool = False) -> Path:
    """The tiny DiT with blocks.0.ffn.0 declared as `config`."""
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, dtype=torch.float32,
                          comfy_quant={"blocks.0.ffn.0.weight": "int8_tensorwise"})
    state = load_file(str(path))
    layer = PREFIX + "blocks.0.ffn.0"
    state.pop(layer + ".comfy_quant")
    metadata = None
    if metadata_form:
        metadata = {"_quantization_metadata": json.dumps({"layers": {layer: config}})}
    else:
        state[layer + ".comfy_quant"] = comfy_quant_write.config_bytes(config)
    save_file(state, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("config,words", [
    ({"format": "convrot_w4a4", "convrot_groupsize": 256}, "'convrot_w4a4'"),
    ({"format": "asym_w4a8_int8", "group_size": 16}, "'asym_w4a8_int8'"),
    ({"format": "float4_mystery"}, "'float4_mystery'"),
    ({"format": "float8_e4m3fn", "convrot": True}, "with convrot"),
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 32}, "group size 32"),
    ({"full_precision_matrix_mult": True}, "no format"),
])
@pytest.mark.parametrize("metadata_form", [False, True])
def test_formats_we_do_not_read_are_refused_by_file_layer_and_format(tmp_path, config, words,
                                                                    metadata_form):
    path = _with_layer_config(tmp_path, config, metadata_form)
    with pytest.raises(CheckpointError) as refused:
        load_dit(path, torch.float32)
    message = str(refused.value)
    assert str(path) in message and "blocks.0.ffn.0" in message and words in message
    if "group size" not in words:  # the formats read
        assert "float8_e4m3fn, float8_e5m2, int8_tensorwise, mxfp8, nvfp4" in message
    assert ("_quantization_metadata" if metadata_form else "blocks.0.ffn.0.comfy_quant") \
        in message


def test_a_layer_without_its_scales_is_refused_by_name(tmp_path):
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, dtype=torch.float32,
                          comfy_quant={"blocks.1.ffn.2.weight": "nvfp4"})
    state = load_file(str(path))
    del state[PREFIX + "blocks.1.ffn.2.weight_scale_2"]
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.ffn\.2' \(nvfp4\) has no "
                                              r"weight_scale_2"):
        load_dit(path, torch.float32)


def test_a_comfy_quant_key_is_never_dropped(tmp_path):
    """A config whose layer has no weight is refused, not skipped; a config on a layer that
    holds one always changes how its weight is read."""
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, dtype=torch.float32)
    state = load_file(str(path))
    state[PREFIX + "blocks.0.ffn.1.comfy_quant"] = comfy_quant_write.config_bytes(
        "float8_e4m3fn")
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.1'.*no weight"):
        load_dit(path, torch.float32)

    # an int8 weight with a per-tensor scale: read as codes times the scale, never as numbers
    source = tiny.write_dit(tmp_path / "q.safetensors", CONFIG, dtype=torch.float32,
                            comfy_quant={"blocks.0.ffn.0.weight": "int8_tensorwise"})
    model, _ = load_dit(source, torch.float32)
    file = load_file(str(source))
    codes = file[PREFIX + "blocks.0.ffn.0.weight"]
    assert torch.equal(model.blocks[0].ffn[0].weight,
                       codes.float() * file[PREFIX + "blocks.0.ffn.0.weight_scale"])


# -- LoRAs -------------------------------------------------------------------------------------

def test_loras_merge_into_dequantized_layers_on_load_and_the_merge_command_refuses_them(
        tmp_path, plain):
    state, plain_path = plain
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, state=state, dtype=torch.float32,
                          comfy_quant=FORMATS)
    lora = write_lora(tmp_path / "lora.safetensors", random_lora(CONFIG, seed=1), "generic")

    def merged(model):
        opened = open_lora(lora, dit_shapes(CONFIG))
        try:
            return load_dit(model, torch.float32, merge=Merge.of([(opened, 0.5)]))[0]
        finally:
            opened.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = merged(path).state_dict(), merged(plain_path).state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.0\.weight, stored as int8"
                                              r"|stored as (mxfp8|nvfp4)"):
        merge_file(path, [(lora, 0.5)], tmp_path / "merged.safetensors")
    assert not (tmp_path / "merged.safetensors").exists()


def test_dequantized_layers_no_lora_touches_are_quantized_on_the_cpu(tmp_path, plain,
                                                                   monkeypatch):
    """With a merge device, only the layers a LoRA changes go there; a dequantized layer the
    merge leaves alone is quantized on the CPU, so its codes are those a load without LoRA
    gives whatever the device."""
    from wan_enhanced.checkpoints import loader

    state, _ = plain
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, state=state, dtype=torch.float32,
                          comfy_quant=FORMATS)
    # the LoRA changes one dequantized block matrix (mxfp8) and leaves the others
    lora = write_lora(tmp_path / "lora.safetensors",
                      random_lora(CONFIG, seed=1, modules=["blocks.0.ffn.2"]), "generic")
    devices = {}
    real = loader.read_float

    def read_float(plan, ours, file_key, merge=None, device=None):
        devices[ours] = device
        return real(plan, ours, file_key, merge, None)  # (the CPU stands in for the device)

    monkeypatch.setattr(loader, "read_float", read_float)
    opened = open_lora(lora, dit_shapes(CONFIG))
    try:
        merge = Merge.of([(opened, 0.5)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_dit(path, torch.float32, quantization="fp8_e4m3fn", merge=merge,
                     device=torch.device("meta"))
        touched = {ours for ours in devices if merge.touches(ours)}
        untouched = {ours for ours in devices if ours in FORMATS and ours not in touched
                     and ours.startswith("blocks.")}
    finally:
        opened.close()
    assert touched == {"blocks.0.ffn.2.weight"} and "blocks.1.ffn.0.weight" in untouched
    assert all(devices[ours] == torch.device("meta") for ours in touched)
    assert all(devices[ours] is None for ours in untouched)


def test_a_quantized_clip_vision_file_is_refused_not_read_without_its_scales(tmp_path):
    path = tmp_path / "clip_vision.safetensors"
    save_file({"vision_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(8, 4, dtype=torch.int8),
               "vision_model.encoder.layers.0.mlp.fc1.weight_scale": torch.ones(()),
               "vision_model.encoder.layers.0.mlp.fc1.comfy_quant": comfy_quant_write.config_bytes(
                   "int8_tensorwise")}, str(path))
    with pytest.raises(CheckpointError, match="quantized CLIP vision file"):
        load_clip_vision(path)


def test_nvfp4_pre_quant_scale_is_folded_into_the_weights_columns(tmp_path):
    """ComfyUI multiplies the input by `pre_quant_scale` before an nvfp4 layer's matmul: the
    same as the weight's columns times it."""
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, dtype=torch.float32,
                          comfy_quant={"blocks.0.ffn.2.weight": "nvfp4"})
    state = load_file(str(path))
    layer = PREFIX + "blocks.0.ffn.2"
    smoothing = torch.linspace(0.5, 2.0, CONFIG.ffn_dim)
    state[layer + ".pre_quant_scale"] = smoothing
    save_file(state, str(path))
    plain = tiny.comfy_quant_values(tiny.random_dit_state(CONFIG, seed=0),
                                    {"blocks.0.ffn.2.weight": "nvfp4"}, torch.float32)
    with pytest.warns(RuntimeWarning):
        model, _ = load_dit(path, torch.float32)
    assert torch.equal(model.blocks[0].ffn[2].weight,
                       plain["blocks.0.ffn.2.weight"] * smoothing[None, :])


def test_an_int8_convrot_scale_of_another_size_is_refused_by_name(tmp_path):
    """A rotated layer's scale is one per tensor or one per row; any other count is refused
    naming the scale, not broadcast over the codes."""
    path = tiny.write_dit(tmp_path / "dit.safetensors", CONFIG, dtype=torch.float32,
                          comfy_quant={"blocks.1.ffn.2.weight": FORMATS["blocks.1.ffn.2.weight"]})
    state = load_file(str(path))
    state[PREFIX + "blocks.1.ffn.2.weight_scale"] = torch.ones(1, CONFIG.ffn_dim)
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.ffn\.2\.weight_scale \(the scale of "
                                              r".*blocks\.1\.ffn\.2\.weight\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_dit(path, torch.float32)
