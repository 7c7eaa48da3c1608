"""`wan-enhanced lora merge`: the model rewritten with LoRAs merged, in its own key layout,
dtypes and metadata, tensor by tensor and atomically; bad input leaves no file behind."""

import ast
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.reader import SafetensorsSource, open_checkpoint
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit
from wan_enhanced.checkpoints.writer import SafetensorsWriter
from wan_enhanced.lora.file import open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.merge import Merge
from wan_enhanced.lora.tiny import random_lora, write_lora
from wan_enhanced.runner.cli import main
from wan_enhanced.runner.lora_command import parse_lora

CONFIG = TINY_DIT["t2v"]
SHAPES = dit_shapes(CONFIG)
DIFFS = ("blocks.0.norm3.weight", "blocks.1.modulation", "head.head.bias")


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return [write_lora(root / "a.safetensors", random_lora(CONFIG, seed=1, alpha=2.0,
                                                           diffs=DIFFS), "generic"),
            write_lora(root / "b.safetensors", random_lora(CONFIG, seed=2, rank=2), "diffusers")]


def header(path: Path):
    with safe_open(str(path), "pt") as f:
        return list(f.keys()), f.metadata()


def merged_at_load(model, loras, dtype):
    opened = [(open_lora(path, SHAPES), s) for path, s in loras]
    try:
        return load_dit(model, dtype, merge=Merge.of(opened))[0].state_dict()
    finally:
        for lora, _ in opened:
            lora.close()


@pytest.mark.parametrize("layout, dtype", [("comfy", torch.float32), ("comfy", torch.bfloat16),
                                           ("official", torch.float16),
                                           ("diffusers", torch.bfloat16)])
def test_merged_file_keeps_the_layout_and_equals_merging_at_load(tmp_path, loras, layout,
                                                                 dtype):
    model = write_dit(tmp_path / "model.safetensors", CONFIG, layout, dtype=dtype)
    out = tmp_path / "merged.safetensors"
    chain = [(loras[0], 0.7), (loras[1], -1.2)]
    assert main(["lora", "merge", str(model), f"{loras[0]}:0.7", f"{loras[1]}:-1.2",
                 "--out", str(out)]) == 0
    with open_checkpoint(model) as source, open_checkpoint(out) as written:
        assert written.keys() == source.keys()  # same names, same order
        assert all(written.dtype(k) == source.dtype(k) == dtype for k in source.keys())
        assert all(written.shape(k) == source.shape(k) for k in source.keys())
        metadata = json.loads(written.metadata["lora_merged"])
        assert metadata == [{"file": "a.safetensors", "strength": 0.7},
                            {"file": "b.safetensors", "strength": -1.2}]
    ours, _ = load_dit(out, dtype)
    expected = merged_at_load(model, chain, dtype)
    # (norms and modulation load as float32: the file holds them rounded to its dtype)
    assert all(torch.equal(ours.state_dict()[k].to(dtype), expected[k].to(dtype))
               for k in expected)


def test_fp8_scaled_file_keeps_its_scales_and_markers(tmp_path, loras):
    model = write_dit(tmp_path / "fp8.safetensors", CONFIG, "comfy_fp8", dtype=torch.float32)
    out = tmp_path / "merged_fp8.safetensors"
    assert main(["lora", "merge", str(model), str(loras[0]), "--out", str(out)]) == 0
    keys, _ = header(out)
    assert keys == header(model)[0] and "model.diffusion_model.scaled_fp8" in keys
    ours = load_dit(out, torch.float32)[0].state_dict()
    expected = merged_at_load(model, [(loras[0], 1.0)], torch.float32)
    for key in expected:
        if key.endswith(".weight") and "blocks" in key and ".ffn." in key:
            rows = expected[key].abs().amax()
            assert (ours[key] - expected[key]).abs().max() <= rows / 16  # fp8: 3 mantissa bits
        elif not key.startswith("blocks") or "norm" in key or "modulation" in key:
            assert torch.equal(ours[key], expected[key]), key


def test_fp8_scale_is_raised_where_the_merged_weight_outgrows_it(tmp_path):
    model = write_dit(tmp_path / "fp8.safetensors", CONFIG, "comfy_fp8", dtype=torch.float32)
    strong = write_lora(tmp_path / "strong.safetensors",
                        random_lora(CONFIG, seed=3, modules=["blocks.0.ffn.0"], magnitude=5.0),
                        "kohya")
    out = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", str(model), str(strong), "--out", str(out)]) == 0
    key = "model.diffusion_model.blocks.0.ffn.0"
    with open_checkpoint(model) as before, open_checkpoint(out) as after:
        assert after.read(f"{key}.scale_weight") > before.read(f"{key}.scale_weight")
        assert torch.equal(after.read("model.diffusion_model.blocks.0.ffn.2.scale_weight"),
                           before.read("model.diffusion_model.blocks.0.ffn.2.scale_weight"))
    ours = load_dit(out, torch.float32)[0].state_dict()["blocks.0.ffn.0.weight"]
    expected = merged_at_load(model, [(strong, 1.0)], torch.float32)["blocks.0.ffn.0.weight"]
    assert (ours - expected).abs().max() <= expected.abs().max() / 16  # nothing clipped


