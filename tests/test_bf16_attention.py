"""The exact Hopper attention backend (bf16_hopper): what auto picks, the fallback where the
kernel cannot run (CPU), its offline build for sm_90 (where Triton is installed), and on a Hopper
GPU (opt-in, --gpu) the kernel against float32 attention, beside cuDNN's error."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from wan_enhanced import gpu_support
from wan_enhanced.wan import attention, bf16_attention as ba
from wan_enhanced.wan.sdpa import sdpa_cudnn


def _qkv(b, lq, lk, heads, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, lq, heads, 128, generator=gen, device=device) * 1.5
    k = torch.randn(b, lk, heads, 128, generator=gen, device=device) * 1.5
    k = k + 2.0 * torch.randn(1, 1, heads, 128, generator=gen, device=device)  # a shared offset
    v = torch.randn(b, lk, heads, 128, generator=gen, device=device)
    return tuple(t.to(dtype) for t in (q, k, v))


def _exact(q, k, v):
    out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def test_the_unavailable_reasons_name_the_requirement():
    assert "Hopper GPU" in ba.bf16_hopper_unavailable(torch.device("cpu"))
    assert "cpu" in ba.bf16_hopper_unavailable(torch.device("cpu"))


def test_off_hopper_the_backend_warns_and_runs_cudnn_first_sdpa():
    q, k, v = _qkv(1, 64, 64, 2)
    gpu_support._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = attention.get_backend("bf16_hopper", torch.device("cpu"), 128)
    messages = [str(w.message) for w in caught]
    assert any("'bf16_hopper'" in m and "Hopper GPU" in m and "SDPA" in m for m in messages)
    assert fn is sdpa_cudnn
    # auto promises only the fastest exact kernel that runs: no warning off Hopper
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attention.get_backend("auto", torch.device("cpu"), 128) is sdpa_cudnn
    assert not caught


def test_auto_picks_the_hopper_kernel_for_16_bit_weights_where_it_runs(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "bf16_hopper_unavailable", lambda device: None)
    for weights in ("bf16", "fp16", "fp8_e4m3fn", "int8", "int8_dynamic", None):
        assert attention.resolve_backend("auto", weights, gpu) == "bf16_hopper"
    assert attention.resolve_backend("auto", "fp32", gpu) == "sdpa_cudnn"
    assert attention.resolve_backend("auto", "fp8_e4m3fn_fast", gpu) == "fp8_triton"
    assert attention.resolve_backend("sdpa", "bf16", gpu) == "sdpa"
    monkeypatch.setattr(attention, "bf16_hopper_unavailable", lambda device: "not Hopper")
    assert attention.resolve_backend("auto", "bf16", gpu) == "sdpa_cudnn"
    assert "bf16_hopper" in attention.available_backends()


def test_the_reasons_on_a_gpu_name_the_gpu_and_the_dtype(monkeypatch):
    from types import SimpleNamespace

    gpu = torch.device("cuda", 0)
    props = SimpleNamespace(major=8, minor=9, name="NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert "RTX 4090 has 8.9" in ba.bf16_hopper_unavailable(gpu)
    props.major, props.minor, props.name = 9, 0, "NVIDIA H100"
    assert "head_dim 128; this model has 64" in ba.bf16_hopper_unavailable(gpu, 64)
    assert "bf16 or fp16; these weights compute in torch.float32" in ba.bf16_hopper_unavailable(
        gpu, 128, torch.float32)


def test_the_loader_says_at_load_time_when_the_kernel_will_not_run(monkeypatch):
    from wan_enhanced.pipeline import loading

    monkeypatch.setattr(loading.host, "compute_device", lambda: torch.device("cpu"))
    gpu_support._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="'bf16_hopper' cannot run here: it needs"):
        loading._check_attention("bf16_hopper", torch.bfloat16)
    seen = []
    monkeypatch.setattr(loading, "bf16_hopper_unavailable",
                        lambda device, dtype=None: seen.append(dtype) or "a reason")
    gpu_support._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="'bf16_hopper' cannot run here: a reason"):
        loading._check_attention("bf16_hopper", torch.float32)
    assert seen == [torch.float32]


def test_short_keys_and_float32_inputs_go_to_cudnn_sdpa(monkeypatch):
    """Text cross-attention (512 keys) and float32 models never reach the kernel."""
    monkeypatch.setattr(ba, "HOPPER_ATTENTION", lambda *a: pytest.fail("the kernel ran"))
    q, k, v = _qkv(1, 300, ba.MIN_KEYS - 1, 2)
    assert torch.equal(ba.bf16_hopper_attention(q, k, v), sdpa_cudnn(q, k, v))
    q, k, v = _qkv(1, 300, ba.MIN_KEYS, 1, dtype=torch.float32)
    assert torch.equal(ba.bf16_hopper_attention(q, k, v), sdpa_cudnn(q, k, v))


def test_mismatched_inputs_never_reach_the_kernel(monkeypatch):
    """Heads or batches that differ between q and k are SDPA's to refuse, not the kernel's to
    misread."""
    monkeypatch.setattr(ba, "HOPPER_ATTENTION", lambda *a: pytest.fail("the kernel ran"))
    q, _, _ = _qkv(1, 300, 300, 2)
    _, k, v = _qkv(1, 300, ba.MIN_KEYS, 3)
    with pytest.raises(RuntimeError):
        ba.bf16_hopper_attention(q, k, v)


def test_a_kernel_that_fails_to_build_is_said_once_and_not_tried_again(monkeypatch):
    calls = []

    class Broken:
        @staticmethod
        def attend(q, k, v, out):
            calls.append(1)
            raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(ba, "_kernel_module", lambda: Broken)
    monkeypatch.setattr(ba, "_FAILED", [])
    gpu_support._WARNED.clear()
    q, k, v = _qkv(1, 200, 200, 2)
    with pytest.warns(RuntimeWarning, match="failed to build here.*PassManager.*cuDNN first"):
        out = ba._launch(q, k, v)
    assert torch.equal(out, sdpa_cudnn(q, k, v))
    assert torch.equal(ba._launch(q, k, v), out)
    assert calls == [1]


def test_out_of_memory_is_not_taken_for_a_build_failure(monkeypatch):
    class Full:
        @staticmethod
        def attend(q, k, v, out):
            raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ba, "_kernel_module", lambda: Full)
    monkeypatch.setattr(ba, "_FAILED", [])
    with pytest.raises(torch.OutOfMemoryError):
        ba._launch(*_qkv(1, 200, 200, 1))
    assert ba._FAILED == []


def test_the_kernel_compiles_for_sm90_without_serialized_products():
    """Offline (no GPU; where Triton with Gluon is installed): no spills, a wait that leaves one
    product pending (block j + 1's softmax under block j's P V), no serialized products, and the
    registers moved to the consumers."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from wan_enhanced.bench import kernel_probe

    kernel = kernel_probe.compile_bf16_hopper_for_sm90()
    facts, _ = kernel_probe.report(kernel)
    assert facts["spill_stores"] == facts["spill_loads"] == 0
    assert 1 in facts["wait_pending"]
    assert not kernel_probe.serialized(kernel)
    for count in (240, 24):
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{count}" in kernel.asm["ptx"]


