"""LoRAs applied to a loaded model: merged (in float32 before any quantization) or unmerged
(wrappers adding the low-rank terms at run time), through the model handle and the sampler's
placement. Handles of one loaded model share its module; it is brought to a handle's LoRAs when
that handle computes, so nothing is applied twice and nothing is copied."""

import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cpu_kernels import has_cpu_kernel

from wan_enhanced.checkpoints import reload as reload_module
from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.reader import CheckpointError, SafetensorsSource, open_checkpoint
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit
from wan_enhanced.lora import apply as lora_apply
from wan_enhanced.lora.file import LoraError, open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.layers import LoraFp8Linear, LoraLinear, official_tensors, wrappers
from wan_enhanced.lora.merge import Merge
from wan_enhanced.lora.tiny import block_modules, random_lora, write_lora
from wan_enhanced.pipeline.dit_placement import DiTPlacement
from wan_enhanced.pipeline.errors import InputError
from wan_enhanced.pipeline import loading
from wan_enhanced.pipeline.loading import load_model
from wan_enhanced.pipeline.lora import with_lora
from wan_enhanced.pipeline.placement import DevicePlacement, tensor_bytes
from wan_enhanced.quant import linear as quant_linear
from wan_enhanced.quant.rowwise import FP8, INT8, quantize_weight
from wan_enhanced.wan import dit as dit_module, dit_ffn

CONFIG = TINY_DIT["t2v"]
SHAPES = dit_shapes(CONFIG)
# outside the blocks' matrices (merged in both modes), a block matrix's bias and a whole block
# matrix (kept apart in unmerged mode)
DIFFS = ("blocks.0.norm3.weight", "blocks.1.modulation", "head.head.weight",
         "blocks.1.ffn.0.bias", "blocks.0.self_attn.o.weight")
FULL_PAIRS = [m for m in block_modules(CONFIG) if m != "blocks.0.self_attn.o"]


def relative(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_apply")
    return {
        "base": write_dit(root / "base.safetensors", CONFIG, "comfy", dtype=torch.float32),
        "fp8": write_dit(root / "fp8.safetensors", CONFIG, "comfy_fp8", dtype=torch.float32),
        "full": write_lora(root / "full.safetensors",
                           random_lora(CONFIG, seed=1, modules=FULL_PAIRS, alpha=2.0, diffs=DIFFS),
                           "generic_down_up"),
        "pairs": write_lora(root / "pairs.safetensors",
                            random_lora(CONFIG, seed=2, rank=8), "generic"),
        "other": write_lora(root / "other.safetensors",
                            random_lora(CONFIG, seed=3, rank=2, alpha=1.0), "diffusers"),
    }


def inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, CONFIG.in_dim, 3, 4, 6, generator=gen)
    return x, torch.tensor([637.0]), torch.randn(1, 7, CONFIG.text_dim, generator=gen)


def forward(handle, block_swap=0, keep=None):
    x, t, context = inputs()
    with DevicePlacement("cpu") as placement, DiTPlacement(placement, block_swap) as dit:
        dit.place(handle)
        if keep is not None:
            keep(dit)
        return handle.model(x, t, context, blocks=dit.blocks(handle))


def reference(base: Path, loras, dtype=torch.float32, quantization=None):
    """A fresh load with the LoRAs merged while loading: the expected model."""
    opened = [(open_lora(path, SHAPES), strength) for path, strength in loras]
    try:
        return load_dit(base, dtype, quantization, Merge.of(opened))[0]
    finally:
        for lora, _ in opened:
            lora.close()


def reference_forward(base, loras, **kw):
    x, t, context = inputs()
    return reference(base, loras, **kw)(x, t, context)


def snapshot(model):
    return {k: v.detach().clone() for k, v in official_tensors(model).items()}


def same_state(model, saved) -> bool:
    now = official_tensors(model)
    return now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)


# -- the two modes -----------------------------------------------------------------------------

def test_merged_handle_computes_the_merged_model(files):
    base = load_model(files["base"], "fp32", "sdpa")
    handle = with_lora(base, files["full"], 0.7, "merge")
    assert handle.model is base.model and base.loras == ()
    assert torch.equal(forward(handle), reference_forward(files["base"], [(files["full"], 0.7)]))
    assert not wrappers(handle.model)


