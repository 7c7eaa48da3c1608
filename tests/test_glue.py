"""The DiT block's elementwise steps (wan/glue.py): the Triton kernels against the PyTorch
statements on a GPU (opt-in, --gpu), and the dispatch on the CPU."""

import pytest
import torch

from wan_enhanced.wan import glue
from wan_enhanced.wan.rope import RotaryTable


def test_cpu_takes_the_pytorch_statements():
    x = torch.randn(2, 12, 8)
    shift, scale = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    expected = glue.modulate(glue.layer_norm(x, 1e-6), shift, scale).to(torch.bfloat16)
    assert torch.equal(glue.norm_modulate(x, shift, scale, 1e-6, torch.bfloat16), expected)
    y, gate = torch.randn(2, 12, 8), torch.randn(2, 3, 8)
    target = x.clone()
    glue.add_gated_(target, y, gate)
    grouped = x.view(2, 3, 4, 8) + y.view(2, 3, 4, 8) * gate[:, :, None]
    assert torch.allclose(target, grouped.view(2, 12, 8), atol=1e-6)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 5, 40])
def test_norm_modulate_kernel_matches_pytorch(groups):
    _cuda_or_skip()
    x = torch.randn(2, 40, 3072, device="cuda") * 3 + 1
    shift = torch.randn(2, groups, 3072, device="cuda")
    scale = torch.randn(2, groups, 3072, device="cuda") * 0.1
    sliced = x[:, 10:30]  # a row chunk: not contiguous over the batch
    table = (shift[:, 10 * groups // 40:30 * groups // 40] if groups > 1 else shift,
             scale[:, 10 * groups // 40:30 * groups // 40] if groups > 1 else scale)
    got = glue.norm_modulate(sliced, *table, 1e-6, torch.bfloat16)
    ref = glue.modulate(glue.layer_norm(sliced, 1e-6), *table).to(torch.bfloat16)
    assert _rel(got, ref) < 4e-3  # bf16 rounding of either side


@pytest.mark.gpu
def test_affine_norm_and_gated_add_kernels_match_pytorch():
    _cuda_or_skip()
    norm = torch.nn.LayerNorm(5120, eps=1e-6).cuda()
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(1, 33, 5120, device="cuda")
    got = glue.norm_affine(x, norm, 1e-6, torch.float32)
    assert _rel(got, glue.layer_norm(x, 1e-6, norm)) < 1e-6
    y = torch.randn(1, 33, 5120, device="cuda").bfloat16()
    gate = torch.randn(1, 3, 5120, device="cuda")
    a, b = x.clone(), x.clone()
    glue.add_gated_(a, y, gate)
    glue._add_gated_torch(b, y, gate)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-6)
    glue.add_gated_(a, y, None)
    assert torch.allclose(a, b + y.float(), atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("start", [0, 17])
def test_rms_norm_rope_kernel_matches_pytorch(start):
    _cuda_or_skip()
    rope = RotaryTable((3, 6, 8), (22, 21, 21), device="cuda")
    t = torch.randn(2, 40, 3072, device="cuda").bfloat16()
    weight = torch.rand(3072, device="cuda") + 0.5
    got = glue.rms_norm_heads(t, weight, 1e-6, 24, rope, start)
    # the PyTorch statement in float32 (no rounding between norm and rotation)
    normed = (torch.nn.functional.rms_norm(t.float(), (3072,), eps=1e-6) * weight)
    ref = rope.rotate(normed.view(2, 40, 24, 128), start)
    assert _rel(got, ref) < 4e-3
    plain = glue.rms_norm_heads(t, weight, 1e-6, 24)
    assert _rel(plain, normed.view(2, 40, 24, 128)) < 4e-3


def test_gelu_forward_of_a_fp8_layer_equals_gelu_then_forward_on_the_cpu():
    from wan_enhanced.quant.linear import Fp8Linear
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32), torch.float32, fast=True)
    x = torch.randn(5, 64)
    with pytest.warns(RuntimeWarning):  # no fp8 matmul on the CPU: the dequantizing forward
        expected = layer(torch.nn.functional.gelu(x, approximate="tanh"))
    assert torch.equal(layer.gelu_forward(x), expected)
    bias = torch.randn(64)
    expected = layer(torch.nn.functional.gelu(x + bias, approximate="tanh"))
    assert torch.equal(layer.gelu_forward(x, bias), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1536, 3072, 5120, 1000])