# -- Hopper GPU (opt-in) -----------------------------------------------------------------------

def _hopper_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    reason = ba.bf16_hopper_unavailable(torch.device("cuda"), 128)
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("b, lq, lk, heads, dtype", [
    (1, 129, 129, 1, torch.bfloat16), (1, 300, 300, 2, torch.bfloat16),
    (2, 1000, 1000, 3, torch.bfloat16), (2, 777, 1100, 2, torch.float16),
    (1, 64, 4097, 2, torch.bfloat16), (1, 5000, 5000, 4, torch.bfloat16)])
def test_the_kernel_is_as_exact_as_cudnn(b, lq, lk, heads, dtype):
    """Against float32 attention: within cuDNN's own error (both round P to 16 bits and sum in
    float32), every row written (poisoned first), batches apart (rows past one batch's end
    belong to the next and must be masked)."""
    _hopper_or_skip()
    q, k, v = _qkv(b, lq, lk, heads, dtype, "cuda", seed=lq + lk)
    out = torch.full_like(q, float("nan"))
    ba._kernel_module().attend(q, k, v, out)
    assert not out.isnan().any()
    exact = _exact(q, k, v)
    ours = float((out.float() - exact).abs().max())
    cudnn = float((sdpa_cudnn(q, k, v).float() - exact).abs().max())
    assert ours <= 1.5 * cudnn + 1e-4, (ours, cudnn)
    cos = F.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0)
    assert float(cos) > 0.99999


@pytest.mark.gpu
def test_the_backend_under_torch_compile_is_one_operator_with_the_same_output():
    _hopper_or_skip()
    q, k, v = _qkv(2, 2048, 2048, 2, device="cuda", seed=7)
    fn = attention.get_backend("bf16_hopper", q.device, 128)
    assert fn is ba.bf16_hopper_attention
    eager = fn(q, k, v)
    compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
    # a strided view (rows of a larger tensor's heads) is made contiguous, not misread
    wide = torch.cat([q, q], dim=2)[:, :, 2:]
    assert torch.equal(fn(wide, k, v), eager)
    assert attention.resolve_backend("auto", "bf16", q.device) == "bf16_hopper"
