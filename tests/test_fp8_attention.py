"""The fp8 attention backend: its numerics stated in PyTorch (CPU), the fallback where the kernel
cannot run (CPU), and on a GPU (opt-in, --gpu) the kernel against that statement and against
exact attention."""

import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from wan_enhanced import gpu_support
from wan_enhanced.wan import attention, fp8_attention as fa
from tiny_sets import tiny_block


def _qkv(length, heads=2, seed=0, spread=1.0, device="cpu"):
    """RMS-normed queries and keys with a shared per-channel offset (as Wan's are), values
    plain: scores with a standard deviation around 1-2, as in the model."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    gain = (1 + 0.5 * randn(128)).abs() * spread
    q = F.rms_norm(randn(1, length, heads, 128) + 0.3 * randn(1, 1, heads, 128), (128,)) * gain
    k = F.rms_norm(randn(1, length, heads, 128) + 1.0 * randn(1, 1, heads, 128), (128,)) * gain
    v = randn(1, length, heads, 128)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def _exact(q, k, v):
    out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def _cosine(a, b):
    return float(F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def test_emulated_numerics_stay_close_to_exact_attention():
    """int8 Q K^T (per-token / per-128-token scales, keys smoothed by their mean) keeps the
    output within 0.02% (cosine); fp8 P V adds the rounding of P's 3-bit mantissa, which on
    uncorrelated values (the worst case: the output is as small as the noise allows) leaves
    about 4% relative L2 and a cosine above 0.999."""
    q, k, v = _qkv(1000)
    exact = _exact(q, k, v)
    ours = fa.reference_fp8_attention(q, k, v).float()
    assert _cosine(ours, exact) >= 0.999
    assert float((ours - exact).norm() / exact.norm()) < 0.05
    q_deq, k_deq, _ = fa.quantized_operands(q, k, v)
    scores_only = F.scaled_dot_product_attention(q_deq, k_deq, v.float().transpose(1, 2))
    assert _cosine(scores_only.transpose(1, 2), exact) >= 0.9998


def test_key_mean_does_not_change_the_result():
    """Subtracting the keys' mean shifts every score of a query equally: a large shared offset on
    the keys leaves the emulated output where it was (it would swamp int8 scales otherwise)."""
    q, k, v = _qkv(600, seed=3)
    shifted = (k.float() + 20.0 * torch.randn(1, 1, 2, 128)).to(torch.bfloat16)
    exact = _exact(q, shifted, v)
    assert _cosine(fa.reference_fp8_attention(q, shifted, v), exact) >= 0.999


def test_quantized_operands_use_the_stated_grids():
    q, k, v = _qkv(300, seed=1)
    q_deq, k_deq, v_deq = fa.quantized_operands(q, k, v)
    q_scale = q.float().transpose(1, 2).abs().amax(-1, keepdim=True) / 127
    codes = q_deq / q_scale
    assert torch.allclose(codes, codes.round(), atol=1e-4)
    assert float(codes.abs().max().round()) == 127.0
    blocks = F.pad(k_deq, (0, 0, 0, fa.padded_length(300) - 300)).unflatten(2, (-1, 128))
    k_codes = blocks / (blocks.abs().amax(dim=(-1, -2), keepdim=True) / 127)
    assert torch.allclose(k_codes, k_codes.round(), atol=1e-4)
    v_scale = v.float().transpose(1, 2).abs().amax(2, keepdim=True) / 448
    fp8 = (v_deq / v_scale).to(torch.float8_e4m3fn).float()
    assert torch.allclose(fp8, v_deq / v_scale, rtol=1e-6)


def test_backend_falls_back_to_sdpa_with_a_warning_where_the_kernel_cannot_run():
    q, k, v = _qkv(64)
    gpu_support._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = attention.get_backend("fp8_triton", torch.device("cpu"), 128)
    messages = [str(w.message) for w in caught]
    assert any("fp8_triton" in m and "NVIDIA GPU" in m and "SDPA" in m for m in messages)
    assert torch.equal(fn(q, k, v), attention.get_backend("sdpa_cudnn")(q, k, v))


def test_auto_picks_fp8_attention_only_with_fp8_matmuls():
    assert attention.resolve_backend("auto", "fp8_e4m3fn_fast") == "fp8_triton"
    for weights in ("bf16", "fp16", "fp32", "fp8_e4m3fn", "int8", "int8_dynamic"):
        assert attention.resolve_backend("auto", weights) == "sdpa_cudnn"
    assert attention.resolve_backend("sdpa", "fp8_e4m3fn_fast") == "sdpa"
    assert "auto" in attention.available_backends()
    assert "fp8_triton" in attention.available_backends()


def test_unavailable_reasons_name_the_requirement():
    assert "NVIDIA GPU" in fa.fp8_attention_unavailable(torch.device("cpu"))


def _cpu_operands(length, lq=None, dim=128, pv_fp8=True):
    """Operands of the kernels' shapes on the CPU (their values do not matter here)."""
    lp, lqp = fa.padded_length(length), fa.padded_length(lq or length)
    return fa.Fp8Operands(
        q8=torch.zeros(2, lqp, dim, dtype=torch.int8), k8=torch.zeros(2, lp, dim, dtype=torch.int8),
        vt=torch.zeros(2, dim, lp, dtype=torch.float8_e4m3fn),
        q_scale=torch.ones(2, lqp), k_scale=torch.ones(2, lp // 128), v_scale=torch.ones(2, dim),
        length=length, pv_fp8=pv_fp8)


def test_the_hopper_kernel_names_why_it_cannot_run():
    ops = _cpu_operands(300)
    out = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    assert "Hopper GPU" in fa.hopper_kernel_unavailable(ops, out)
    with pytest.raises(ValueError, match="Hopper kernel cannot run: it needs a Hopper GPU"):
        fa.attend_quantized(ops, out, kernel="hopper")
    with pytest.raises(ValueError, match="kernel must be one of"):
        fa.attend_quantized(ops, out, kernel="gluon")
    with pytest.raises(ValueError, match="config is for the portable kernel"):
        fa.attend_quantized(ops, out, dict(BLOCK_M=64, BLOCK_N=128), kernel="hopper")


def test_a_hopper_gpu_without_the_kernel_falls_back_to_the_portable_one_with_a_warning(
        monkeypatch):
    """Where Triton lacks Gluon, or the kernel fails to build, auto says so once and runs the
    portable kernel (same output); asked for by name, the Hopper kernel is refused with the
    reason, and a build error is not swallowed."""
    ops = _cpu_operands(300)
    out = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    ran = []
    monkeypatch.setattr(fa, "_on_hopper", lambda t: True)
    monkeypatch.setattr(fa, "_attend_portable", lambda o, t, config: ran.append(config))
    monkeypatch.setattr(fa, "_hopper_module", lambda: "this Triton has no Gluon for Hopper (x)")
    monkeypatch.setattr(fa, "_HOPPER_FAILED", [])
    gpu_support._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="no Gluon for Hopper.*portable Triton kernel"):
        fa.attend_quantized(ops, out)
    assert ran == [None]
    with pytest.raises(ValueError, match="Hopper kernel cannot run: this Triton has no Gluon"):
        fa.attend_quantized(ops, out, kernel="hopper")

    class Broken:
        @staticmethod
        def attend(ops, out):
            raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(fa, "_hopper_module", lambda: Broken)
    with pytest.raises(RuntimeError, match="PassManager"):
        fa.attend_quantized(ops, out, kernel="hopper")
    assert fa._HOPPER_FAILED == []
    with pytest.warns(RuntimeWarning, match="failed to build here.*PassManager"):
        fa.attend_quantized(ops, out)
    assert ran == [None, None]
    assert "failed to build" in fa.hopper_kernel_unavailable(ops, out)  # not tried again
    fa.attend_quantized(ops, out)
    assert ran == [None, None, None]


