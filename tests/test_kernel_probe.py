"""bench/kernel_probe.py assembles with the ptxas Triton compiles with, and names it when it fails.

torch's inductor points Triton at the CUDA toolkit's ptxas that ships with torch
(TRITON_PTXAS_PATH) once it has compiled anything in the process; Triton then writes PTX of that
ptxas's version, which the older ptxas bundled with Triton refuses (exit 255)."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest


def _fake_ptxas(tmp_path, message: str):
    """A ptxas that states its version (Triton asks before it takes a tool) and refuses any
    PTX with `message`."""
    tool = tmp_path / "ptxas"
    tool.write_text("#!/bin/sh\n"
                    'if [ "$1" = --version ]; then\n'
                    "  echo 'Cuda compilation tools, release 13.0, V13.0.88'; exit 0\nfi\n"
                    f"echo '{message}' >&2\nexit 255\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


def test_the_probe_uses_the_ptxas_triton_is_pointed_at(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia.compiler")
    from wan_enhanced.bench import kernel_probe

    tool = _fake_ptxas(tmp_path, "ptxas fatal : Unsupported .version 9.0")
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(tool))
    assert os.path.samefile(kernel_probe.triton_ptxas(), tool)

    kernel = SimpleNamespace(asm={"ptx": ".version 9.0\n.target sm_90a\n"})
    with pytest.raises(RuntimeError) as error:
        kernel_probe.serialized(kernel)
    message = str(error.value)
    assert str(tool) in message and "exit 255" in message
    assert "Unsupported .version 9.0" in message