def test_tensors_stream_one_at_a_time(tmp_path, loras, monkeypatch):
    model = write_dit(tmp_path / "model.safetensors", CONFIG, "comfy", dtype=torch.bfloat16)
    given: list[weakref.ref] = []
    alive: list[int] = []
    real_write, real_read = SafetensorsWriter.write, SafetensorsSource.read

    def write(self, key, tensor):
        given.append(weakref.ref(tensor))
        return real_write(self, key, tensor)

    def read(self, key):
        if self.path == model:
            alive.append(sum(ref() is not None for ref in given))
        return real_read(self, key)

    monkeypatch.setattr(SafetensorsWriter, "write", write)
    monkeypatch.setattr(SafetensorsSource, "read", read)
    assert main(["lora", "merge", str(model), str(loras[0]), "--out",
                 str(tmp_path / "out.safetensors")]) == 0
    assert len(alive) == len(header(model)[0]) and max(alive) == 0


def test_bad_input_writes_nothing(tmp_path, loras, capsys):
    from dataclasses import replace
    model = write_dit(tmp_path / "model.safetensors", CONFIG, "comfy")
    other = write_lora(tmp_path / "other.safetensors",
                       random_lora(replace(CONFIG, dim=384, num_heads=3)), "kohya")
    out = tmp_path / "out" / "merged.safetensors"
    cases = [
        ([str(model), str(other)], "other.safetensors: 'lora_unet_blocks_0_cross_attn_k"),
        ([str(model), str(tmp_path / "missing.safetensors")], "missing.safetensors: no such"),
        ([str(loras[0]), str(loras[1])], "unknown key layout"),
        ([str(model), f"{loras[0]}:nan"], "the strength nan is not a finite number"),
        ([str(model), f"{loras[0]}:0"], "nothing to merge"),
    ]
    for args, message in cases:
        assert main(["lora", "merge", *args, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert main(["lora", "merge", str(model), str(loras[0]), "--out",
                 str(tmp_path / "merged.pth")]) == 2
    assert "ending in .safetensors" in capsys.readouterr().err
    assert main(["lora", "merge", str(model), str(loras[0]), "--out", str(model)]) == 2
    assert "is the model being read" in capsys.readouterr().err
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failure_half_way_leaves_no_partial_file(tmp_path, loras, monkeypatch, capsys):
    model = write_dit(tmp_path / "model.safetensors", CONFIG, "comfy")
    out = tmp_path / "merged.safetensors"
    out.write_bytes(b"the previous file")
    real, calls = SafetensorsWriter.write, []

    def failing(self, key, tensor):
        calls.append(key)
        if len(calls) == 10:
            raise OSError(28, "No space left on device")
        return real(self, key, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    assert main(["lora", "merge", str(model), str(loras[0]), "--out", str(out)]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == b"the previous file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.safetensors",
                                                          "model.safetensors"]


def test_strengths_are_parsed_after_the_last_colon(capsys):
    assert parse_lora("a.safetensors") == (Path("a.safetensors"), 1.0)
    assert parse_lora("a.safetensors:0.25") == (Path("a.safetensors"), 0.25)
    assert parse_lora("dir:x/a.safetensors:-1") == (Path("dir:x/a.safetensors"), -1.0)
    assert parse_lora("dir:x/a.safetensors") == (Path("dir:x/a.safetensors"), 1.0)


def test_the_command_module_does_not_import_the_cli():
    source = (Path(__file__).parent.parent / "runner" / "lora_command.py").read_text()
    imported = {node.module for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom)}
    assert "cli" not in imported and not any(m and m.endswith(".cli") for m in imported)


def test_a14b_experts_merge_each_with_its_own_distill_lora(tmp_path, capsys):
    """The Wan2.2 distill releases ship a high-noise and a low-noise LoRA: each expert's file is
    merged with its own, at its own strength, by one command each."""
    from wan_enhanced.lora.tiny import lightx2v_lora

    experts = {name: (write_dit(tmp_path / f"{name}.safetensors", CONFIG, "comfy", seed=seed,
                                dtype=torch.float32), strength)
               for name, seed, strength in (("high", 3, 1.0), ("low", 4, 0.7))}
    for name, (model, strength) in experts.items():
        lora = write_lora(tmp_path / f"{name}_noise_lora.safetensors",
                          lightx2v_lora(CONFIG, seed=len(name), rank=8, pair_min=60_000),
                          "lightx2v", dtype=torch.bfloat16)
        out = tmp_path / f"{name}_merged.safetensors"
        assert main(["lora", "merge", str(model), f"{lora}:{strength}", "--out", str(out)]) == 0
        assert "24 low-rank pairs (rank 8)" in capsys.readouterr().out
        written = load_dit(out, torch.float32)[0].state_dict()
        expected = merged_at_load(model, [(lora, strength)], torch.float32)
        assert written.keys() == expected.keys()
        assert all(torch.equal(written[k], expected[k]) for k in written)
        base = load_dit(model, torch.float32)[0].state_dict()
        assert not torch.equal(written["head.modulation"], base["head.modulation"])