def _stand_in_hopper(monkeypatch, module, ran):
    """A Hopper GPU whose Hopper kernel is `module`, the portable kernel noting its runs in `ran`,
    and nothing yet known of the kernel's build."""
    monkeypatch.setattr(fa, "_on_hopper", lambda t: True)
    monkeypatch.setattr(fa, "_attend_portable", lambda o, t, config: ran.append("portable"))
    monkeypatch.setattr(fa, "_hopper_module", lambda: module)
    for name in ("_HOPPER_FAILED", "_HOPPER_SLOW"):
        monkeypatch.setattr(fa, name, [])
    monkeypatch.setattr(fa, "_HOPPER_CHECKED", {})


def test_a_hopper_kernel_built_with_spilled_registers_leaves_auto_to_the_portable_one(
        monkeypatch):
    """Some Triton releases build the Hopper kernel with its registers spilled to local memory
    (Triton 3.9: 296 bytes a thread, half the speed of the portable kernel). The first launch's
    output stands; then auto says why once and runs the portable kernel, the eager blocks stop
    sizing their chunks for the Hopper kernel, and asked for by name it still runs."""
    ops = _cpu_operands(300)
    out = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    ran = []

    class Spilling:
        ROWS_PER_PROGRAM = 192
        SPILL_LIMIT_WORDS = 40

        @staticmethod
        def attend(ops, out):
            ran.append("hopper")
            return types.SimpleNamespace(n_spills=74)

    _stand_in_hopper(monkeypatch, Spilling, ran)
    monkeypatch.setattr(fa, "_hopper_device", lambda device: True)
    gpu_support._WARNED.clear()
    assert fa.hopper_rows_per_program(torch.device("cuda"), 128) == 192
    with pytest.warns(RuntimeWarning, match=r"Hopper kernel is slow here \(Triton .* 296 bytes "
                                            r"of local memory.*at most 160\).*portable"):
        fa.attend_quantized(ops, out)
    assert ran == ["hopper"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        fa.attend_quantized(ops, out)
    assert ran == ["hopper", "portable"]
    assert fa.hopper_rows_per_program(torch.device("cuda"), 128) is None
    fa.attend_quantized(ops, out, kernel="hopper")
    assert ran == ["hopper", "portable", "hopper"]


def test_a_hopper_kernel_built_without_spills_stays_what_auto_runs(monkeypatch):
    ops = _cpu_operands(300)
    out = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    ran = []

    class Lean:
        SPILL_LIMIT_WORDS = 40

        @staticmethod
        def attend(ops, out):
            ran.append("hopper")
            return types.SimpleNamespace(n_spills=16)  # what Triton 3.6 builds

    _stand_in_hopper(monkeypatch, Lean, ran)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.attend_quantized(ops, out)
        fa.attend_quantized(ops, out)
    assert ran == ["hopper", "hopper"] and fa._HOPPER_SLOW == []


def test_each_build_of_the_hopper_kernel_is_checked_the_first_time_it_runs(monkeypatch):
    """Triton builds a kernel once per specialization (lengths that are multiples of 16 or not,
    ...), and releases allocate each build's registers apart: a lean first build says nothing
    of a later one. Every build is checked once, the first time it runs (not on every call),
    and the first spilled one leaves auto to the portable kernel, said once."""
    ops = _cpu_operands(300)
    out = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16)
    ran, checked = [], []
    lean, spilled = types.SimpleNamespace(n_spills=16), types.SimpleNamespace(n_spills=30)
    builds = iter([lean, lean, spilled])

    class TwoBuilds:
        SPILL_LIMIT_WORDS = 24

        @staticmethod
        def attend(ops, out):
            ran.append("hopper")
            return next(builds)

    _stand_in_hopper(monkeypatch, TwoBuilds, ran)
    real_check = fa.spill_problem
    monkeypatch.setattr(fa, "spill_problem",
                        lambda compiled, limit: checked.append(compiled) or real_check(compiled,
                                                                                      limit))
    gpu_support._WARNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.attend_quantized(ops, out)
        fa.attend_quantized(ops, out)  # the same build: not checked again
    assert checked == [lean] and fa._HOPPER_SLOW == []
    with pytest.warns(RuntimeWarning, match=r"Hopper kernel is slow here .*120 bytes.*at most 96"):
        fa.attend_quantized(ops, out)  # another specialization's build, spilled
    assert checked == [lean, spilled]
    fa.attend_quantized(ops, out)
    assert ran == ["hopper"] * 3 + ["portable"]


