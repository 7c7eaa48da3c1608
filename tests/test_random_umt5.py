"""bench/random_umt5.py: a seeded random umT5 in the layout of ComfyUI's
umt5_xxl_fp8_e4m3fn_scaled file, which our loader reads as such (fp8 matrices kept as stored)."""

import os

import pytest
import torch
from safetensors import safe_open

from wan_enhanced.bench.random_umt5 import t5_config, write_random_umt5
from wan_enhanced.checkpoints.loader import load_text_encoder
from wan_enhanced.checkpoints.tiny import random_tensors
from wan_enhanced.wan.t5 import UMT5Encoder, is_block_matrix, wan_key_to_hf
from wan_enhanced.wan.tokenizer import UMT5Tokenizer


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_random_umt5(tmp_path_factory.mktemp("umt5") / "umt5.safetensors", "tiny", 3)


def draws():
    with torch.device("meta"):
        model = UMT5Encoder.from_config(t5_config("tiny"))
    return dict(random_tensors(model, 3))


def test_layout_and_values_are_those_of_the_seeded_draw(written):
    expected = draws()
    with safe_open(str(written), "pt") as file:
        keys = set(file.keys())
        assert {"scaled_fp8", "spiece_model", "shared.weight"} <= keys
        assert file.get_tensor("scaled_fp8").shape == (0,)
        for name, value in expected.items():
            key = wan_key_to_hf(name)
            stored = file.get_tensor(key)
            if is_block_matrix(name):
                scale = file.get_tensor(key.removesuffix("weight") + "scale_weight")
                assert stored.dtype == torch.float8_e4m3fn and scale.shape == ()
                assert torch.equal(scale, value.abs().amax() / 448)
                assert torch.equal(stored.view(torch.uint8),
                                   (value / scale).to(torch.float8_e4m3fn).view(torch.uint8))
            else:
                assert stored.dtype == torch.bfloat16
                assert torch.equal(stored, value.to(torch.bfloat16))


def test_our_loader_reads_it_as_comfyui_fp8_with_its_tokenizer(written):
    model, spiece, info = load_text_encoder(written, torch.float32)
    assert model.blocks[0].attn.q.weight.dtype == torch.float8_e4m3fn
    assert "kept as stored" in info.quantization_detail
    ids, _ = UMT5Tokenizer.from_spiece_bytes(spiece, length=16)(["a red fox in the snow"])
    assert int(ids.max()) < t5_config("tiny").vocab_size and int(ids[0, 0]) > 1


def test_an_existing_file_of_the_same_seed_is_kept_and_another_seed_rewrites_it(written):
    before = os.stat(written).st_mtime_ns
    write_random_umt5(written, "tiny", 3)
    assert os.stat(written).st_mtime_ns == before
    write_random_umt5(written, "tiny", 4)
    with safe_open(str(written), "pt") as file:
        assert file.metadata()["wan_enhanced_random_umt5"].startswith("umt5 tiny seed 4")
    write_random_umt5(written, "tiny", 3)  # back, for the other tests of this module


def test_unknown_size_is_refused():
    with pytest.raises(ValueError, match="umT5 size 'xl'"):
        t5_config("xl")