def test_unmerged_forward_equals_merged_forward(files):
    base = load_model(files["base"], "fp32", "sdpa")
    handle = with_lora(base, files["full"], 0.7, "unmerged")
    out = forward(handle)
    assert relative(out, reference_forward(files["base"], [(files["full"], 0.7)])) < 1e-5
    found = wrappers(handle.model)
    assert len(found) == 20 and all(type(w) is LoraLinear for w in found.values())
    kinds = [a.kind for a in found["blocks.0.self_attn.o"].adapters]
    assert kinds == ["weight_diff"]
    assert [a.kind for a in found["blocks.1.ffn.0"].adapters] == ["low_rank", "bias_diff"]
    assert relative(out, forward(base)) > 0.05  # the LoRA does change the output


def test_several_loras_in_both_modes_at_once(files):
    chain = [(files["full"], 0.5, "merge"), (files["pairs"], -0.8, "unmerged"),
             (files["other"], 1.3, "unmerged")]
    handle = load_model(files["base"], "fp32", "sdpa")
    for path, strength, mode in chain:
        handle = with_lora(handle, path, strength, mode)
    expected = reference_forward(files["base"], [(p, s) for p, s, _ in chain])
    assert relative(forward(handle), expected) < 1e-5


# -- one module, many handles ----------------------------------------------------------------

def test_chains_on_one_base_share_it_and_never_double_a_lora(files):
    base = load_model(files["base"], "fp32", "sdpa")
    bytes_before = tensor_bytes(base.model)
    a = with_lora(base, files["full"], 1.0, "merge")
    b = with_lora(base, files["pairs"], 0.5, "unmerged")
    ab = with_lora(a, files["pairs"], 0.5, "unmerged")
    assert a.model is b.model is ab.model is base.model
    expected = {
        "base": reference_forward(files["base"], []),
        "a": reference_forward(files["base"], [(files["full"], 1.0)]),
        "b": reference_forward(files["base"], [(files["pairs"], 0.5)]),
        "ab": reference_forward(files["base"], [(files["full"], 1.0), (files["pairs"], 0.5)]),
    }
    handles = {"base": base, "a": a, "b": b, "ab": ab}
    for name in ["a", "a", "base", "b", "ab", "a", "base", "ab", "b", "base"]:
        assert relative(forward(handles[name]), expected[name]) < 1e-5, name
    assert tensor_bytes(base.model) == bytes_before  # back on the base: nothing added or copied


def test_strength_changes_of_unmerged_loras_read_no_weights(files, monkeypatch):
    reads, factor_reads = [], []
    real = reload_module.reload_tensors
    monkeypatch.setattr(lora_apply, "reload_tensors",
                        lambda *a, **k: (reads.append(sorted(a[3])), real(*a, **k)))
    real_tensor = lora_apply.LoraFile.tensor
    monkeypatch.setattr(lora_apply.LoraFile, "tensor",
                        lambda self, key: (factor_reads.append(key), real_tensor(self, key))[1])
    base = load_model(files["base"], "fp32", "sdpa")
    handles = [with_lora(base, files["pairs"], s, "unmerged") for s in (1.0, 0.3, -0.6)]
    for handle in handles:
        expected = reference_forward(files["base"], [(files["pairs"], handle.loras[0].strength)])
        factor_reads.clear()
        assert relative(forward(handle), expected) < 1e-5
        assert len(factor_reads) == (40 if handle is handles[0] else 0)  # the LoRA read once
    assert reads == []
    merged = with_lora(base, files["pairs"], 0.3, "merge")
    forward(merged)
    assert reads == [sorted(k for k in SHAPES if k.endswith(".weight")
                            and dit_module.is_block_linear(k))]  # the 20 matrices it changes


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16", "int8", "fp8_e4m3fn"])
def test_taking_the_loras_out_restores_every_weight_exactly(files, weight_dtype):
    base = load_model(files["base"], weight_dtype, "sdpa")
    saved = snapshot(base.model)
    handle = with_lora(with_lora(base, files["full"], 1.0, "merge"), files["pairs"], 0.5,
                       "unmerged")
    forward(handle)
    assert not same_state(handle.model, saved)
    forward(base)
    assert same_state(base.model, saved) and not wrappers(base.model)


# -- quantized weights -------------------------------------------------------------------------

@pytest.mark.parametrize("weight_dtype, fmt", [("int8", INT8), ("fp8_e4m3fn", FP8)])
@pytest.mark.parametrize("file", ["base", "fp8"])
def test_merge_happens_before_quantization(files, weight_dtype, fmt, file):
    """The quantized codes are those of the float32 merged weight (an fp8 file is dequantized
    with its scales, merged and quantized again)."""
    handle = with_lora(load_model(files[file], weight_dtype, "sdpa"), files["full"], 0.9)
    forward(handle)
    merged = reference(files[file], [(files["full"], 0.9)]).state_dict()
    layer = handle.model.blocks[0].self_attn.o
    codes, scales = quantize_weight(merged["blocks.0.self_attn.o.weight"], fmt)
    assert torch.equal(layer.weight, codes) and torch.equal(layer.weight_scale, scales)