def test_activation_codes_of_the_kernel_are_the_statements_to_the_bit(width):
    """Eager fp8 matmuls quantize their input per token in one Triton pass: the same codes and
    scales as quant.rowwise.quantize_rows (a zero row included)."""
    _cuda_or_skip()
    from wan_enhanced.quant.fp8_rows import launch_rows, quantize_activations
    from wan_enhanced.quant.rowwise import FP8, quantize_rows
    x = (torch.randn(257, width, device="cuda") * 3).bfloat16()
    x[5] = 0
    x[7, 3] = 1e4
    codes, scales = launch_rows(x)
    ref_codes, ref_scales = quantize_rows(x, FP8)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(quantize_activations(x)[0].view(torch.uint8), codes.view(torch.uint8))


def test_activation_codes_off_cuda_are_the_statement():
    from wan_enhanced.quant.fp8_rows import quantize_activations
    from wan_enhanced.quant.rowwise import FP8, quantize_rows
    x = torch.randn(9, 64).bfloat16()
    codes, scales = quantize_activations(x)
    ref_codes, ref_scales = quantize_rows(x, FP8)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.gpu
def test_gelu_fp8_rows_kernel_matches_its_statement():
    _cuda_or_skip()
    from wan_enhanced.quant import fp8_rows, gelu_fp8
    x = (torch.randn(300, 14336, device="cuda") * 2).bfloat16()
    bias = torch.randn(14336, device="cuda").bfloat16()
    codes, scales = fp8_rows.launch_rows(x, bias, gelu=True)
    ref_codes, ref_scales = gelu_fp8.gelu_quantize_reference(x, bias)
    assert torch.allclose(scales, ref_scales, rtol=1e-5)
    got, ref = codes.float() * scales, ref_codes.float() * ref_scales
    # codes equal but where float32 rounding of the GELU moves a value across a rounding edge
    assert float((got != ref).float().mean()) < 1e-3
    assert _rel(got, ref) < 1e-3


def test_a_row_is_held_as_few_power_of_two_parts():
    """The rows kernel's parts cover the row with little to spare (a width of 8960, 1.3B's FFN,
    padded to one power of two took 16384 lanes) in at most four widest-first parts."""
    from wan_enhanced.quant.fp8_rows import GRANULE, row_parts

    assert row_parts(8960) == (8192, 512, 256, 0)
    assert row_parts(14336) == (8192, 4096, 2048, 0)
    assert row_parts(5120) == (4096, 1024, 0, 0)
    assert row_parts(13824) == (8192, 4096, 1024, 512)
    assert row_parts(64) == (64, 0, 0, 0)
    for width in range(1, 40000, 97):
        parts = row_parts(width)
        used = [p for p in parts if p]
        assert all(p & (p - 1) == 0 for p in used)
        assert list(used) == sorted(used, reverse=True) and parts[len(used):] == (0, ) * (4 - len(used))
        assert sum(used) >= width
        if width > GRANULE:
            assert sum(used) - width < max(GRANULE, used[-1])


def test_the_heads_of_a_norm_row_are_two_power_of_two_parts():
    """The q/k norm kernel holds a row as two power-of-two counts of heads (Wan's 12, 24 and 40
    heads with at most 8 spare, where one part padded 40 to 64), the second at least 1 (masked
    when the first covers the row); no kernel for a head_dim that is not a power of two."""
    assert glue.head_parts(24, 128) == (16, 8, 4)
    assert glue.head_parts(40, 128) == (32, 8, 4)
    assert glue.head_parts(12, 128) == (8, 4, 4)
    assert glue.head_parts(16, 128) == (16, 1, 4)
    assert glue.head_parts(1, 64) == (1, 1, 4)
    assert glue.head_parts(24, 96) is None and glue.head_parts(0, 128) is None
    for heads in range(1, 130):
        first, second, _ = glue.head_parts(heads, 128)
        assert first & (first - 1) == 0 and second & (second - 1) == 0
        assert first <= heads <= first + second and second <= max(first, 1)


