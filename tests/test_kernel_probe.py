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
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", str(tool))  # Triton 3.9 builds sm_90 so
    assert os.path.samefile(kernel_probe.triton_ptxas(), tool)

    kernel = SimpleNamespace(asm={"ptx": ".version 9.0\n.target sm_90a\n"})
    with pytest.raises(RuntimeError) as error:
        kernel_probe.serialized(kernel)
    message = str(error.value)
    assert str(tool) in message and "exit 255" in message
    assert "Unsupported .version 9.0" in message


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   IADD3 R2, R1, 0x1, RZ ;                /* 0x0000000101027810 */
        /*0020*/                   MUFU.EX2 R3, R2 ;                      /* 0x0000000200037308 */
        /*0030*/              @!P0 MUFU.EX2 R4, R2 ;                      /* 0x0000000200048308 */
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R5 ;
        /*0050*/              @!P1 BRA 0x0090 ;                           /* 0x0000000000009947 */
        /*0060*/                   FFMA R5, R3, R4, R5 ;                  /* 0x0000000403057223 */
        /*0070*/               @P2 BRA 0x0010 ;                           /* 0xfffffffc00002947 */
        /*0080*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R5 ;
        /*00a0*/                   BRA 0x0040 ;                           /* 0xffffffe400007947 */
"""


def test_the_probe_counts_each_loops_instructions():
    """The loop closed by the predicated backward branch, its opcodes without predicates or
    modifiers; the retry stub's unpredicated jump back is no loop."""
    from wan_enhanced.bench.kernel_probe import sass_loops

    (loop,) = sass_loops(SASS, shortest=3)
    assert (loop["start"], loop["end"], loop["instructions"]) == (0x10, 0x70, 7)
    assert loop["opcodes"] == {"MUFU": 2, "BRA": 2, "IADD3": 1, "SYNCS": 1, "FFMA": 1}
    # where the exponentials and the waits fall in the loop (positions from its start)
    assert loop["exponentials"] == (1, 2)
    assert loop["syncs"] == [(3, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R5")]
    assert sass_loops(SASS, shortest=8) == []
