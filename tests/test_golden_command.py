"""`wan-enhanced golden`: passes on the reference files, fails on a file whose outputs are off."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wan_enhanced.runner.cli import main


def test_all_reference_files_pass(golden_dir, capsys):
    files = sorted(str(p) for p in golden_dir.glob("*.safetensors"))
    assert len(files) == 6
    assert main(["golden", *files]) == 0
    out = capsys.readouterr().out
    assert "6/6 files passed" in out
    assert "max_abs" in out and "max_rel" in out and "FAIL" not in out


def _tampered_copy(src, dst, key, scale):
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = tensors[key] * scale
    save_file(tensors, str(dst), metadata=meta)


def test_exceeded_tolerance_exits_nonzero(golden_dir, tmp_path, capsys):
    bad = tmp_path / "dit_wan21.safetensors"
    # an expected output 0.1% off: far above the 1e-5 tolerance
    _tampered_copy(golden_dir / "dit_wan21.safetensors", bad, "output.y", 1.001)
    assert main(["golden", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL case1" in out and "0/1 files passed" in out


def test_unreadable_and_foreign_files(tmp_path, capsys):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"nothing here")
    plain = tmp_path / "plain.safetensors"
    save_file({"a": torch.zeros(1)}, str(plain))
    wrong_kind = tmp_path / "kind.safetensors"
    save_file({"a": torch.zeros(1)}, str(wrong_kind), metadata={"golden": json.dumps(
        {"format": "wan-golden/1", "kind": "something_else", "config": {}, "cases": []})})
    assert main(["golden", str(junk), str(plain), str(wrong_kind)]) == 1
    out = capsys.readouterr().out
    assert "not a readable safetensors file" in out
    assert "no 'golden' entry" in out
    assert "unknown kind 'something_else'" in out


@pytest.mark.parametrize("name", ["vae21", "t5_umt5", "scheduler_unipc"])
def test_other_kinds_detect_tampering(golden_dir, tmp_path, name):
    key = {"vae21": "output.decoded", "t5_umt5": "output.hidden",
           "scheduler_unipc": "case0.final"}[name]
    bad = tmp_path / f"{name}.safetensors"
    _tampered_copy(golden_dir / f"{name}.safetensors", bad, key, 1.001)
    assert main(["golden", str(bad)]) == 1
