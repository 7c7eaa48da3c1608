"""Our kernels become PyTorch operators only when something compiles: an eager run never
registers them (registering imports torch's fake-tensor and compiler machinery), a compiled
region gets the operator, whole, with the same result."""

import sys
import uuid

import torch

from wan_enhanced import gpu_support


def _operator_exists(name: str) -> bool:
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op, None) is not None


def test_eager_calls_run_the_launcher_and_register_nothing():
    name = f"wan_enhanced_test::twice_{uuid.uuid4().hex[:8]}"
    calls = []

    def launch(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    op = gpu_support.kernel_operator(name, launch, lambda x: torch.empty_like(x))
    x = torch.arange(4.0)
    assert torch.equal(op(x), x * 2) and calls == [1]
    assert not _operator_exists(name)


def test_a_compiled_region_gets_the_registered_operator_with_the_same_result():
    name = f"wan_enhanced_test::plus_one_{uuid.uuid4().hex[:8]}"
    def plus_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    op = gpu_support.kernel_operator(name, plus_one, lambda x: torch.empty_like(x))
    gpu_support.register_kernel_operators()  # as wan/compiled_blocks does before compiling
    assert _operator_exists(name)
    compiled = torch.compile(lambda x: op(x) * 3, backend="aot_eager", fullgraph=True)
    x = torch.arange(5.0)
    assert torch.equal(compiled(x), (x + 1) * 3)


def test_importing_the_kernel_modules_registers_no_operator():
    import wan_enhanced.quant.fp8_rows  # noqa: F401
    import wan_enhanced.wan.glue  # noqa: F401

    assert "wan_enhanced_glue::norm_codes" in gpu_support._OPERATORS
    registered = [n for n in gpu_support._OPERATORS
                  if n.startswith("wan_enhanced_") and not n.startswith("wan_enhanced_test")
                  and _operator_exists(n)]
    # (another test of this process may have compiled the blocks: then all are registered)
    assert registered == [] or "torch._dynamo" in sys.modules
