"""Weight quantization of the DiT's block matrices (quant/): the number formats, each layer
against its reference computation, the CPU stand-ins of the GPU kernels, a quantized DiT
against float32, quantize-on-load (pre-quantized files kept as stored, one matrix in memory at a
time), the state contract of the block swap engine, torch.compile, and clear errors."""

import gc
import json
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from cpu_kernels import has_cpu_kernel

from wan_enhanced.checkpoints import tiny
from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.reader import CheckpointError, SafetensorsSource
from wan_enhanced.nodes.loaders import WanModelLoader, _main_dtype
from wan_enhanced.pipeline.loading import DTYPES, MODEL_DTYPES, load_model
from wan_enhanced.pipeline.placement import tensor_bytes
from wan_enhanced.quant import (SCHEMES, Fp8Linear, Int8Linear, QuantizedLinear,
                                block_linear_names, quantize_block_linears, quantized_layers)
from wan_enhanced import gpu_support
from wan_enhanced.quant import kernels
from wan_enhanced.quant import linear as quant_linear
from wan_enhanced.quant.rowwise import FP8, INT8, dequantize_weight, quantize_rows, quantize_weight
from wan_enhanced.wan.dit import WanDiT, is_block_linear, keeps_float32

CONFIG = tiny.TINY_DIT["t2v"]
FP8_MAX = 448.0
BF16_ULP = 2.0 ** -8  # bf16 keeps 8 significant bits: a rounding moves a value by < 2^-8 of it

# Max relative difference (max |out - ref| / max |ref|) of the tiny DiT's output from its
# float32 forward, seed 0. Measured: bf16 2.5e-3; fp8_e4m3fn 9.8e-3 (the fast path through
# torch._scaled_mm, activations in fp8 too, 1.3e-2); int8 3.5e-3; int8_dynamic 4.5e-3 (seeds 0-3
# within 25% of these). e4m3 keeps 3 mantissa bits (a weight moves by up to 2^-4 of itself),
# int8 spends 254 steps on each row's range: fp8 is several times coarser than int8, which is
# close to bf16's own rounding. The bounds leave about 2.5x headroom over the measurements.
DIT_BOUNDS = {"bf16": 5e-3, "fp8_e4m3fn": 2.5e-2, "fp8_e4m3fn_fast": 2.5e-2,
              "fp8_e4m3fn_fast scaled_mm": 3.5e-2, "int8": 1e-2, "int8_dynamic": 1.2e-2}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own 'once' for the fallback warnings."""
    monkeypatch.setattr(gpu_support, "_WARNED", set())


def spread_matrix(rows=96, cols=160, seed=0) -> torch.Tensor:
    """Random rows whose magnitudes span six orders, plus an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    weight[5] = 0
    return weight


def random_linear(in_features=96, out_features=80, seed=0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features)
    layer.bias.data.mul_(4)  # visible next to the products
    return layer


def activations(*shape, seed=1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).abs().max() / ref.abs().max())


# -- number formats ------------------------------------------------------------------------

def test_fp8_weight_round_trip_error_bound():
    weight = spread_matrix()
    codes, scales = quantize_weight(weight, FP8)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (weight.shape[0],)
    nonzero = weight.abs().amax(1) > 0
    assert torch.allclose(scales[nonzero], weight.abs().amax(1)[nonzero] / FP8_MAX, rtol=1e-6)
    back = dequantize_weight(codes, scales, torch.float32)
    assert torch.isfinite(back).all() and torch.equal(back[5], torch.zeros_like(back[5]))
    # e4m3: 3 mantissa bits, so a normal value moves by at most 2^-4 of itself; below the
    # smallest normal (2^-6 in code units) the step is 2^-9, so at most 2^-10 of the scale
    bound = torch.maximum(weight.abs() * 2 ** -4, scales[:, None] * 2 ** -10)
    assert ((back - weight).abs() <= bound * (1 + 1e-6)).all()
    # every row reaches the top of the range
    assert torch.equal(codes[nonzero].float().abs().amax(1), torch.full((95,), FP8_MAX))


def test_int8_weight_round_trip_error_bound():
    weight = spread_matrix()
    codes, scales = quantize_weight(weight, INT8)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    back = dequantize_weight(codes, scales, torch.float32)
    assert torch.equal(back[5], torch.zeros_like(back[5]))
    # rounding to the nearest of 255 evenly spaced codes: at most half a step
    assert ((back - weight).abs() <= scales[:, None] * 0.5 * (1 + 1e-6)).all()
    assert relative(back, weight) < 1 / 254 + 1e-6


