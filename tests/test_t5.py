"""The umT5 encoder against the reference outputs, its key layouts at real size, and its
behaviour with padding and in reduced precision."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from wan_enhanced.conformance import run_t5
from wan_enhanced.conformance.golden_file import read_golden
from wan_enhanced.wan.t5 import (UMT5Encoder, hf_key_to_wan, relative_position_buckets,
                                 state_dict_from_hf, wan_key_to_hf)

TESTS = Path(__file__).parent
MANIFESTS = json.loads((TESTS / "data" / "key_manifests.json").read_text())


@pytest.fixture(scope="module")
def golden():
    return read_golden(TESTS / "golden" / "t5_umt5.safetensors")


@pytest.fixture(scope="module")
def model(golden):
    return run_t5.build(golden)


def _rel(actual, expected):
    return float((actual - expected).abs().max() / expected.abs().max())


def test_golden(golden):
    scores = run_t5.run(golden)
    for s in scores:
        print(s.line())
    assert len(scores) == len(golden.cases()) and all(s.passed for s in scores)
    # a faithful float32 implementation lands near 4e-7, far inside the 1e-5 tolerance
    assert max(s.max_rel for s in scores) < 2e-6


def test_golden_padding_rows(golden, model):
    """Padding rows are informational in the reference, but well defined: they agree too."""
    with torch.no_grad():
        for case in golden.cases():
            hidden = model(case.inputs["ids"], case.inputs["mask"])
            assert _rel(hidden, case.expected["hidden"]) < 2e-6


def test_golden_key_map_matches_ours(golden):
    for hf, wan in golden.meta["hf_to_wan_key_map"].items():
        assert hf_key_to_wan(hf) == wan
        if hf != "encoder.embed_tokens.weight":
            assert wan_key_to_hf(wan) == hf


def _real_size_shapes() -> dict[str, list[int]]:
    with torch.device("meta"):
        encoder = UMT5Encoder()
    return {k: list(v.shape) for k, v in encoder.state_dict().items()}


def test_real_size_official_layout():
    ours = _real_size_shapes()
    official = {k: shape for k, (shape, _dtype) in MANIFESTS["official/umt5_xxl_encoder"].items()}
    assert ours == official


def test_real_size_hf_layout_through_key_map():
    ours = _real_size_shapes()
    hf = {k: shape for k, (shape, _dtype) in MANIFESTS["hf/umt5_xxl_encoder"].items()}
    mapped = {}
    for key, shape in hf.items():
        wan = hf_key_to_wan(key)
        assert wan is not None, key
        assert ours[wan] == shape, key
        mapped.setdefault(wan, []).append(key)
    assert set(mapped) == set(ours)
    # only the tied embedding has two HF names
    assert sorted(mapped["token_embedding.weight"]) == ["encoder.embed_tokens.weight",
                                                        "shared.weight"]
    assert all(len(v) == 1 for k, v in mapped.items() if k != "token_embedding.weight")
    for key in ours:
        assert wan_key_to_hf(key) in hf and hf_key_to_wan(wan_key_to_hf(key)) == key


def test_key_map_rejects_foreign_keys():
    for key in ("spiece_model", "scaled_fp8", "decoder.block.0.layer.0.SelfAttention.q.weight",
                "encoder.block.0.layer.2.layer_norm.weight", "lm_head.weight"):
        assert hf_key_to_wan(key) is None
    for key in ("pos_embedding.embedding.weight", "blocks.0.ffn.gate.1.weight", "head.weight"):
        assert wan_key_to_hf(key) is None


def test_state_dict_from_hf_checks_the_tied_embedding(golden):
    hf = dict(golden.weights)
    hf["encoder.embed_tokens.weight"] = hf["shared.weight"].clone()
    assert torch.equal(state_dict_from_hf(hf)["token_embedding.weight"], hf["shared.weight"])
    hf["encoder.embed_tokens.weight"] += 1
    with pytest.raises(ValueError, match="differ"):
        state_dict_from_hf(hf)
    with pytest.raises(ValueError, match="not umT5 encoder keys"):
        state_dict_from_hf({**golden.weights, "decoder.final_layer_norm.weight": torch.ones(64)})


def test_bucket_table():
    """Float32 bucketing equals the closed form: 8 exact distances, then 8 log-spaced buckets
    up to distance 128 per direction, keys after the query offset by 16."""
    length = 400
    buckets = relative_position_buckets(length, 32, 128)
    assert buckets.shape == (length, length) and buckets.dtype == torch.int64

    def expected(offset):
        side = 16 if offset > 0 else 0
        d = abs(offset)
        if d < 8:
            return side + d
        return side + min(15, 8 + int(math.log(d / 8) / math.log(16) * 8))

    row = buckets[200].tolist()  # query 200 sees offsets -200..199
    assert row == [expected(k - 200) for k in range(length)]
    assert buckets[0, 1] == 17 and buckets[1, 0] == 1 and buckets[0, 300] == 31
    # the buckets depend on the offset only
    assert torch.equal(buckets[:100, :100], buckets[50:150, 50:150])


def test_valid_rows_do_not_depend_on_padding(model):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (1, 20), generator=gen)
    ids[0, -1] = 1
    with torch.no_grad():
        alone = model(ids, torch.ones_like(ids))
        for extra in (5, 300):  # 300 reaches past the largest bucket distance
            padded = torch.cat([ids, torch.zeros(1, extra, dtype=torch.long)], dim=1)
            mask = (padded != 0).long()
            mask[0, :20] = 1
            out = model(padded, mask)
            assert _rel(out[:, :20], alone) < 1e-6


def test_batch_rows_are_independent(model):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 256, (2, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    ids[1, 12:] = 0
    with torch.no_grad():
        both = model(ids, mask)
        second = model(ids[1:, :12], mask[1:, :12])
    assert _rel(both[1:, :12], second) < 1e-6


def test_no_mask_equals_all_ones(model):
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids, torch.ones_like(ids)))


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_reduced_precision_tracks_float32(golden, model, dtype, bound):
    low = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        for case in golden.cases():
            ids, mask = case.inputs["ids"], case.inputs["mask"]
            out = low(ids, mask)
            assert out.dtype == torch.float32
            keep = mask.bool()
            assert _rel(out[keep], model(ids, mask)[keep]) < bound


def test_float16_survives_activations_beyond_its_range(golden, model):
    """A first block whose FFN pushes the residual stream past 65504: float16 weights still give
    a finite result close to float32, because the residual stays float32 and the FFN's output
    projection runs in float32."""
    big = copy.deepcopy(model)
    with torch.no_grad():
        big.blocks[0].ffn.fc2.weight.mul_(3e4)
    case = golden.cases()[1]
    ids, mask = case.inputs["ids"], case.inputs["mask"]
    seen = {}

    def record(module, args, out):
        seen["residual"] = float(out.abs().max())

    hook = big.blocks[0].register_forward_hook(record)
    with torch.no_grad():
        reference = big(ids, mask)
    hook.remove()
    assert seen["residual"] > torch.finfo(torch.float16).max
    with torch.no_grad():
        half = copy.deepcopy(big).half()(ids, mask)
    assert torch.isfinite(half).all()
    assert _rel(half, reference) < 5e-3


def test_float64_weights_keep_float64():
    torch.manual_seed(0)
    encoder = UMT5Encoder(vocab_size=50, dim=32, dim_attn=32, dim_ffn=48, num_heads=4,
                          num_layers=2).double()
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        out64 = encoder(ids)
        out32 = encoder.float()(ids)
    assert out64.dtype == torch.float64 and out32.dtype == torch.float32
    assert _rel(out32.double(), out64) < 1e-5


def test_head_split_must_divide():
    with pytest.raises(ValueError, match="divisible"):
        UMT5Encoder(vocab_size=10, dim=30, dim_attn=30, dim_ffn=8, num_heads=4, num_layers=1)
