"""How our Triton kernels are built does not follow the Triton release's defaults: every launch
states its floating-point fusion (gpu_support.KERNEL_OPTIONS), which Triton 3.9 warns will be
off by default from 3.10 on."""

import ast

import pytest
from test_import_graph import ROOT, _modules


def _launches():
    """Every Triton launch in the package's source, `kernel[grid](...)` (the subscripted name ends
    in "kernel"), as ("file:line", its keyword names, whether it unpacks KERNEL_OPTIONS)."""
    found = []
    for path in _modules().values():
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            if not ast.unparse(node.func.value).endswith("kernel"):
                continue
            names = {k.arg for k in node.keywords if k.arg}
            unpacks = any(k.arg is None and ast.unparse(k.value) == "KERNEL_OPTIONS"
                          for k in node.keywords)
            found.append((f"{rel}:{node.lineno}", names, unpacks))
    return found


def test_every_kernel_launch_states_its_floating_point_fusion():
    launches = _launches()
    # the row kernels, the glue, both attention kernels and their operands, LoRA, int8
    assert len(launches) >= 14, launches
    for where, names, unpacks in launches:
        assert unpacks or "enable_fp_fusion" in names, (
            f"{where}: a Triton launch without **KERNEL_OPTIONS (or its own enable_fp_fusion)")


def test_the_fp8_attention_loop_keeps_its_fused_multiply_adds_whatever_the_default(monkeypatch):
    """Offline (no GPU; where Triton with Gluon is installed): with the release's default turned
    to no fusion (Triton 3.10's), the Hopper kernel's loop over keys is built as with fusion:
    one FFMA per score (its exponent's argument) and per accumulator element (the rescale), no
    products split into FMUL and FADD."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from wan_enhanced.bench import kernel_probe

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    monkeypatch.delenv("TRITON_FORCE_DISABLE_FP_FUSION", raising=False)
    kernel = kernel_probe.compile_hopper_for_sm90()
    assert kernel.metadata.enable_fp_fusion is True
    _, sass = kernel_probe.report(kernel)
    for loop in kernel_probe.sass_loops(sass):
        opcodes = loop["opcodes"]
        assert opcodes.get("FFMA", 0) >= 128 and opcodes.get("FMUL", 0) <= 8, opcodes
