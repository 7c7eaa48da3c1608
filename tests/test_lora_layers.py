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


def test_merged_weights_are_what_the_summed_path_multiplies_by():
    """merged_weights (for a caller that multiplies them itself: the FFN's product with its
    GELU in the epilogue) is the summed weight and bias of the formula where a call would merge,
    and None where it would not: few rows, or no term at full strength."""
    base = nn.Linear(IN, OUT).requires_grad_(False)
    chosen = terms()
    layer = wrapped(base, chosen)
    x = torch.randn(MANY, IN, generator=torch.Generator().manual_seed(6))
    weight, bias = layer.merged_weights(x)
    eye = torch.eye(IN, dtype=torch.float64)
    summed = expected(torch.zeros(IN, OUT, dtype=torch.float64), eye, [
        c for c in chosen if c[0] != "bias_diff"]).t() + base.weight.double()
    assert relative(weight, summed) < 1e-6
    assert relative(bias, base.bias.double() + 2.0 * chosen[3][1][0].double()) < 1e-6
    assert relative(torch.nn.functional.linear(x, weight, bias),
                    expected(base(x), x, chosen)) < 1e-6
    assert layer.merged_weights(x[:FEW]) is None
    idle = wrapped(nn.Linear(IN, OUT), [(k, t, 0.0) for k, t, _ in chosen])
    assert idle.merged_weights(x) is None


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


@pytest.mark.gpu
def test_a_loras_ffn_takes_the_gelu_into_its_product():
    """A LoRA'd bf16 FFN (the summed weight per call) runs its first product with the GELU in
    the epilogue, as a plain one does: closer to float32 than the product, its rounding, then
    the GELU."""
    from wan_enhanced.wan import glue
    from wan_enhanced.wan.dit_ffn import feed_forward

    torch.manual_seed(0)
    ffn = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(approximate="tanh"),
                        nn.Linear(4096, 1024)).cuda().bfloat16().requires_grad_(False)
    gen = torch.Generator("cuda").manual_seed(3)
    down = torch.randn(32, 1024, device="cuda", generator=gen) / 32
    up = torch.randn(4096, 32, device="cuda", generator=gen) / 8
    ffn[0] = wrapped(ffn[0], [("low_rank", (down.bfloat16(), up.bfloat16()), 0.8)])
    h = torch.randn(4096, 1024, device="cuda", generator=gen).bfloat16()
    weight, bias = glue.gelu_product_weights(ffn[0], ffn[1], h)
    first = ffn[0].base
    exact_weight = first.weight.double() + 0.8 * up.bfloat16().double() @ down.bfloat16().double()
    hidden = torch.nn.functional.gelu(h.double() @ exact_weight.t() + first.bias.double(),
                                      approximate="tanh")
    exact = hidden.to(torch.bfloat16).double() @ ffn[2].weight.double().t() + ffn[2].bias.double()
    fused = feed_forward(ffn, h)
    unfused = ffn[2](ffn[1](ffn[0](h)))
    assert torch.equal(fused, ffn[2](glue.linear_gelu(h, weight, bias)))
    assert relative(fused, exact) <= relative(unfused, exact) < 0.01