def test_every_autotuned_configuration_computes_the_same_bits():
    """The softmax's running maximum is per key block, so P's fp8 rounding depends on the block:
    every configuration the autotuner may pick takes K_BLOCK keys, or the output would depend on
    which one won the timing in this process (and the Hopper kernel would equal only some)."""
    pytest.importorskip("triton")
    from wan_enhanced.wan import fp8_attention_kernels as kernels

    assert {config.kwargs["BLOCK_N"] for config in kernels.attention_configs()} == {fa.K_BLOCK}


def test_the_hopper_kernel_compiles_for_sm90_without_serialized_products():
    """Offline (no GPU; where Triton with Gluon is installed): registers move to the three
    consumer groups (160 each, the producer's warps keep 32), ptxas keeps the tensor-core
    products asynchronous, each group's loop over key blocks spills at most a handful of
    registers (5 with Triton 3.6: 160 hold the accumulator, the scores and the softmax state)
    where the build is within the spill guard's limit, and P reaches the P V product through
    shared memory (stmatrix)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from wan_enhanced.bench import kernel_probe
    from wan_enhanced.wan import fp8_attention_hopper as hopper

    kernel = kernel_probe.compile_hopper_for_sm90()
    facts, sass = kernel_probe.report(kernel)
    assert not kernel_probe.serialized(kernel)
    ptx = kernel.asm["ptx"]
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{hopper.CONSUMER_REGS}" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t32" in ptx
    loops = kernel_probe.sass_loops(sass)
    assert len(loops) == hopper.GROUPS
    lean = facts["stack_bytes"] <= 4 * hopper.SPILL_LIMIT_WORDS
    for loop in loops:
        # the spill guard's measure (a thread's local memory) agrees with the loops: this
        # Triton builds them lean (3.6-3.8), or auto leaves the kernel (3.9 spills ~70 a loop)
        assert (loop["opcodes"].get("STL", 0) <= 8) == lean, (facts, loop["opcodes"])
        assert loop["opcodes"]["MUFU"] >= 64 and loop["opcodes"]["STSM"] == 4, loop["opcodes"]
        assert loop["opcodes"]["IGMMA"] == loop["opcodes"]["QGMMA"] == 4, loop["opcodes"]


# -- GPU (opt-in) ------------------------------------------------------------------------------

def _cuda_fp8_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    reason = fa.fp8_attention_unavailable(torch.device("cuda"), 128)
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
def test_fp8_values_are_stored_in_the_operand_key_order():
    """vt's fp8 codes hold, in each 32 columns, key 16h + 8a + 2q + b at column 16h + 4q + 2a + b
    (fp8_attention_kernels.key_order; the bf16 layout keeps the keys in order); padding keys
    are zeros wherever they land."""
    _cuda_fp8_or_skip()
    q, k, _ = _qkv(300, heads=2, seed=8, device="cuda")
    # values that are fp8 codes times 1/16, each channel reaching 448 / 16: the channel scales
    # are 1/16 and the codes come back exactly, however the kernel rounds its division
    gen = torch.Generator(device="cuda").manual_seed(9)
    codes = (torch.randn(1, 300, 2, 128, device="cuda", generator=gen) * 100).clamp(-448, 448)
    codes = codes.to(torch.float8_e4m3fn).float()
    codes[0, 7] = 448.0
    v = (codes / 16).to(torch.bfloat16)
    ops = fa.quantize_only(q, k, v)
    assert torch.equal(ops.v_scale, torch.full_like(ops.v_scale, 1 / 16))
    lp = ops.vt.shape[-1]
    in_order = F.pad(codes[0].transpose(0, 1), (0, 0, 0, lp - 300)).transpose(1, 2)  # [2, D, Lp]
    within = torch.arange(32).view(2, 2, 4, 2).permute(0, 2, 1, 3).flatten()
    keys = (torch.arange(lp) // 32 * 32 + within.repeat(lp // 32)).cuda()
    assert torch.equal(ops.vt.float(), in_order[..., keys])
    bf16 = fa.quantize_only(q, k, v, pv_fp8=False)
    assert torch.equal(bf16.vt[..., :300], v[0].transpose(0, 1).transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1024, 1500, 4097])
def test_kernel_matches_its_pytorch_statement(length):
    """Every output element written (poisoned first). With P and V in bf16 the kernel equals
    the emulation to bf16 rounding (the int8 scores are exact in both); with fp8 P V it stays
    within P's fp8 rounding of it (the online softmax rounds P against a running maximum)."""
    _cuda_fp8_or_skip()
    q, k, v = _qkv(length, heads=3, seed=length, device="cuda")
    for pv_fp8, bound in ((False, 5e-3), (True, 0.05)):
        ops = fa.quantize_only(q, k, v, pv_fp8)
        out = torch.full_like(q, float("nan"))
        fa.attend_quantized(ops, out)
        assert not out.isnan().any()
        emulated = fa.reference_fp8_attention(q, k, v, pv_fp8=pv_fp8).float()
        assert float((out.float() - emulated).norm() / emulated.norm()) < bound, pv_fp8


