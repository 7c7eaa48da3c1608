"""Unmerged LoRA on fp8 weights for inputs of many rows (lora/fp8_sum.py): the layer's codes
with the low-rank terms added, requantized per call. Held to the merge path's numbers (a LoRA
merged into a pre-quantized fp8 file), to the float sum within fp8 rounding, and the kernel on
a GPU to the PyTorch statement."""

import pytest
import torch
import torch.nn as nn

from cpu_kernels import has_cpu_kernel

from wan_enhanced.lora import fp8_sum as fp8_sum_module
from wan_enhanced.lora.patches import LowRank
from wan_enhanced.lora.fp8_sum import (fp8_sum, fp8_sum_reference, stack_terms)
from wan_enhanced.lora.layers import LoraFp8Linear, merges_per_call
from wan_enhanced.lora.merge import add_patch_
from wan_enhanced.quant import linear as quant_linear
from wan_enhanced.quant.kernels import fp8_codes_matmul
from wan_enhanced.quant.linear import Fp8Linear
from wan_enhanced.quant.rowwise import FP8, dequantize_weight, quantize_rows, quantize_weight

IN, OUT = 96, 64


def fp8_weight(seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(OUT, IN, generator=gen) / IN ** 0.5
    codes, scales = quantize_weight(dense, FP8)
    return codes.to(device), scales.to(device)


def low_rank_terms(seed=1, ranks=(8, 3), scales=(0.7, -1.3), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(r, IN, generator=gen) / IN ** 0.5).to(dtype),
             (torch.randn(OUT, r, generator=gen) / r ** 0.5).to(dtype), s)
            for r, s in zip(ranks, scales)]


class _Lora:
    """The least of lora.file.LoraFile that add_patch_ reads."""

    def __init__(self, tensors):
        self.tensors = tensors

    def tensor(self, key):
        return self.tensors[key]


def test_stacked_terms_are_padded_to_a_power_of_two_with_zeros():
    terms = low_rank_terms(ranks=(8, 3))
    up, down, alpha = stack_terms(terms, torch.float32)
    assert up.shape == (OUT, 16) and down.shape == (16, IN) and alpha == 1.0
    assert not up[:, 11:].any() and not down[11:].any()
    expected = sum(s * u.double() @ d.double() for d, u, s in terms)
    assert torch.allclose((up.double() @ down.double()), expected, atol=1e-6)
    up, down, alpha = stack_terms(low_rank_terms(ranks=(64, 32)), torch.bfloat16)
    assert up.shape == (OUT, 128) and up.dtype == torch.bfloat16 and alpha == 1.0
    # one term of a power-of-two rank in the kernel's dtype: taken as it is, its scale apart
    (down, up, scale), = low_rank_terms(ranks=(32,), scales=(0.6,), dtype=torch.bfloat16)
    stacked = stack_terms([(down, up, scale)], torch.bfloat16)
    assert stacked[0] is up and stacked[1] is down and stacked[2] == 0.6
    assert stack_terms([(down, up, scale)], torch.float32)[2] == 1.0  # another dtype: copied


def test_the_sum_is_what_merging_into_an_fp8_file_gives():
    """The merge path (lora/merge.py add_patch_ on the dequantized float32 weight, then the
    loader's quantization) and the per-call sum give the same codes and scales."""
    codes, scales = fp8_weight()
    terms = low_rank_terms()
    weight = dequantize_weight(codes, scales, torch.float32)
    for i, (down, up, strength) in enumerate(terms):
        lora = _Lora({f"up{i}": up, f"down{i}": down})
        add_patch_(weight, lora, LowRank(up=f"up{i}", down=f"down{i}", rank=down.shape[0], scale=1.0), strength)
    merged_codes, merged_scales = quantize_weight(weight, FP8)
    summed_codes, summed_scales = fp8_sum(codes, scales, terms)
    assert torch.allclose(summed_scales, merged_scales, rtol=1e-6, atol=0)
    differ = summed_codes.float() != merged_codes.float()
    # float32 sums in another order: at most a rare tie rounds the other way
    assert differ.float().mean() < 2e-3
    # and the terms count: the codes moved
    assert (summed_codes.float() != codes.float()).float().mean() > 0.3