def test_chunked_quantization_equals_whole_matrix(monkeypatch):
    weight = spread_matrix()
    whole = quantize_weight(weight, INT8)
    monkeypatch.setattr("wan_enhanced.quant.rowwise._LOAD_CHUNK_ELEMENTS", 7 * 160)
    chunked = quantize_weight(weight, INT8)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def reference_quantize(weight, fmt, stored_scales=None):
    """Whole-matrix per-row quantization written out plainly."""
    rows = weight.float()
    if stored_scales is not None:
        rows = rows * stored_scales[:, None]
    amax = rows.abs().amax(dim=1, keepdim=True)
    scales = (amax / fmt.max_code).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = rows / scales
    if fmt.rounds:
        scaled = scaled.round()
    return scaled.clamp(-fmt.max_code, fmt.max_code).to(fmt.dtype), scales[:, 0]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


@pytest.mark.parametrize("fmt", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 10])
def test_chunked_quantization_equals_reference_bit_for_bit(fmt, chunk_rows, monkeypatch):
    """Odd shapes, chunks that leave a remainder, bf16 and float32 inputs, with and without a
    file's scales: the same codes and scales as the whole-matrix computation."""
    gen = torch.Generator().manual_seed(3)
    for rows, cols in [(1, 1), (2, 3), (31, 7), (97, 161), (130, 517)]:
        if chunk_rows is not None:
            monkeypatch.setattr("wan_enhanced.quant.rowwise._LOAD_CHUNK_ELEMENTS",
                                chunk_rows * cols + cols // 2)
        weight = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
        weight[rows // 2] = 0
        stored = torch.rand(rows, generator=gen) * 4 + 0.01
        for dtype in (torch.float32, torch.bfloat16):
            for stored_scales in (None, stored):
                codes, scales = quantize_weight(weight.to(dtype), fmt, stored_scales)
                ref_codes, ref_scales = reference_quantize(weight.to(dtype), fmt, stored_scales)
                assert same_bits(codes, ref_codes), (rows, cols, dtype)
                assert same_bits(scales, ref_scales), (rows, cols, dtype)


def test_quantization_reuses_one_working_copy(monkeypatch):
    """The float32 working copy is allocated once per matrix, not once per chunk: freeing a
    chunk-size buffer after every chunk leaves the C heap fragmented after a load."""
    from torch.profiler import ProfilerActivity, profile

    rows, cols, chunk_rows = 96, 160, 8
    monkeypatch.setattr("wan_enhanced.quant.rowwise._LOAD_CHUNK_ELEMENTS", chunk_rows * cols)
    weight = spread_matrix(rows, cols).bfloat16()
    for fmt in (FP8, INT8):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            quantize_weight(weight, fmt, torch.ones(rows))  # the codes are freed at once
        sizes = [abs(e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]"]
        assert rows * cols in sizes  # the profiler sees the codes tensor
        # at most one allocation and its release (on the CPU it is mapped, not allocated)
        assert sizes.count(chunk_rows * cols * 4) <= 2


def test_empty_quantized_layers_on_meta_import_no_compiler():
    """Building the meta model's quantized layers quantizes nothing, so torch does not import
    its Python meta kernels (torch._dynamo, sympy: about 70 MiB per process)."""
    import subprocess

    code = ("import sys, torch\n"
            "import wan_enhanced.pipeline.loading\n"
            "from wan_enhanced.checkpoints import tiny\n"
            "from wan_enhanced.quant import quantize_block_linears, quantized_layers\n"
            "from wan_enhanced.wan.dit import WanDiT\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "for name, dtype in (('fp8_e4m3fn', torch.float8_e4m3fn), ('int8', torch.int8)):\n"
            "    with torch.device('meta'):\n"
            "        model = quantize_block_linears(WanDiT(tiny.TINY_DIT['t2v']), name)\n"
            "    layer = next(iter(quantized_layers(model).values()))\n"
            "    assert layer.weight.is_meta and layer.weight.dtype == dtype\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "int8_dynamic"])
def test_meta_layer_state_has_the_layer_shapes_and_dtypes(name):
    with torch.device("meta"):
        linear = torch.nn.Linear(96, 80)
    layer = SCHEMES[name].quantize(linear)
    expected = {"weight": (SCHEMES[name].storage_dtype, (80, 96)),
                "weight_scale": (torch.float32, (80,)), "bias": (torch.bfloat16, (80,))}
    assert {k: (v.dtype, tuple(v.shape)) for k, v in layer.named_parameters()} == expected
    assert all(v.is_meta and not v.requires_grad for v in layer.parameters())


def test_activation_scales_are_per_token():
    x = activations(3, 5, 64)
    x[1, 2] = 0
    codes, scales = quantize_rows(x, INT8)
    assert codes.shape == x.shape and scales.shape == (3, 5, 1)
    assert torch.equal(codes[1, 2], torch.zeros(64, dtype=torch.int8))
    assert torch.allclose(scales[0, 0, 0], x[0, 0].float().abs().max() / 127)


# -- each layer against its reference ------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8_e4m3fn", "int8"])
def test_weight_only_layers_equal_dequantized_matmul(name):
    layer = random_linear()
    quantized = SCHEMES[name].quantize(layer)
    x = activations(2, 7, 96)
    out = quantized(x)
    assert out.shape == (2, 7, 80) and out.dtype == torch.bfloat16
    # the reference: the dequantized weight (rounded to bf16, the compute dtype) times the input
    weight = quantized.dequantized_weight(torch.bfloat16).double()
    ref = x.double() @ weight.t() + quantized.bias.double()
    assert ((out.double() - ref).abs() <= BF16_ULP * ref.abs() + 1e-3).all()
    # and the quantized weight is the float one within the format's rounding
    assert relative(quantized.dequantized_weight(), layer.weight) < 2 ** -4


def test_int8_dynamic_layer_equals_integer_reference():
    layer = random_linear()
    quantized = SCHEMES["int8_dynamic"].quantize(layer)
    x = activations(2, 7, 96)
    out = quantized(x)
    codes, x_scales = quantize_rows(x.reshape(-1, 96), INT8)
    integers = codes.double() @ quantized.weight.double().t()  # exact
    ref = (integers * x_scales.double() * quantized.weight_scale.double()
           + quantized.bias.double()).view(2, 7, 80)
    assert ((out.double() - ref).abs() <= BF16_ULP * ref.abs() + 1e-3).all()
    # W8A8 stays close to the float layer: activations and weights each round by < 1/254
    assert relative(out, F.linear(x.float(), layer.weight, layer.bias)) < 0.02


def test_integer_product_is_exact_on_every_path():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (80, 4096), generator=gen, dtype=torch.int8)
    for rows in (5, 40):  # under and over torch._int_mm's 17-row minimum
        codes = torch.randint(-127, 128, (rows, 4096), generator=gen, dtype=torch.int8)
        exact = codes.long() @ weight.long().t()
        # float64 holds every partial sum exactly; float32 rounds the result once, as the
        # int32 -> float32 conversion after torch._int_mm does
        assert torch.equal(kernels.exact_int8_product(codes, weight), exact.float())
        assert torch.equal(kernels.int8_matmul(codes, weight), exact.float())
        if has_cpu_kernel("_int_mm"):  # torch._int_mm with the CUDA path's row padding
            assert torch.equal(kernels.int_mm_padded(codes, weight), exact.float())


@pytest.mark.skipif(not has_cpu_kernel("_scaled_mm"), reason="no torch._scaled_mm on this CPU")
def test_fp8_scaled_matmul_equals_its_reference(monkeypatch):
    """The GPU path, run through torch._scaled_mm's CPU kernel: per-token fp8 activations times
    the fp8 weight, leading dimensions and bias handled."""
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    quantized = SCHEMES["fp8_e4m3fn_fast"].quantize(random_linear())
    x = activations(3, 5, 96)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = quantized(x)
    codes, scales = quantize_rows(x.reshape(-1, 96), FP8)
    ref = ((codes.double() * scales.double()) @ quantized.dequantized_weight().double().t()
           + quantized.bias.double()).view(3, 5, 80)
    # the bias added in the kernel, before its one rounding to bf16
    assert ((out.double() - ref).abs() <= BF16_ULP * ref.abs() + 1e-3).all()
    assert relative(out, quantized.dequantized_forward(x)) < 0.05  # activations in fp8 too


def test_fast_fp8_falls_back_to_dequantize_once_with_a_warning():
    quantized = SCHEMES["fp8_e4m3fn_fast"].quantize(random_linear())
    x = activations(4, 96)
    with pytest.warns(RuntimeWarning, match=r"fp8_e4m3fn_fast: fp8 matmul needs a CUDA GPU"):
        out = quantized(x)
    assert torch.equal(out, quantized.dequantized_forward(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call is silent
        assert torch.equal(quantized(x), out)


def test_fast_fp8_falls_back_for_widths_not_multiple_of_16(monkeypatch):
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    quantized = SCHEMES["fp8_e4m3fn_fast"].quantize(random_linear(40, 24))
    x = activations(2, 3, 40)
    with pytest.warns(RuntimeWarning, match=r"multiples of 16; this layer is 40 -> 24"):
        out = quantized(x)
    assert torch.equal(out, quantized.dequantized_forward(x))
    assert kernels.fp8_shape_unsupported(96, 80) is None
    assert kernels.int8_kernel_unsupported(96, 80) is None
    assert "multiples of 8" in kernels.int8_kernel_unsupported(36, 80)


def test_layers_compile_into_one_graph():
    """fullgraph=True fails on any graph break: forward branches on devices, shapes and flags
    only (the fallback warning stays out of the trace)."""
    x = activations(2, 7, 96)
    for name, chosen in SCHEMES.items():
        quantized = chosen.quantize(random_linear())
        compiled = torch.compile(quantized, backend="aot_eager", fullgraph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fast path's CPU fallback
            assert torch.equal(compiled(x), quantized(x)), name
    torch._dynamo.reset()


# -- a quantized DiT -----------------------------------------------------------------------

def tiny_model(state, dtype) -> WanDiT:
    with torch.device("meta"):
        model = WanDiT(CONFIG, dtype)
    model.load_state_dict({k: v.float() if keeps_float32(k) else v.to(dtype)
                           for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def dit_inputs(seed=10):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 16, 3, 8, 8, generator=gen), torch.tensor([700.0]),
            torch.randn(1, 20, CONFIG.text_dim, generator=gen))


@pytest.fixture(scope="module")
def dit_reference():
    state = tiny.random_dit_state(CONFIG, seed=0)
    with torch.inference_mode():
        return state, tiny_model(state, torch.float32)(*dit_inputs())


def test_quantize_block_linears_swaps_exactly_the_block_matrices(dit_reference):
    state, _ = dit_reference
    model = tiny_model(state, torch.bfloat16)
    names = block_linear_names(model)
    assert len(names) == CONFIG.num_layers * 10  # q k v o twice, ffn.0, ffn.2
    quantize_block_linears(model, "int8")
    assert set(quantized_layers(model)) == set(names)
    assert model.compute_dtype == torch.bfloat16
    for key, tensor in model.state_dict().items():
        if is_block_linear(key) and key.endswith(".weight"):
            assert tensor.dtype == torch.int8, key
        elif key.endswith("weight_scale"):
            assert tensor.dtype == torch.float32, key
        else:  # embeddings, norms, modulation, head: as they were
            assert tensor.dtype == (torch.float32 if keeps_float32(key) else torch.bfloat16), key


@pytest.mark.parametrize("name", ["bf16", *SCHEMES, "fp8_e4m3fn_fast scaled_mm"])
def test_quantized_dit_stays_close_to_float32(dit_reference, name, monkeypatch):
    state, reference = dit_reference
    model = tiny_model(state, torch.bfloat16)
    if name != "bf16":
        if name.endswith("scaled_mm"):
            if not has_cpu_kernel("_scaled_mm"):
                pytest.skip("no torch._scaled_mm on this CPU")
            monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
        quantize_block_linears(model, name.split()[0])
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback of the fast path
        out = model(*dit_inputs())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert relative(out, reference) < DIT_BOUNDS[name]


def test_quantized_blocks_survive_data_swapping(dit_reference):
    """The contract of block swap and device placement: every tensor's .data replaced by a
    fresh copy (or a view into one flat buffer) and the forward is unchanged, bit for bit."""
    state, _ = dit_reference
    for name in SCHEMES:
        model = quantize_block_linears(tiny_model(state, torch.bfloat16), name)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            expected = model(*dit_inputs())
            tensors = [*model.parameters(), *model.buffers()]
            assert all(type(t) is torch.nn.Parameter and not t.requires_grad for t in tensors)
            assert all(type(t.data) is torch.Tensor for t in tensors)  # no tensor subclasses
            for tensor in tensors:
                tensor.data = tensor.data.clone()
            assert torch.equal(model(*dit_inputs()), expected), name
            # one uint8 buffer for all, each tensor a view of its bytes (as the engine packs)
            sizes = [t.numel() * t.element_size() for t in tensors]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            offset = 0
            for tensor, size in zip(tensors, sizes):
                view = buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.data)
                tensor.data = view
                offset += size
            assert torch.equal(model(*dit_inputs()), expected), name


def test_quantized_blocks_stream_through_the_block_swap_engine(dit_reference):
    from wan_enhanced.offload.block_swap import BlockSwap

    state, _ = dit_reference
    model = quantize_block_linears(tiny_model(state, torch.bfloat16), "int8_dynamic")
    with torch.inference_mode():
        expected = model(*dit_inputs())
        with BlockSwap(model.blocks, range(CONFIG.num_layers), "cpu", slots=1) as swap:
            swapped = model(*dit_inputs(), blocks=swap.blocks())
    assert torch.equal(swapped, expected)


# -- quantize on load ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant")
    return tiny.write_dit(folder / "dit.safetensors", CONFIG, "comfy", seed=0)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_each_weight_dtype_loads_and_runs(bf16_file, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        handle = load_model(bf16_file, name)
        bf16 = load_model(bf16_file, "bf16")
        with torch.inference_mode():
            out = handle.model(*dit_inputs())
            ref = bf16.model(*dit_inputs())
    model = handle.model
    assert handle.quantization == name and handle.info.quantization == name
    assert "20 block matrices quantized on load" in handle.info.quantization_detail
    assert bf16.quantization is None
    assert model.compute_dtype == torch.bfloat16
    layer = model.blocks[1].cross_attn.o
    assert type(layer) is SCHEMES[name].layer and layer.weight.dtype == SCHEMES[name].storage_dtype
    assert model.blocks[0].ffn[2].bias.dtype == torch.bfloat16
    assert model.text_embedding[0].weight.dtype == torch.bfloat16
    assert model.blocks[0].norm3.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert _main_dtype(model) == str(SCHEMES[name].storage_dtype).removeprefix("torch.")
    block_bytes = sum(tensor_bytes(b) for b in model.blocks)
    assert block_bytes < 0.6 * sum(tensor_bytes(b) for b in bf16.model.blocks)
    assert torch.isfinite(out).all()
    assert relative(out, ref) < DIT_BOUNDS[name]


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("layout", ["comfy_fp8", "comfy_fp8_e4m3fn"])
@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_e4m3fn_fast"])
def test_fp8_files_load_as_stored(tmp_path, layout, name):
    """fp8 weights (ComfyUI's scaled fp8 with per-tensor scale_weight; plain e4m3fn without
    scales) are taken bit for bit, with the file's scale, and compute exactly what the
    dequantizing bf16 load computes."""
    path = tiny.write_dit(tmp_path / "fp8.safetensors", CONFIG, layout, seed=2,
                          dtype=torch.float32)
    stored = file_tensors(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model, info = load_dit(path, torch.bfloat16, quantization=name)
    dequantized, _ = load_dit(path, torch.bfloat16)
    assert "20 block matrices kept as stored" in info.quantization_detail
    assert "quantized on load" not in info.quantization_detail
    for key, tensor in model.state_dict().items():
        if is_block_linear(key) and key.endswith(".weight"):
            file_key = "model.diffusion_model." + key
            assert torch.equal(tensor.view(torch.uint8), stored[file_key].view(torch.uint8)), key
            scale_key = file_key[:-len("weight")] + "scale_weight"
            expected = stored[scale_key].float() if scale_key in stored else torch.tensor(1.0)
            scales = model.get_parameter(key[:-len("weight")] + "weight_scale")
            assert torch.equal(scales, expected.expand(tensor.shape[0])), key
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert torch.equal(model(*dit_inputs()), dequantized(*dit_inputs()))


def test_fp8_file_to_int8_is_requantized(tmp_path):
    path = tiny.write_dit(tmp_path / "fp8.safetensors", CONFIG, "comfy_fp8", seed=2,
                          dtype=torch.float32)
    model, info = load_dit(path, torch.bfloat16, quantization="int8_dynamic")
    dequantized, _ = load_dit(path, torch.float32)
    assert info.quantization_detail == ("int8_dynamic: 20 block matrices quantized on load "
                                        "(per-output-channel scales)")
    layer = model.blocks[0].self_attn.q
    reference = dequantized.blocks[0].self_attn.q.weight
    assert relative(layer.dequantized_weight(), reference) < 1 / 254 + 1e-6


def test_quantize_on_load_holds_one_full_precision_matrix_at_a_time(bf16_file, monkeypatch):
    """Every block matrix the file hands out in bf16 is gone before the next tensor is read:
    the loader never keeps the model in full precision beside its quantized copy (the
    transient is one matrix, plus one float32 chunk of at most 4M elements while it is
    quantized). Keeping them, e.g. quantizing after a bf16 load, fails here."""
    real_read = SafetensorsSource.read
    handed_out: list[weakref.ref] = []
    alive_at_read: list[int] = []

    def tracking_read(self, key):
        alive_at_read.append(sum(ref() is not None for ref in handed_out))
        tensor = real_read(self, key)
        if is_block_linear(key.removeprefix("model.diffusion_model.")) and key.endswith("weight"):
            assert tensor.dtype == torch.bfloat16
            handed_out.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(SafetensorsSource, "read", tracking_read)
    model, _ = load_dit(bf16_file, torch.bfloat16, quantization="int8")
    assert len(handed_out) == 20 and max(alive_at_read) == 0
    assert all(ref() is None for ref in handed_out)
    block_elements = sum(layer.weight.numel() for layer in quantized_layers(model).values())
    assert sum(tensor_bytes(b) for b in model.blocks) < 1.1 * block_elements  # int8 codes


def test_failed_quantized_load_leaves_no_tensor_behind(bf16_file, monkeypatch):
    real_read = SafetensorsSource.read
    calls = []

    def failing_read(self, key):
        calls.append(key)
        if len(calls) == 25:
            raise CheckpointError("disk went away")
        return real_read(self, key)

    def big_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects()
                   if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type != "meta"
                   and o.numel() >= CONFIG.dim * CONFIG.dim)

    before = big_tensors()
    monkeypatch.setattr(SafetensorsSource, "read", failing_read)
    with pytest.raises(CheckpointError, match="disk went away"):
        load_dit(bf16_file, torch.bfloat16, quantization="fp8_e4m3fn")
    assert big_tensors() == before


# -- choices and errors --------------------------------------------------------------------

def test_loader_choices_keep_the_old_values_first():
    assert MODEL_DTYPES[:3] == ["bf16", "fp16", "fp32"] == list(DTYPES)
    assert MODEL_DTYPES[3:] == ["fp8_e4m3fn", "fp8_e4m3fn_fast", "int8", "int8_dynamic", "auto"]
    choices, options = WanModelLoader.INPUT_TYPES()["required"]["weight_dtype"]
    assert choices == MODEL_DTYPES and options["default"] == "auto"


def test_unknown_weight_dtype_is_refused_clearly(bf16_file):
    with pytest.raises(CheckpointError, match=r"weight_dtype: 'fp4' is not one of \['bf16'"):
        load_model(bf16_file, "fp4")
    with pytest.raises(CheckpointError, match=r"quantization 'nf4' is not one of"):
        load_dit(bf16_file, quantization="nf4")
    with pytest.raises(ValueError, match=r"quantization 'int4' is not one of"):
        quantize_block_linears(torch.nn.Module(), "int4")


def test_scale_of_the_wrong_size_names_file_and_key(tmp_path):
    path = tiny.write_dit(tmp_path / "fp8.safetensors", CONFIG, "comfy_fp8", dtype=torch.float32)
    state = file_tensors(path)
    key = "model.diffusion_model.blocks.1.ffn.0.scale_weight"
    state[key] = torch.ones(3)
    from safetensors.torch import save_file
    save_file(state, str(path))
    for quantization in (None, "fp8_e4m3fn"):
        with pytest.raises(CheckpointError, match=rf"fp8.safetensors: {key} \(the scale of "
                           r".*3 scale values for 512 rows; expected 1 \(per tensor\) or 512"):
            load_dit(path, torch.bfloat16, quantization=quantization)


def test_layer_refuses_tensors_of_another_format():
    layer = Fp8Linear(96, 80, device="meta")
    with pytest.raises(ValueError, match=r"expected torch.float8_e4m3fn \[80, 96\]"):
        layer.assign(torch.zeros(80, 96, dtype=torch.int8), torch.ones(80), None)
    assert isinstance(Int8Linear(8, 8), QuantizedLinear)


# -- the GPU benchmark's CPU smoke test ----------------------------------------------------

def test_gpu_benchmark_quick_runs_on_the_cpu(tmp_path):
    from wan_enhanced.bench import quant_gpu
    code = quant_gpu.main(["--out", str(tmp_path), "--quick", "--repeats", "1",
                           "--case", "dit_1_3b", "--mode", "eager"])
    data = json.loads((tmp_path / "quant_gpu.json").read_text())
    assert code == 0
    assert [r["weights"] for r in data["rows"]] == ["bf16", *SCHEMES]
    for row in data["rows"]:
        assert row["run"]["error"] is None and row["time_ratio"] > 0
        assert row["max_rel_diff_to_bf16"] < 0.05, row["weights"]
    # (--quick keeps the released text width: the bf16 text embedding is most of the weights)
    assert data["rows"][1]["weight_bytes"] < data["rows"][0]["weight_bytes"]
    assert "| dit_1_3b | 832x480x81 | int8_dynamic | eager |" in (
        tmp_path / "quant_gpu.md").read_text()


# -- on a GPU (opt-in: --gpu) --------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_kernels_equal_their_references():
    """torch._int_mm (padded below 17 rows) is the exact integer product; where the GPU has
    fp8 matmul, the fast layer uses it (no fallback) and matches its reference, eager and
    compiled."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (80, 4096), generator=gen, dtype=torch.int8)
    for rows in (5, 40):
        codes = torch.randint(-127, 128, (rows, 4096), generator=gen, dtype=torch.int8)
        expected = kernels.exact_int8_product(codes, weight)
        assert torch.equal(kernels.int8_matmul(codes.cuda(), weight.cuda()).cpu(), expected)
    x = activations(3, 5, 96).cuda()
    dynamic = SCHEMES["int8_dynamic"].quantize(random_linear()).cuda()
    cpu = SCHEMES["int8_dynamic"].quantize(random_linear())
    assert relative(dynamic(x).cpu(), cpu(x.cpu())) < 2 * BF16_ULP
    if kernels.fp8_matmul_unavailable(torch.device("cuda")) is not None:
        pytest.skip("no fp8 matmul on this GPU")
    fast = SCHEMES["fp8_e4m3fn_fast"].quantize(random_linear()).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fast(x)
        compiled = torch.compile(fast, fullgraph=True)(x)
    codes, scales = quantize_rows(x.reshape(-1, 96), FP8)
    ref = ((codes.double() * scales.double()) @ fast.dequantized_weight().double().t()
           + fast.bias.double()).view(3, 5, 80)
    assert ((out.double() - ref).abs() <= 2 * BF16_ULP * ref.abs() + 1e-3).all()
    assert relative(compiled, out) < 2 * BF16_ULP
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_int8_epilogue_kernel_equals_the_statement_in_less_memory():
    """The int8 product's rescale in one Triton pass gives the statement's bits (row and column
    scales, bias, one rounding), with and without a bias, at sizes that are not multiples of its
    tiles; at a 4096 x 8192 product it holds the int32 products and the output only, where the
    statement also holds float32 copies of the product's size."""
    gen = torch.Generator().manual_seed(5)

    def statement(codes, scales, weight, weight_scale, bias):
        out = kernels.int8_matmul(codes, weight) * scales * weight_scale
        return (out if bias is None else out + bias.float()).to(torch.bfloat16)

    for rows, cols, width in ((5, 80, 96), (45, 80, 96), (300, 200, 4096)):  # 5: padded
        codes = torch.randint(-127, 128, (rows, width), generator=gen, dtype=torch.int8).cuda()
        weight = torch.randint(-127, 128, (cols, width), generator=gen, dtype=torch.int8).cuda()
        scales = (torch.rand(rows, 1, generator=gen) * 1e-3).cuda()
        weight_scale = (torch.rand(cols, generator=gen) * 1e-2).cuda()
        for bias in (None, torch.randn(cols, generator=gen).bfloat16().cuda()):
            out = kernels.int8_scaled_matmul(codes, scales, weight, weight_scale, bias,
                                             torch.bfloat16)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, cols)
            assert torch.equal(out, statement(codes, scales, weight, weight_scale, bias))

    rows, cols, width = 4096, 8192, 1024
    codes = torch.randint(-127, 128, (rows, width), dtype=torch.int8, device="cuda")
    weight = torch.randint(-127, 128, (cols, width), dtype=torch.int8, device="cuda")
    scales = torch.full((rows, 1), 1e-3, device="cuda")
    weight_scale = torch.full((cols,), 1e-2, device="cuda")
    product = rows * cols

    def peak(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    kernel_peak, out = peak(lambda: kernels.int8_scaled_matmul(
        codes, scales, weight, weight_scale, None, torch.bfloat16))
    statement_peak, expected = peak(lambda: statement(codes, scales, weight, weight_scale, None))
    assert torch.equal(out, expected)
    assert kernel_peak <= product * (4 + 2) + (1 << 20)  # int32 products + bf16 output
    assert statement_peak >= product * (4 + 4)  # int32 products and their float32 copy


@pytest.mark.skipif(not has_cpu_kernel("_scaled_mm"), reason="no torch._scaled_mm on this CPU")
def test_a_layer_after_an_opaque_operator_computes_what_it_computes_on_any_input(monkeypatch):
    """after_opaque(layer, x) is layer(x) in value: a plain layer, a dequantizing fp8 layer, an
    int8 one; and a fast fp8 layer (let to use the CPU's torch._scaled_mm here) multiplies the
    same per-token codes as its own forward, not the dequantized weight."""
    from wan_enhanced.wan.dit_attention import after_opaque
    x = activations(2, 7, 96)
    for layer in (random_linear().bfloat16(), SCHEMES["fp8_e4m3fn"].quantize(random_linear()),
                  SCHEMES["int8_dynamic"].quantize(random_linear())):
        assert torch.equal(after_opaque(layer, x), layer(x))
    fast = SCHEMES["fp8_e4m3fn_fast"].quantize(random_linear())
    monkeypatch.setattr(Fp8Linear, "_multiplies_codes", lambda self, x: True)
    out = after_opaque(fast, x)
    assert out.shape == (2, 7, 80) and out.dtype == torch.bfloat16
    assert torch.equal(out, fast.scaled_forward(x))
    assert not torch.equal(out, fast.dequantized_forward(x))


@pytest.mark.gpu
def test_gpu_fp8_layer_after_an_opaque_operator_keeps_its_row_kernel_when_compiled():
    """In a compiled graph an fp8 layer after an attention kernel quantizes its input with the row
    kernel (an operator of its own in the graph, not inductor's reduction), and gives the eager
    result to the bit (the same codes, the same product)."""
    if kernels.fp8_matmul_unavailable(torch.device("cuda")) is not None:
        pytest.skip("no fp8 matmul on this GPU")
    from wan_enhanced.wan.dit_attention import after_opaque
    layer = SCHEMES["fp8_e4m3fn_fast"].quantize(random_linear()).cuda()
    x = activations(3, 40, 96).cuda()
    eager = after_opaque(layer, x)
    targets = []

    def recording(graph, inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes)
        return graph

    torch._dynamo.reset()
    torch.compile(lambda t: after_opaque(layer, t), backend=recording, fullgraph=True)(x)
    assert any("fp8_rows" in target for target in targets), targets
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: after_opaque(layer, t), fullgraph=True)
    assert torch.equal(compiled(x), eager)
    torch._dynamo.reset()


# -- typed configurations --------------------------------------------------------------------

def test_typed_configurations_are_the_weight_dtype_choices():
    from wan_enhanced.quant import (Float8DynamicActivationFloat8WeightConfig,
                                    Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                    Int8WeightOnlyConfig)
    configs = [Float8WeightOnlyConfig(), Float8DynamicActivationFloat8WeightConfig(),
               Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()]
    assert {c.name: c for c in configs} == SCHEMES
    assert [c.low_precision_matmul for c in configs] == [False, True, False, True]
    slow = Float8DynamicActivationFloat8WeightConfig(fast_accum=False)
    layer = slow.quantize(torch.nn.Linear(32, 16))
    assert isinstance(layer, Fp8Linear) and layer.fast and not layer.fast_accum
    assert SCHEMES["fp8_e4m3fn_fast"].quantize(torch.nn.Linear(32, 16)).fast_accum


def test_a_filter_picks_the_layers_to_quantize():
    from wan_enhanced.checkpoints.tiny import TINY_DIT
    from wan_enhanced.quant import Int8WeightOnlyConfig, quantize_block_linears
    from wan_enhanced.wan.dit import WanDiT
    model = WanDiT(TINY_DIT["t2v"])
    before = model.blocks[0].self_attn.q.weight.detach().clone()
    quantize_block_linears(model, Int8WeightOnlyConfig(),
                           filter_fn=lambda m, name: isinstance(m, torch.nn.Linear)
                           and ".ffn." in f".{name}.")
    quantized = set(quantized_layers(model))
    assert quantized and all(".ffn." in f".{n}." for n in quantized)
    assert len(quantized) == 2 * len(model.blocks)
    assert type(model.blocks[0].self_attn.q) is torch.nn.Linear
    assert torch.equal(model.blocks[0].self_attn.q.weight, before)


def test_gpu_benchmark_refuses_torchao_rows_without_torchao(tmp_path, monkeypatch, capsys):
    """The torchao rows need torchao: asked for without it, the benchmark stops before any
    timing and says which rows and why."""
    from wan_enhanced.bench import quant_gpu
    monkeypatch.setattr(quant_gpu, "torchao_missing",
                        lambda: "torchao is not importable (no module); pip install torchao")
    with pytest.raises(SystemExit) as stop:
        quant_gpu.main(["--out", str(tmp_path), "--quick", "--scheme", "bf16",
                        "torchao_int8_dynamic"])
    assert stop.value.code == 2
    assert "--scheme torchao_int8_dynamic: torchao is not importable" in capsys.readouterr().err
    assert not (tmp_path / "quant_gpu.json").exists()


def test_gpu_benchmark_torchao_rows_follow_ours_on_the_cpu(tmp_path):
    """With torchao installed: its int8 dynamic scheme on the same block matrices runs after
    ours (whatever order was asked), and its row carries the time over ours and its distance
    from bf16, which is about ours (both round the same matrices to int8 per channel)."""
    pytest.importorskip("torchao.quantization")
    from wan_enhanced.bench import quant_gpu
    code = quant_gpu.main(["--out", str(tmp_path), "--quick", "--repeats", "1", "--case",
                           "dit_1_3b", "--mode", "eager", "--scheme", "torchao_int8_dynamic",
                           "bf16", "int8_dynamic"])
    data = json.loads((tmp_path / "quant_gpu.json").read_text())
    assert code == 0
    rows = {r["weights"]: r for r in data["rows"]}
    assert [r["weights"] for r in data["rows"]] == ["bf16", "int8_dynamic", "torchao_int8_dynamic"]
    theirs, ours = rows["torchao_int8_dynamic"], rows["int8_dynamic"]
    assert theirs["run"]["error"] is None and theirs["time_ratio_to_ours"] > 0
    assert ours["time_ratio_to_ours"] is None
    assert 0 < theirs["max_rel_diff_to_bf16"] < 3 * ours["max_rel_diff_to_bf16"]
    # the weights counted by what torchao's tensors hold (int8 codes and scales), not as bf16
    assert theirs["weight_bytes"] < rows["bf16"]["weight_bytes"]
    assert abs(theirs["weight_bytes"] - ours["weight_bytes"]) < 0.02 * ours["weight_bytes"]
    assert "| torchao_int8_dynamic | eager |" in (tmp_path / "quant_gpu.md").read_text()


@pytest.mark.parametrize("fmt", [FP8, INT8], ids=["fp8", "int8"])
def test_eager_rows_quantize_a_few_rows_at_a_time_with_the_same_bits(monkeypatch, fmt):
    """quantize_rows over many rows (an FFN's hidden activation) takes them a block at a time
    in eager runs, so its float32 temporaries stay small; each row is quantized on its own, so
    the codes and scales are those of all rows at once, for any leading shape."""
    from wan_enhanced.quant import rowwise
    x = activations(3, 37, 16) * torch.linspace(0.01, 40, 16).bfloat16()
    x[1, 5] = 0  # a zero row keeps the smallest scale
    whole_codes, whole_scales = quantize_rows(x, fmt)
    monkeypatch.setattr(rowwise, "_ROWS_CHUNK_ELEMENTS", 5 * 16 + 3)  # blocks of 5 rows
    codes, scales = quantize_rows(x, fmt)
    assert codes.shape == x.shape and scales.shape == (3, 37, 1)
    assert torch.equal(scales, whole_scales)
    assert torch.equal(codes.view(torch.uint8), whole_codes.view(torch.uint8))
    assert float(scales[1, 5]) == torch.finfo(torch.float32).tiny
