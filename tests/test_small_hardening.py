"""Smaller hardening: the demo refuses an output folder it cannot write (no traceback), a
malicious .pth is refused in plain words (no terminal colour codes, no advice to load it
unsafely), and model files written by the tiny-model writer get normal permissions."""

from __future__ import annotations

import os

import pytest
import torch

from wan_enhanced.checkpoints import tiny
from wan_enhanced.checkpoints.reader import CheckpointError, open_checkpoint
from wan_enhanced.runner import cli


def test_demo_refuses_an_unwritable_output_folder(unwritable_folder, capsys):
    assert cli.main(["demo", "--out", str(unwritable_folder), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {unwritable_folder}: ")
    assert "Traceback" not in err and ("not writable" in err or "is a file" in err)
    assert not unwritable_folder.exists() or list(unwritable_folder.iterdir()) == []


class Payload:
    """Stands for any class a pickle names: loading it would run its module's code."""


def test_malicious_pth_is_refused_in_plain_words(tmp_path, monkeypatch):
    monkeypatch.setattr(Payload, "__module__", "payload_module")
    import sys
    import types
    module = types.ModuleType("payload_module")
    module.Payload = Payload
    monkeypatch.setitem(sys.modules, "payload_module", module)
    path = tmp_path / "model.pth"
    torch.save({"weight": torch.zeros(2), "extra": Payload()}, path)
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(path)
    message = str(caught.value)
    assert "\x1b" not in message  # torch bolds part of its text for terminals
    assert "weights_only" not in message and "trust" not in message
    assert message.endswith("only plain state dicts of tensors are accepted "
                            "(it refers to payload_module.Payload)")

    class Call:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"weight": torch.zeros(2), "run": Call()}, path)
    with pytest.raises(CheckpointError, match=r"\(it refers to posix.system\)$"):
        open_checkpoint(path)


def test_model_files_get_normal_permissions(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    tiny.write_models_folder(tmp_path, dit_name="d.safetensors", vae_name="v.pth",
                             text_encoder_name="t.safetensors", kind="t2v")
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.rglob("*") if p.is_file()}
    assert modes == dict.fromkeys(["d.safetensors", "v.pth", "t.safetensors"], 0o666 & ~umask)