@pytest.mark.gpu
def test_kernel_error_against_exact_attention_at_a_wan_length():
    _cuda_fp8_or_skip()
    q, k, v = _qkv(27280, heads=4, seed=7, device="cuda")
    out = fa.fp8_attention(q, k, v).float()
    exact = _exact(q, k, v)
    per_head = F.cosine_similarity(out.transpose(1, 2).flatten(2), exact.transpose(1, 2).flatten(2),
                                   dim=-1)
    assert float(per_head.min()) >= 0.999, per_head
    # the largest single deviation: about one fp8 rounding step of P on the largest output
    assert float((out - exact).abs().max() / exact.abs().max()) < 0.08


def offset_values(v: torch.Tensor, seed: int) -> torch.Tensor:
    """Values with a large per-channel mean, as Wan's are: the output is mostly that mean."""
    gen = torch.Generator(device=v.device).manual_seed(seed)
    mean = 2 + torch.randn(v.shape[-1], generator=gen, device=v.device)
    return (0.3 * v.float() + mean).to(v.dtype)


def drift(out: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest systematic error: the mean over tokens of out - exact, per head and channel,
    relative to the largest output."""
    return float((out.float() - exact).mean(dim=1).abs().max() / exact.abs().max())


@pytest.mark.gpu
def test_long_sums_of_values_with_a_large_mean_do_not_drift():
    """27,280 keys of values around a large mean: the products of P and V are summed in float32
    (tensor-core fp8 accumulation, with fewer bits, drifted the output systematically)."""
    _cuda_fp8_or_skip()
    q, k, v = _qkv(27280, heads=2, seed=17, device="cuda")
    v = offset_values(v, 18)
    out = fa.fp8_attention(q, k, v)
    exact = _exact(q, k, v)
    assert drift(out, exact) < 0.02  # fp8 tensor-core sums exceed it many times over
    assert float((out.float() - exact).abs().max() / exact.abs().max()) < 0.03


@pytest.mark.gpu
def test_the_longest_wan_sequence_keeps_its_cosine():
    """75,600 keys (14B at 1280x720x81): float32 sums of each block's P V keep the cosine to
    exact attention at 0.999 (tensor-core accumulation, even of centred values, fell to 0.9987
    here: bench/results/README.md, experiments)."""
    _cuda_fp8_or_skip()
    q, k, v = _qkv(75600, heads=1, seed=19, device="cuda")
    out = fa.fp8_attention(q, k, v)
    exact = _exact(q, k, v)
    assert float(F.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0)) >= 0.999
    assert drift(out, exact) < 0.01


@pytest.mark.gpu
def test_a_chunk_of_query_rows_equals_those_rows_of_the_whole():
    """Eager blocks attend chunk by chunk of rows over all keys: the kernel takes fewer queries
    than keys, with the same result for those rows."""
    _cuda_fp8_or_skip()
    q, k, v = _qkv(3000, heads=2, seed=11, device="cuda")
    config = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    whole = fa._launch(q, k, v, config)
    part = fa._launch(q[:, 1100:2300], k, v, config)
    assert torch.equal(part, whole[:, 1100:2300])


@pytest.mark.gpu
def test_compiled_block_runs_the_kernel_as_one_operator():
    _cuda_fp8_or_skip()
    q, k, v = _qkv(2048, heads=2, seed=5, device="cuda")
    fn = attention.get_backend("fp8_triton", q.device, 128)
    eager = fn(q, k, v)
    compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
    assert math.isfinite(float(eager.float().abs().max()))


def _hopper_or_skip():
    _cuda_fp8_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel needs compute capability 9.0")
    module = fa._hopper_module()
    if isinstance(module, str):
        pytest.skip(module)


@pytest.mark.gpu
@pytest.mark.parametrize("lq, length", [(129, 129), (64, 256), (300, 300), (200, 1000),
                                        (1000, 4100), (27280, 27280)])
def test_the_hopper_kernel_equals_the_portable_one_bit_for_bit(lq, length):
    """The same numbers in the same order: the warp-specialized kernel writes the portable
    kernel's output exactly (every element written: poisoned first), also for fewer queries than
    keys and for lengths one past a block."""
    _hopper_or_skip()
    q, k, v = _qkv(length, heads=3, seed=lq + length, device="cuda")
    ops = fa.quantize_only(q[:, :lq].contiguous(), k, v)
    portable = torch.full_like(q[:, :lq], float("nan"))
    fa.attend_quantized(ops, portable, kernel="portable")
    hopper = torch.full_like(portable, float("nan"))
    fa.attend_quantized(ops, hopper, kernel="hopper")
    assert not hopper.isnan().any()
    assert torch.equal(hopper, portable)


@pytest.mark.gpu
def test_auto_uses_the_hopper_kernel_for_long_keys_and_the_portable_one_for_short():
    _hopper_or_skip()
    q, k, v = _qkv(128, heads=1, seed=3, device="cuda")
    ops = fa.quantize_only(q, k, v)
    assert "more than 128 keys" in fa.hopper_kernel_unavailable(ops, torch.empty_like(q))
    with pytest.raises(ValueError, match="more than 128 keys"):
        fa.attend_quantized(ops, torch.empty_like(q), kernel="hopper")
    out = torch.full_like(q, float("nan"))
    fa.attend_quantized(ops, out)  # auto: the portable kernel, silently
    assert not out.isnan().any()
    q, k, v = _qkv(2000, heads=1, seed=4, device="cuda")
    ops = fa.quantize_only(q, k, v)
    assert fa.hopper_kernel_unavailable(ops, torch.empty_like(q)) is None


# -- the queries' norm, rotation and codes in one pass ----------------------------------------

def _projected_queries(length, heads, seed, device="cpu", start=0, tokens=None):
    from wan_enhanced.wan.configs import DiTConfig
    from wan_enhanced.wan.rope import RotaryTable

    gen = torch.Generator(device=device).manual_seed(seed)
    width = heads * 128
    q = (torch.randn(1, length, width, generator=gen, device=device) * 2
         + torch.randn(1, 1, width, generator=gen, device=device)).bfloat16()
    weight = (1 + 0.3 * torch.randn(width, generator=gen, device=device)).bfloat16()
    total = tokens or length + start
    pairs = DiTConfig(dim=width, num_heads=heads).rope_pairs
    rope = RotaryTable((1, 1, total), pairs, device=device)
    return q, weight, rope


def test_queries_before_their_norm_fall_back_to_norm_then_attention():
    """fp8_attention_normed_query where the kernel does not take the keys (short text keys, or
    no GPU): the queries' norm and rotation (glue.rms_norm_heads), then the backend, as the
    block would call them."""
    from wan_enhanced.wan.glue import rms_norm_heads

    q, weight, rope = _projected_queries(40, 2, 0, start=5, tokens=60)
    k, v = (torch.randn(1, 16, 2, 128).bfloat16() for _ in range(2))
    out = fa.fp8_attention_normed_query(q, weight, 1e-6, 2, rope, 5, k, v)
    expected = fa.fp8_attention(rms_norm_heads(q, weight, 1e-6, 2, rope, 5), k, v)
    assert out.shape == (1, 40, 2, 128) and torch.equal(out, expected)


def test_a_block_hands_the_fp8_backend_its_queries_before_their_norm(monkeypatch):
    """SelfAttention.attend_rows gives the fp8 backend the projected queries, their norm's gain
    and the rotation (which it applies in its own pass); any other backend gets them normed and
    rotated. Both compute the same attention."""
    from wan_enhanced.wan import dit_attention
    from wan_enhanced.wan.configs import DiTConfig
    from wan_enhanced.wan.glue import rms_norm_heads
    from wan_enhanced.wan.rope import RotaryTable
    from wan_enhanced.wan.sdpa import sdpa

    attn_pairs = DiTConfig(dim=256, num_heads=2).rope_pairs
    torch.manual_seed(0)
    attn = dit_attention.SelfAttention(256, 2, 1e-6).bfloat16()
    h = torch.randn(1, 12, 256).bfloat16()
    rope = RotaryTable((1, 3, 4), attn_pairs)
    k, v = (torch.randn(1, 12, 2, 128).bfloat16() for _ in range(2))
    calls = []

    def normed_query(q, weight, eps, heads, rope_, start, k_, v_, keys=None):
        calls.append((weight is attn.norm_q.weight, eps, heads, start))
        return sdpa(rms_norm_heads(q, weight, eps, heads, rope_, start), k_, v_)
    monkeypatch.setattr(dit_attention, "fp8_attention_normed_query", normed_query)
    with torch.no_grad():
        fused = attn.attend_rows(h, rope, 0, k, v, fa.fp8_attention)
        plain = attn.attend_rows(h, rope, 0, k, v, sdpa)
    assert calls == [(True, 1e-6, 2, 0)]
    assert torch.equal(fused, plain)


def test_a_row_chunked_block_quantizes_the_keys_once_for_all_its_chunks(monkeypatch):
    """An eager block attending chunk by chunk of query rows hands the fp8 backend the keys and
    values quantized once (fp8_keys), not once per chunk; the phase computes what it computes
    with any other backend."""
    from wan_enhanced.wan import dit_attention, dit_block
    from wan_enhanced.wan.glue import rms_norm_heads
    from wan_enhanced.wan.sdpa import sdpa

    block, x, e0, _, rope = tiny_block()
    made, handed = [], []
    sentinel = object()

    def keys_once(k, v):
        made.append((k.shape, v.shape))
        return sentinel

    def normed_query(q, weight, eps, heads, rope_, start, k_, v_, keys=None):
        handed.append((start, keys is sentinel))
        return sdpa(rms_norm_heads(q, weight, eps, heads, rope_, start), k_, v_)
    monkeypatch.setattr(dit_block, "fp8_keys", keys_once)
    monkeypatch.setattr(dit_attention, "fp8_attention_normed_query", normed_query)
    with torch.no_grad():
        fused = block.self_attention_phase(x.clone(), e0, rope, fa.fp8_attention, torch.float32,
                                           attention_rows=16)
        plain = block.self_attention_phase(x.clone(), e0, rope, sdpa, torch.float32,
                                           attention_rows=16)
    assert made == [(torch.Size([1, 45, 2, 128]),) * 2]
    assert handed == [(0, True), (16, True), (32, True)]
    assert torch.equal(fused, plain)


def test_keys_are_quantized_ahead_only_where_the_kernel_takes_them():
    """fp8_keys makes nothing off the GPU or for short keys (SDPA takes those)."""
    k = torch.randn(1, 2048, 2, 128).bfloat16()
    assert fa.fp8_keys(k, k) is None
    if torch.cuda.is_available():
        short = torch.randn(1, fa.MIN_KEYS - 1, 2, 128, device="cuda").bfloat16()
        assert fa.fp8_keys(short, short) is None


@pytest.mark.gpu
def test_keys_quantized_once_give_each_chunk_of_queries_the_same_output():
    """A chunk of query rows attending to keys quantized ahead (fp8_keys) gets the output it
    gets when the call quantizes them itself, to the bit."""
    _cuda_fp8_or_skip()
    q, weight, rope = _projected_queries(1100, 2, 3, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    k, v = (torch.randn(1, 1100, 2, 128, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    keys = fa.fp8_keys(k, v)
    assert keys is not None
    for start, end in ((0, 500), (500, 1100)):
        part = q[:, start:end].contiguous()
        ahead = fa.fp8_attention_normed_query(part, weight, 1e-6, 2, rope, start, k, v, keys)
        itself = fa.fp8_attention_normed_query(part, weight, 1e-6, 2, rope, start, k, v)
        assert torch.equal(ahead, itself)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, length, start", [(12, 1500, 0), (24, 1100, 300), (40, 257, 0)])
def test_queries_normed_and_quantized_in_one_pass_are_the_two_passes_to_the_bit(heads, length,
                                                                               start):
    """normed_query_codes (norm, rotation and int8 codes in one kernel) against rms_norm_heads
    then quantize_q_kernel: the same codes and scales, padding rows included; the attention over
    them the same output, eager and compiled (one operator in the graph)."""
    _cuda_fp8_or_skip()
    from wan_enhanced.wan.glue import rms_norm_heads

    q, weight, rope = _projected_queries(length, heads, heads, "cuda", start,
                                         tokens=length + start + 7)
    gen = torch.Generator(device="cuda").manual_seed(1)
    k, v = (torch.randn(1, 1024 + 77, heads, 128, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    normed = rms_norm_heads(q, weight, 1e-6, heads, rope, start)
    two_pass = fa.quantize_only(normed, k, v)
    q8, scales = fa.normed_query_codes(q, weight.float(), rope.cos, rope.sin, start, 1e-6, heads)
    assert torch.equal(q8, two_pass.q8) and torch.equal(scales, two_pass.q_scale)
    expected = fa.fp8_attention(normed, k, v)
    out = fa.fp8_attention_normed_query(q, weight, 1e-6, heads, rope, start, k, v)
    assert torch.equal(out, expected)
    compiled = torch.compile(fa.fp8_attention_normed_query, fullgraph=True)
    assert torch.equal(compiled(q, weight, 1e-6, heads, rope, start, k, v), expected)
    torch._dynamo.reset()


def test_wave_rows_fill_whole_waves_of_the_multiprocessors(monkeypatch):
    """attention.wave_rows: for our Hopper kernels, the query rows of the fewest row tiles whose
    programs (one per batch entry, head and tile) are a multiple of the multiprocessors (132 on
    an H100); None off those kernels and for other backends."""
    from types import SimpleNamespace

    from wan_enhanced.wan import attention, bf16_attention
    from wan_enhanced.wan.sdpa import sdpa

    cuda = torch.device("cuda")
    assert attention.wave_rows(fa.fp8_attention, 24, 128, torch.device("cpu"),
                               torch.bfloat16) is None
    monkeypatch.setattr(fa, "hopper_rows_per_program", lambda device, head_dim: 192)
    monkeypatch.setattr(bf16_attention, "hopper_rows_per_program",
                        lambda device, head_dim, dtype: 128)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    for heads, rows in ((24, 2112), (40, 6336), (12, 2112), (48, 2112), (2 * 24, 2112)):
        unit = attention.wave_rows(fa.fp8_attention, heads, 128, cuda, torch.bfloat16)
        assert unit == rows
        tiles = unit // 192
        assert tiles * heads % 132 == 0 and all(t * heads % 132 for t in range(1, tiles))
    assert attention.wave_rows(bf16_attention.bf16_hopper_attention, 24, 128, cuda,
                               torch.bfloat16) == 11 * 128
    assert attention.wave_rows(sdpa, 24, 128, cuda, torch.bfloat16) is None


@pytest.mark.gpu
def test_wave_rows_of_the_kernels_on_this_gpu():
    """On a Hopper GPU both kernels say their rows per program, and wave_rows' unit fills whole
    waves of this GPU's multiprocessors at Wan's head counts."""
    import math

    from wan_enhanced.wan import attention, bf16_attention

    cuda = torch.device("cuda")
    if not fa._is_hopper(torch.cuda.current_device()):
        pytest.skip("not a Hopper GPU")
    sms = torch.cuda.get_device_properties(cuda).multi_processor_count
    for attend, rows in ((fa.fp8_attention, fa.hopper_rows_per_program(cuda, 128)),
                         (bf16_attention.bf16_hopper_attention,
                          bf16_attention.hopper_rows_per_program(cuda, 128, torch.bfloat16))):
        assert rows in (128, 192)
        for heads in (12, 24, 40):
            unit = attention.wave_rows(attend, heads, 128, cuda, torch.bfloat16)
            assert unit == rows * sms // math.gcd(heads, sms)
    assert fa.hopper_rows_per_program(cuda, 64) is None

