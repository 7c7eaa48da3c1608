"""The unmerged LoRA wrapper's two ways of computing its terms (lora/layers.py): the summed
weight formed for one call (dense weights, many rows) and the terms added to the base's output
(few rows, fp8/int8 kernels), each against the formula y = base(x) + sum s (x A^T) B^T + ...
"""

import pytest
import torch
import torch.nn as nn

from cpu_kernels import has_cpu_kernel

from wan_enhanced.lora.layers import LoraFp8Linear, LoraLinear, merges_per_call
from wan_enhanced.quant import linear as quant_linear
from wan_enhanced.quant.linear import Fp8Linear, Int8Linear

IN, OUT = 48, 32
FEW, MANY = 4, 400  # rows below and above the per-call merge's break-even for 48 -> 32


def relative(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def terms(seed=0, rank=8):
    gen = torch.Generator().manual_seed(seed)
    down = torch.randn(rank, IN, generator=gen) / IN ** 0.5
    up = torch.randn(OUT, rank, generator=gen) / rank ** 0.5
    other_down = torch.randn(3, IN, generator=gen) / IN ** 0.5
    other_up = torch.randn(OUT, 3, generator=gen)
    diff = torch.randn(OUT, IN, generator=gen) * 0.05
    diff_b = torch.randn(OUT, generator=gen)
    return [("low_rank", (down, up), 0.7), ("low_rank", (other_down, other_up), -1.3),
            ("weight_diff", (diff,), 0.4), ("bias_diff", (diff_b,), 2.0)]


def expected(base_out, x, chosen):
    out = base_out.double()
    for kind, tensors, scale in chosen:
        t = [v.double() for v in tensors]
        if kind == "low_rank":
            out = out + scale * (x.double() @ t[0].t()) @ t[1].t()
        elif kind == "weight_diff":
            out = out + scale * x.double() @ t[0].t()
        else:
            out = out + scale * t[0]
    return out


def wrapped(base, chosen):
    layer = (LoraFp8Linear if isinstance(base, Fp8Linear) else LoraLinear)(base)
    for kind, tensors, scale in chosen:
        layer.add(kind, tensors, scale)
    return layer


def base_calls(layer):
    calls = []
    layer.base.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_the_break_even_rule():
    assert not merges_per_call(FEW, IN, OUT) and merges_per_call(MANY, IN, OUT)
    # a 5B block's matrices at 1280x704x121 (27280 tokens) merge per call; the cross
    # attention's keys over 512 text rows do not
    assert merges_per_call(27280, 3072, 3072) and merges_per_call(27280, 14336, 3072)
    assert not merges_per_call(512, 4096, 3072)


@pytest.mark.parametrize("rows", [FEW, MANY])
def test_dense_layer_both_paths_equal_the_formula(rows):
    base = nn.Linear(IN, OUT).requires_grad_(False)
    before = base.weight.detach().clone()
    chosen = terms()
    layer = wrapped(base, chosen)
    calls = base_calls(layer)
    x = torch.randn(2, rows // 2, IN, generator=torch.Generator().manual_seed(5))
    out = layer(x)
    assert relative(out, expected(base(x).detach(), x, chosen)) < 1e-6
    assert len(calls) == (0 if rows == MANY else 1) + 1  # +1: the reference call above
    assert torch.equal(base.weight, before)  # the summed weight is a temporary


@pytest.mark.parametrize("rows", [FEW, MANY])
def test_a_zero_strength_term_is_skipped_in_both_paths(rows):
    base = nn.Linear(IN, OUT).requires_grad_(False)
    chosen = [(kind, tensors, 0.0) for kind, tensors, _ in terms()]
    layer = wrapped(base, chosen)
    x = torch.randn(rows, IN)
    assert torch.equal(layer(x), base(x))


@pytest.mark.parametrize("dynamic", [False, True])
def test_int8_layers(dynamic):
    """Weight-only int8 dequantizes anyway: the terms join the dequantized weight. W8A8 keeps
    its integer kernel: the terms are added to its output."""
    gen = torch.Generator().manual_seed(2)
    dense = nn.Linear(IN, OUT)
    base = Int8Linear.from_linear(dense, torch.float32, dynamic=dynamic)
    chosen = terms(seed=3)
    layer = wrapped(base, chosen)
    calls = base_calls(layer)
    x = torch.randn(MANY, IN, generator=gen)
    out = layer(x)
    assert relative(out, expected(base(x), x, chosen)) < 1e-6
    assert len(calls) == (2 if dynamic else 1)


def test_fp8_kernel_path_reads_the_input_codes(monkeypatch):
    """fp8 matmuls (torch._scaled_mm; its CPU kernel here): the terms' down-projections read the
    fp8 codes of the input (factors quantized per row, a rank of 3 padded to 16), the stored
    codes stay as they are, and the result is the formula to fp8 rounding."""
    if not has_cpu_kernel("_scaled_mm"):
        pytest.skip("no row-wise torch._scaled_mm on this CPU")
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    base = Fp8Linear.from_linear(nn.Linear(IN, OUT), torch.bfloat16, fast=True)
    codes = base.weight.clone()
    chosen = [(k, tuple(t.bfloat16() for t in ts), s) for k, ts, s in terms(seed=4)]
    layer = wrapped(base, chosen)
    x = torch.randn(MANY, IN, generator=torch.Generator().manual_seed(6)).bfloat16()
    reference = expected(base.dequantized_forward(x.float()).double(), x.float(), chosen)
    for out in (layer(x), layer.scaled_forward_without_bias(x) + layer.bias.to(x.dtype)):
        assert out.dtype == torch.bfloat16
        assert relative(out, reference) < 0.05
    assert torch.equal(base.weight.view(torch.uint8), codes.view(torch.uint8))
    # the terms do count: without them the output is farther off
    assert relative(base(x), reference) > 0.2


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "fp8_fast"])
def test_on_the_gpu(weights):
    """bf16 (the summed weight per call) and fp8 matmuls (torch._scaled_mm reading the codes)
    on CUDA, at a block matrix's width and a video's row count: the formula to bf16 or fp8
    rounding."""
    torch.manual_seed(0)
    dense = nn.Linear(1024, 2048).cuda().requires_grad_(False)
    base = (dense.bfloat16() if weights == "bf16"
            else Fp8Linear.from_linear(dense, torch.bfloat16, fast=True))
    gen = torch.Generator("cuda").manual_seed(1)
    down = torch.randn(64, 1024, device="cuda", generator=gen) / 32
    up = torch.randn(2048, 64, device="cuda", generator=gen) / 8
    chosen = [("low_rank", (down.bfloat16(), up.bfloat16()), 0.9)]
    layer = wrapped(base, chosen)
    x = torch.randn(8192, 1024, device="cuda", generator=gen)
    reference = expected(x.double() @ dense.weight.double().t() + dense.bias.double(), x, chosen)
    out = layer(x.bfloat16())
    assert relative(out, reference) < (0.01 if weights == "bf16" else 0.05)
    assert relative(base(x.bfloat16()), reference) > 0.1