def test_unmerged_on_an_fp8_file_keeps_its_codes(files):
    handle = with_lora(load_model(files["fp8"], "fp8_e4m3fn", "sdpa"), files["pairs"], 1.0,
                       "unmerged")
    out = forward(handle)
    with open_checkpoint(files["fp8"]) as source:
        stored = source.read("model.diffusion_model.blocks.1.ffn.2.weight")
    assert torch.equal(handle.model.blocks[1].ffn[2].base.weight, stored)
    expected = reference_forward(files["fp8"], [(files["pairs"], 1.0)])  # float32, dequantized
    base_out = reference_forward(files["fp8"], [])
    assert relative(out, expected) < 0.02 < relative(base_out, expected)  # bf16 compute


@pytest.mark.skipif(not has_cpu_kernel("_scaled_mm"), reason="no row-wise torch._scaled_mm on this CPU")
def test_wrapped_fp8_feed_forward_keeps_the_fused_path(files, monkeypatch):
    """fp8 matmuls (fp8_e4m3fn_fast, run through torch._scaled_mm's CPU kernel here): the
    wrapped feed-forward still takes the fused GELU-quantize step of the base layer, adds the
    LoRA terms, and gives the merged model's output to fp8 rounding."""
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    monkeypatch.setattr(loading, "fp8_matmul_unavailable", lambda device: None)
    fused = []
    real = quant_linear.gelu_quantize
    monkeypatch.setattr(quant_linear, "gelu_quantize",
                        lambda *a, **k: (fused.append(1), real(*a, **k))[1])
    base = load_model(files["base"], "fp8_e4m3fn_fast", "sdpa")
    unmerged = with_lora(base, files["full"], 0.8, "unmerged")
    merged = with_lora(base, files["full"], 0.8, "merge")
    out_unmerged = forward(unmerged)
    assert len(fused) == CONFIG.num_layers  # one fused step per block's feed-forward
    assert isinstance(unmerged.model.blocks[0].ffn[2], LoraFp8Linear)
    # the same feed-forward computed step by step (no fused step) from the same layers
    first, _, second = unmerged.model.blocks[1].ffn
    h = torch.randn(1, 5, CONFIG.dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    fast = dit_ffn.feed_forward(unmerged.model.blocks[1].ffn, h)
    slow = second(F.gelu(first(h), approximate="tanh"))
    # both lie about 0.04 from the dense bf16 product (their fp8 activations); they differ by
    # the fp8 rounding of the GELU's input, which the step-by-step path takes in bf16
    assert relative(fast, slow) < 0.03
    out_merged = forward(merged)
    expected = reference_forward(files["base"], [(files["full"], 0.8)])
    assert relative(out_unmerged, expected) < 0.05 and relative(out_merged, expected) < 0.05
    assert relative(out_unmerged, out_merged) < 0.05 < relative(forward(base), expected)


# -- block swap --------------------------------------------------------------------------------

def test_block_swap_streams_the_factors_with_their_block(files):
    base = load_model(files["base"], "bf16", "sdpa")
    handle = with_lora(base, files["full"], 0.6, "unmerged")
    resident = forward(handle)
    packed = {}

    def keep(dit):
        for pack in dit.engine.packs:
            packed.update({id(t): pack.buffer for t in pack.tensors})

    swapped = forward(handle, block_swap=2, keep=keep)
    assert torch.equal(swapped, resident)
    factors = [t for w in wrappers(handle.model).values() for _, ts in w.terms() for t in ts]
    assert factors and all(id(t) in packed for t in factors)  # in their block's buffer
    forward(base)  # the wrappers go: their factors leave the block buffers
    buffers = {b.untyped_storage().data_ptr() for b in packed.values()}
    assert all(t.untyped_storage().data_ptr() not in buffers for t in factors)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in factors)
    again = forward(handle, block_swap=1)
    assert torch.equal(again, resident)


# -- bad input and failures -----------------------------------------------------------------

