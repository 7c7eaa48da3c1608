"""LoRA files written by LightX2V's own extractor (tools/extract/lora_extractor.py, the tool
behind the lightx2v step-distill LoRAs) are read with every key placed: the exact key set its
extractor writes for a two-block Wan2.1 T2V 1.3B at the real widths
(tests/data/lora/lightx2v_keys.json, made by conformance/make_lightx2v_manifest.py)."""

import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from wan_enhanced.lora.file import open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.patches import Difference, LowRank
from wan_enhanced.wan.configs import KNOWN_DITS

MANIFEST = json.loads((Path(__file__).parent / "data" / "lora" / "lightx2v_keys.json")
                      .read_text())
KEYS = MANIFEST["keys"]
CONFIG = replace(KNOWN_DITS["wan2.1-t2v-1.3b"].config, num_layers=2)
SHAPES = dit_shapes(CONFIG)
PREFIX = "diffusion_model."
RANK = 64

# file key suffix -> (the role it plays, the parameter suffix it patches)
SUFFIXES = {".lora_up.weight": ("up", ".weight"), ".lora_down.weight": ("down", ".weight"),
            ".diff_m": ("diff", ".modulation"), ".diff_b": ("diff", ".bias"),
            ".diff": ("diff", ".weight")}


def target(key: str) -> tuple[str, str]:
    """(our parameter a manifest key patches, its role), from the key's spelling alone."""
    assert key.startswith(PREFIX), key
    for suffix, (role, param) in SUFFIXES.items():
        if key.endswith(suffix):
            module = key[len(PREFIX):-len(suffix)]
            # `blocks.N.diff_m` / `head.diff_m`: the modulation parameter of that module
            return f"{module}{param}", role
    raise AssertionError(f"unexpected key {key}")


def by_suffix() -> dict[str, int]:
    counts = dict.fromkeys(SUFFIXES, 0)
    for key in KEYS:
        counts[next(s for s in SUFFIXES if key.endswith(s))] += 1
    return counts


def expected_patches() -> dict[str, dict[str, str]]:
    """{our parameter: {role: file key}} the manifest describes."""
    out: dict[str, dict[str, str]] = {}
    for key in KEYS:
        param, role = target(key)
        assert role not in out.setdefault(param, {}), key
        out[param][role] = key
    return out


def test_the_manifest_is_lightx2vs_key_set():
    assert "extract_lora_from_diff(rank=64)" in MANIFEST["source"]
    assert MANIFEST["config"] == "wan2.1-t2v-1.3b, num_layers=2"
    assert not any("alpha" in key for key in KEYS)
    assert all(dtype == "bfloat16" for _, dtype in KEYS.values())
    # 2 blocks: 12 pairs each (q k v o of both attentions, ffn.0, ffn.2), and the embeddings'
    # text_embedding.0/.2, time_embedding.2, time_projection.1: 2-D with >= 1e6 elements
    assert by_suffix() == {".lora_up.weight": 24, ".lora_down.weight": 24, ".diff_m": 3,
                           ".diff_b": 29, ".diff": 13}
    assert len(KEYS) == 93
    # the extractor's rule, from our shapes: every parameter differs, so every one is in the
    # file, as a rank-64 pair when 2-D with at least 1e6 elements, else as its difference
    patches = expected_patches()
    assert patches.keys() == SHAPES.keys()
    for param, roles in patches.items():
        shape = SHAPES[param]
        if len(shape) == 2 and math.prod(shape) >= 1_000_000:
            assert roles.keys() == {"up", "down"}, param
            assert KEYS[roles["up"]][0] == [shape[0], RANK]
            assert KEYS[roles["down"]][0] == [RANK, shape[1]]
        else:
            assert roles.keys() == {"diff"}, param
            assert KEYS[roles["diff"]][0] == list(shape), param
    assert {p for p, r in patches.items() if r.get("diff", "").endswith(".diff_m")} == {
        "blocks.0.modulation", "blocks.1.modulation", "head.modulation"}


def test_every_key_of_a_lightx2v_file_is_placed(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {key: (torch.randn(shape, generator=gen) * 1e-2).to(torch.bfloat16)
             for key, (shape, _) in KEYS.items()}
    path = tmp_path / "lightx2v.safetensors"
    save_file(state, str(path))
    expected = expected_patches()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora = open_lora(path, SHAPES)
    with lora:
        # pairs count once: one patch per parameter, and the manifest names all 69
        assert len(lora.patches) == len(expected) == len(SHAPES) == 69
        assert lora.patches.keys() == expected.keys()
        assert lora.unmatched == []
        for param, roles in expected.items():
            patch = lora.patches[param]
            if "up" in roles:
                assert isinstance(patch, LowRank), param
                assert (patch.up, patch.down) == (roles["up"], roles["down"])
                assert patch.rank == RANK and patch.scale == 1.0  # no alpha: scale 1
            else:
                assert isinstance(patch, Difference), param
                assert patch.key == roles["diff"] and patch.scale == 1.0
        for param in ("blocks.0.modulation", "blocks.1.modulation", "head.modulation"):
            key = lora.patches[param].key
            assert key.endswith(".diff_m")
            assert torch.equal(lora.tensor(key), state[key])
            assert tuple(lora.tensor(key).shape) == SHAPES[param]
        # each .diff on the named module's weight, each .diff_b on its bias, each .diff_m on
        # the block's or the head's modulation: by the file key, not through target()
        for key in KEYS:
            for suffix, leaf in ((".diff_m", "modulation"), (".diff_b", "bias"),
                                 (".diff", "weight")):
                if key.endswith(suffix):
                    param = f"{key[len(PREFIX):-len(suffix)]}.{leaf}"
                    assert lora.patches[param] == Difference(key), key
                    break
        kinds = {type(p) for p in lora.patches.values()}
        assert kinds == {LowRank, Difference}
        assert sum(isinstance(p, LowRank) for p in lora.patches.values()) == 24
        assert sum(isinstance(p, Difference) for p in lora.patches.values()) == 45
        summary = lora.summary()
        assert "24 low-rank pairs (rank 64)" in summary and "45 full differences" in summary