def test_the_fused_ffn_product_is_only_offered_where_cublaslt_computes_it():
    layer, gelu = torch.nn.Linear(8, 16).bfloat16(), torch.nn.GELU(approximate="tanh")
    h = torch.randn(3, 8).bfloat16()
    assert glue.gelu_product_weights(layer, gelu, h) is None  # the CPU
    if torch.cuda.is_available():
        cuda_layer, cuda_h = layer.cuda(), h.cuda()
        weight, bias = glue.gelu_product_weights(cuda_layer, gelu, cuda_h)
        assert weight is cuda_layer.weight and bias is cuda_layer.bias
        assert glue.gelu_product_weights(cuda_layer, torch.nn.GELU(), cuda_h) is None  # exact
        assert glue.gelu_product_weights(cuda_layer, gelu, cuda_h.float()) is None
        no_bias = torch.nn.Linear(8, 16, bias=False).bfloat16().cuda()
        assert glue.gelu_product_weights(no_bias, gelu, cuda_h) is None

        class Wrapped(torch.Tensor):  # a tensor subclass, as torchao's quantized weights are
            pass

        wrapped = torch.nn.Linear(8, 16).bfloat16().cuda()
        wrapped.weight = torch.nn.Parameter(wrapped.weight.detach().as_subclass(Wrapped),
                                            requires_grad=False)
        assert type(wrapped.weight) is Wrapped
        assert glue.gelu_product_weights(wrapped, gelu, cuda_h) is None


@pytest.mark.gpu
def test_the_ffn_product_with_its_gelu_in_the_epilogue_is_closer_to_float32():
    """linear_gelu (one cuBLASLt product, the GELU applied before the rounding) against the
    product, its rounding and then the GELU; both against float32, at a 5B FFN width."""
    _cuda_or_skip()
    torch.manual_seed(0)
    layer = torch.nn.Linear(3072, 14336).cuda().bfloat16().requires_grad_(False)
    h = torch.randn(2, 300, 3072, device="cuda").bfloat16()
    gelu = torch.nn.GELU(approximate="tanh")
    fused = glue.linear_gelu(h, *glue.gelu_product_weights(layer, gelu, h))
    unfused = gelu(layer(h))
    exact = torch.nn.functional.gelu(torch.nn.functional.linear(
        h.float(), layer.weight.float(), layer.bias.float()), approximate="tanh")
    assert fused.shape == unfused.shape == (2, 300, 14336) and fused.dtype == torch.bfloat16
    assert _rel(fused, exact) < 3e-3
    assert _rel(fused, exact) <= _rel(unfused, exact)
    compiled = torch.compile(glue.linear_gelu)(h, layer.weight, layer.bias)
    torch.testing.assert_close(compiled, fused, rtol=0, atol=0)


@pytest.mark.gpu
def test_compiled_rms_norm_and_rotation_run_the_kernel_as_one_operator():
    """Inside a compiled graph the norm and rotation of q or k are the kernel's operator, with
    the eager kernel's output to the bit (torch.compile had written one of the two in float32
    and rounded it in a second pass)."""
    _cuda_or_skip()
    from torch._dynamo.testing import CompileCounterWithBackend

    rope = RotaryTable((3, 6, 8), (22, 21, 21), device="cuda")
    q = torch.randn(1, 144, 3072, device="cuda").bfloat16()
    k = torch.randn(1, 144, 3072, device="cuda").bfloat16()
    weight = torch.rand(3072, device="cuda") + 0.5

    def both(q, k):
        return (glue.rms_norm_heads(q, weight, 1e-6, 24, rope),
                glue.rms_norm_heads(k, weight * 2, 1e-6, 24, rope))
    backend = CompileCounterWithBackend("inductor")
    got = torch.compile(both, backend=backend)(q, k)
    ops = [n for n in backend.graphs[0].graph.nodes
           if "wan_enhanced_glue.rms_norm_rope" in str(n.target)]
    assert len(ops) == 2
    for out, expected in zip(got, both(q, k)):
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