def test_the_sum_is_the_float_sum_within_fp8_rounding():
    codes, scales = fp8_weight(seed=4)
    terms = low_rank_terms(seed=5)
    exact = dequantize_weight(codes, scales, torch.float64)
    for down, up, s in terms:
        exact += s * up.double() @ down.double()
    new_codes, new_scales = fp8_sum(codes, scales, terms)
    got = dequantize_weight(new_codes, new_scales, torch.float64)
    row_max = exact.abs().amax(dim=1, keepdim=True)
    assert torch.allclose(new_scales.double(), row_max[:, 0] / 448, rtol=1e-6)
    # e4m3: 3 mantissa bits, so half a step is at most 1/16 of the value (subnormals: of the
    # smallest normal step, 2^-9 * scale)
    error = (got - exact).abs()
    assert (error <= exact.abs() / 16 + row_max / 448 * 2 ** -9 + 1e-12).all()


def test_many_rows_on_fp8_matmuls_multiply_the_summed_codes(monkeypatch):
    """The wrapper, for an input of many rows with only low-rank terms: one fp8 product of the
    input's codes and the summed codes (no output-sized sums), the stored codes untouched."""
    if not has_cpu_kernel("_scaled_mm"):
        pytest.skip("no row-wise torch._scaled_mm on this CPU")
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    base = Fp8Linear.from_linear(nn.Linear(IN, OUT), torch.bfloat16, fast=True)
    stored = base.weight.clone()
    terms = low_rank_terms(dtype=torch.bfloat16)
    layer = LoraFp8Linear(base)
    for down, up, s in terms:
        layer.add("low_rank", (down, up), s)
    rows = 600
    assert merges_per_call(rows, IN, OUT)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = layer(x)
    codes, scales = quantize_rows(x, FP8)
    summed = fp8_sum(base.weight, base.weight_scale, terms)
    direct = fp8_codes_matmul(codes, scales, *summed, bias=base.bias).to(torch.bfloat16)
    assert torch.equal(out, direct)
    assert torch.equal(base.weight.view(torch.uint8), stored.view(torch.uint8))
    exact = (x.double() @ base.dequantized_weight(torch.float64).t() + base.bias.double())
    for down, up, s in terms:
        exact += s * (x.double() @ down.double().t()) @ up.double().t()
    assert float((out.double() - exact).abs().max() / exact.abs().max()) < 0.05
    # strength changes take effect at the next call, without touching any tensor
    layer.adapters[0].scale = 0.0
    layer.adapters[1].scale = 0.0
    assert torch.equal(layer(x), base(x))


def test_a_weight_difference_keeps_the_terms_on_the_output(monkeypatch):
    if not has_cpu_kernel("_scaled_mm"):
        pytest.skip("no row-wise torch._scaled_mm on this CPU")
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    calls = []
    monkeypatch.setattr("wan_enhanced.lora.layers.fp8_sum",
                        lambda *a: calls.append(1) or fp8_sum(*a))
    base = Fp8Linear.from_linear(nn.Linear(IN, OUT), torch.bfloat16, fast=True)
    layer = LoraFp8Linear(base)
    down, up, s = low_rank_terms(dtype=torch.bfloat16)[0]
    layer.add("low_rank", (down, up), s)
    x = torch.randn(600, IN).bfloat16()
    layer(x)
    assert calls == [1]
    layer.add("weight_diff", (torch.randn(OUT, IN).bfloat16() * 0.01,), 1.0)
    layer(x)
    assert calls == [1]
    layer(x[:4])  # few rows: the terms on the output
    assert calls == [1]


@pytest.mark.gpu
def test_the_kernel_equals_the_statement():
    if not fp8_sum_module.fp8_kernel_usable(torch.empty(1, device="cuda"), 64):
        pytest.skip("Triton kernels need an NVIDIA GPU and Triton")
    gen = torch.Generator().manual_seed(0)
    for n, k, ranks in ((3072, 3072, (64,)), (3072, 14336, (64, 32)), (14336, 3072, (64,)),
                          (200, 136, (4,))):
        dense = torch.randn(n, k, generator=gen) / k ** 0.5
        codes, scales = (t.cuda() for t in quantize_weight(dense, FP8))
        terms = [((torch.randn(r, k, generator=gen) / k ** 0.5).cuda().bfloat16(),
                  (torch.randn(n, r, generator=gen) / r ** 0.5).cuda().bfloat16(), 0.8)
                 for r in ranks]
        got_codes, got_scales = fp8_sum(codes, scales, terms)
        want_codes, want_scales = fp8_sum_reference(codes, scales,
                                                    *stack_terms(terms, torch.bfloat16))
        assert torch.allclose(got_scales, want_scales, rtol=1e-5, atol=0)
        differ = (got_codes.float() != want_codes.float()).float().mean()
        assert differ < 1e-3, (n, k, ranks, float(differ))