def test_a_lora_that_does_not_fit_leaves_the_base_as_it_was(files, tmp_path):
    from dataclasses import replace
    base = load_model(files["base"], "fp32", "sdpa")
    saved = snapshot(base.model)
    other = write_lora(tmp_path / "14b.safetensors",
                       random_lora(replace(CONFIG, dim=384, num_heads=3)), "kohya")
    with pytest.raises(LoraError, match="14b.safetensors: 'lora_unet_blocks_0_cross_attn_k"):
        with_lora(base, other, 1.0)
    assert base.loras == () and same_state(base.model, saved)


def test_a_lora_file_gone_before_the_run_changes_nothing(files, tmp_path):
    base = load_model(files["base"], "fp32", "sdpa")
    saved = snapshot(base.model)
    path = tmp_path / "gone.safetensors"
    path.write_bytes(files["full"].read_bytes())
    handle = with_lora(base, path, 1.0, "unmerged")
    path.unlink()
    with pytest.raises(CheckpointError, match="gone.safetensors: no such file"):
        forward(handle)
    assert same_state(base.model, saved) and not wrappers(base.model)


def test_a_rewrite_failing_half_way_is_completed_next_time(files, monkeypatch):
    base = load_model(files["base"], "fp32", "sdpa")
    saved = snapshot(base.model)
    handle = with_lora(base, files["full"], 1.0, "merge")
    real, calls = SafetensorsSource.read, []

    def failing(self, key):
        if self.path == files["base"]:
            calls.append(key)
            if len(calls) == 12:
                raise CheckpointError("disk went away")
        return real(self, key)

    monkeypatch.setattr(SafetensorsSource, "read", failing)
    with pytest.raises(CheckpointError, match="disk went away"):
        forward(handle)
    monkeypatch.setattr(SafetensorsSource, "read", real)
    forward(base)
    assert same_state(base.model, saved)
    assert torch.equal(forward(handle), reference_forward(files["base"], [(files["full"], 1.0)]))


def test_merging_holds_one_float32_matrix_at_a_time(files, monkeypatch):
    """Each merged weight's float32 copy is gone before the next tensor is read: merging adds
    one float32 matrix in transit, never a second copy of the model."""
    copies: list[weakref.ref] = []
    alive_at_read: list[int] = []
    real_apply, real_read = Merge.apply_, SafetensorsSource.read

    def apply_(self, key, weight):
        copies.append(weakref.ref(weight))
        return real_apply(self, key, weight)

    def read(self, key):
        if self.path == files["base"]:  # (the LoRA's own tensors are read while merging)
            alive_at_read.append(sum(ref() is not None for ref in copies))
        return real_read(self, key)

    monkeypatch.setattr(Merge, "apply_", apply_)
    monkeypatch.setattr(SafetensorsSource, "read", read)
    for weight_dtype in ("bf16", "int8"):
        forward(with_lora(load_model(files["base"], weight_dtype, "sdpa"), files["full"], 1.0))
    assert len(copies) == 2 * (len(FULL_PAIRS) + len(DIFFS)) and max(alive_at_read) == 0
    assert len(alive_at_read) >= len(copies)


def test_chain_choices_are_checked(files):
    base = load_model(files["base"], "fp32", "sdpa")
    assert with_lora(base, files["full"], 0.0) is base  # strength 0: skipped
    once = with_lora(base, files["full"], 0.5)
    with pytest.raises(InputError, match="full.safetensors is already applied to this model at "
                                         "strength 0.5"):
        with_lora(once, files["full"], 1.0, "unmerged")
    with pytest.raises(InputError, match="strength: nan is not a finite number"):
        with_lora(base, files["full"], float("nan"))
    with pytest.raises(InputError, match=r"mode: 'lazy' is not one of \['merge', 'unmerged'\]"):
        with_lora(base, files["full"], 1.0, "lazy")
    with pytest.raises(InputError, match="model: expected a WANMODEL"):
        with_lora("not a model", files["full"], 1.0)


@pytest.mark.skipif(not (__import__("shutil").which("c++") or __import__("shutil").which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_follow_unmerged_strength_changes(files):
    """The wrappers compile with the blocks; a new strength is honoured (the scales are not
    frozen into the compiled graph)."""
    from dataclasses import replace
    base = load_model(files["base"], "fp32", "sdpa")
    x, t, context = inputs()
    for strength in (0.8, -0.3):
        handle = replace(with_lora(base, files["full"], strength, "unmerged"), compile=True)
        with DevicePlacement("cpu") as placement, DiTPlacement(placement) as dit:
            dit.place(handle)
            out = handle.model(x, t, context, compiled=True)
        expected = reference_forward(files["base"], [(files["full"], strength)])
        assert relative(out, expected) < 1e-5, strength
    torch._dynamo.reset()
