"""Norms read only by fp8 matmuls hand them their input codes (glue.norm_codes, rowwise.RowCodes):
the same numbers as the norm, then the layer's own quantization, to the bit."""

import warnings

import pytest
import torch

from cpu_kernels import has_cpu_kernel

from wan_enhanced.quant import SCHEMES, quantize_block_linears
from wan_enhanced.quant import linear as quant_linear
from wan_enhanced.quant.rowwise import FP8, RowCodes, quantize_rows
from wan_enhanced.wan import chunks, dit, dit_block, dit_ffn, glue
from wan_enhanced.wan.attention import get_backend
from wan_enhanced.wan.configs import DiTConfig
from wan_enhanced.wan.rope import RotaryTable

needs_scaled_mm = pytest.mark.skipif(not has_cpu_kernel("_scaled_mm"),
                                     reason="no torch._scaled_mm on this CPU")


def _fp8_model(**kw) -> dit.WanDiT:
    torch.manual_seed(0)
    model = dit.WanDiT(DiTConfig(dim=64, ffn_dim=96, num_heads=2, num_layers=2, **kw),
                       compute_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    quantize_block_linears(model, SCHEMES["fp8_e4m3fn_fast"])
    return model


def _codes_counted(monkeypatch) -> list[int]:
    calls = []
    real = dit_block.norm_codes

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(dit_block, "norm_codes", counted)
    return calls


@needs_scaled_mm
@pytest.mark.parametrize("kind", ["t2v", "ti2v"])
def test_blocks_give_their_fp8_layers_the_norms_codes_to_the_bit(monkeypatch, kind):
    """A bf16 model with fp8 matmuls (run through torch._scaled_mm's CPU kernel): its three norms
    a block go to the layers as codes, and the output is, bit for bit, that of the norms handed
    over in bf16 and quantized by each layer (also with per-frame modulation, TI2V)."""
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    model = _fp8_model(**({"in_dim": 48, "out_dim": 48} if kind == "ti2v" else {}))
    cfg = model.config
    x = torch.randn(1, cfg.in_dim, 3, 6, 8)
    t = torch.tensor([[0.0, 400.0, 400.0]]) if kind == "ti2v" else torch.tensor([500.0])
    ctx = torch.randn(1, 5, cfg.text_dim)
    calls = _codes_counted(monkeypatch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback of the fp8 layers
        codes = model(x, t, ctx)
        assert len(calls) == 3 * cfg.num_layers
        monkeypatch.setattr(dit_block, "takes_row_codes", lambda layers, x: False)
        plain = model(x, t, ctx)
    assert len(calls) == 3 * cfg.num_layers
    assert torch.equal(codes, plain)
    assert codes.abs().max() > 0


@needs_scaled_mm
def test_a_pending_update_is_added_in_the_norms_pass(monkeypatch):
    """self_attention_update and cross_attention_phase with an update still owed to x (the
    compiled blocks hand them one): x is updated in place and the results are those of the update
    added first, to the bit."""
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    model = _fp8_model()
    block = model.blocks[0]
    tokens, grid = model.patchify(torch.randn(1, 16, 2, 4, 6))
    _, e0 = model.embed_time(torch.tensor([300.0]), 1, grid)
    rope = RotaryTable(grid, model.config.rope_pairs)
    text = model.embed_text(torch.randn(1, 5, 4096)).bfloat16()
    sdpa, bf16 = get_backend("sdpa"), torch.bfloat16
    y = torch.randn(tokens.shape, dtype=bf16)
    gate = torch.randn(1, 1, tokens.shape[-1])
    calls = _codes_counted(monkeypatch)
    with torch.no_grad():
        owed = tokens.clone()
        update = block.self_attention_update(owed, e0, rope, sdpa, bf16,
                                             pending=dit_block.ResidualUpdate(y, gate))
        first = tokens.clone()
        glue.add_gated_(first, y, gate)
        expected = block.self_attention_update(first, e0, rope, sdpa, bf16)
        assert torch.equal(owed, first) and torch.equal(update.y, expected.y)

        crossed = block.cross_attention_phase(owed.clone(), text, None, sdpa, bf16,
                                              pending=update)
        glue.add_gated_(first, *expected)
        expected_x = block.cross_attention_phase(first, text, None, sdpa, bf16)
    assert torch.equal(crossed, expected_x)
    assert len(calls) == 4


def _block_inputs(model, device="cpu"):
    tokens, grid = model.patchify(torch.randn(1, 16, 2, 4, 6, device=device))
    _, e0 = model.embed_time(torch.tensor([300.0], device=device), 1, grid)
    rope = RotaryTable(grid, model.config.rope_pairs, device=device)
    text = model.embed_text(torch.randn(1, 5, 4096, device=device)).bfloat16()
    return tokens, e0, rope, text


@needs_scaled_mm
def test_the_cross_attentions_update_is_added_in_the_ffns_norm_pass(monkeypatch):
    """cross_attention_update hands its update to feed_forward_update (where both FFN layers
    take fp8 codes), which adds it in the pass of its norm's codes and makes its hidden codes in
    two row pieces: x and the FFN's update are, to the bit, those of the cross-attention added
    in its own phase and the FFN made whole."""
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    model = _fp8_model()
    block = model.blocks[0]
    tokens, e0, rope, text = _block_inputs(model)
    sdpa, bf16 = get_backend("sdpa"), torch.bfloat16
    owed = dit_block.ResidualUpdate(torch.randn(tokens.shape, dtype=bf16),
                              torch.randn(1, 1, tokens.shape[-1]))
    pieces = []
    real_hidden = dit_ffn.hidden_codes

    def counted(first, h, count):
        pieces.append(count)
        return real_hidden(first, h, count)
    monkeypatch.setattr(dit_ffn, "hidden_codes", counted)
    calls = _codes_counted(monkeypatch)
    with torch.no_grad():
        assert block.feed_forward_takes_update(tokens, e0, bf16)
        handed = tokens.clone()
        crossed = block.cross_attention_update(handed, text, None, sdpa, bf16, pending=owed)
        assert crossed.gate is None
        ffn = block.feed_forward_update(handed, e0, bf16, pending=crossed)
        assert pieces == [dit_block.HIDDEN_PIECES_WITH_UPDATE] and len(calls) == 2

        added = block.cross_attention_phase(tokens.clone(), text, None, sdpa, bf16,
                                            pending=owed)
        whole = block.feed_forward_update(added, e0, bf16)
    assert len(pieces) == 1 and len(calls) == 4
    assert torch.equal(handed, added)
    assert torch.equal(ffn.y, whole.y) and ffn.y.abs().max() > 0
    # the cross-attention's update was owed: without it, x differs
    glue.add_gated_(tokens, *owed)
    assert (tokens - handed).abs().max() > 0.1 * crossed.y.abs().max().float()


@needs_scaled_mm
def test_compiled_fp8_blocks_hand_the_cross_attentions_update_to_the_ffn(monkeypatch):
    """Through the compiled phase graphs an fp8 block's cross-attention hands its update to the
    FFN's graph (three graphs: self-attention, the cross-attention's update, the FFN taking
    it), and the block's output is, to the bit, that of the graphs where the cross-attention
    adds its own update; both are the eager block's up to the compiled steps' rounding."""
    from torch._dynamo.utils import counters

    from wan_enhanced.wan.compiled_blocks import compiled_block_forward

    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    model = _fp8_model()
    block = model.blocks[0]
    tokens, e0, rope, text = _block_inputs(model)
    args = (e0, rope, text, None, get_backend("sdpa"), torch.bfloat16, tokens.shape[1])
    taken = []
    real = dit_block.WanBlock.feed_forward_takes_update

    def recorded(self, *a):
        taken.append(real(self, *a))
        return taken[-1]
    monkeypatch.setattr(dit_block.WanBlock, "feed_forward_takes_update", recorded)
    with torch.no_grad():
        expected = block(tokens.clone(), *args)
        torch._dynamo.reset()
        counters.clear()
        handed = compiled_block_forward()(block, tokens.clone(), *args)
        assert taken == [True] and counters["stats"]["unique_graphs"] == 3
        torch._dynamo.reset()
        monkeypatch.setattr(dit_block.WanBlock, "feed_forward_takes_update", lambda *a: False)
        added = compiled_block_forward()(block, tokens.clone(), *args)
        torch._dynamo.reset()
    assert torch.equal(handed, added)
    assert float((handed - expected).norm() / expected.norm()) < 0.02


@needs_scaled_mm
def test_only_an_ffn_of_fp8_layers_in_one_chunk_takes_the_update(monkeypatch):
    """bf16 layers (no codes) take no update; nor does an FFN in several row chunks, which
    refuses one by name."""
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    model = _fp8_model()
    block = model.blocks[0]
    tokens, e0, _, _ = _block_inputs(model)
    bf16 = torch.bfloat16
    assert block.feed_forward_takes_update(tokens, e0, bf16)
    plain = dit.WanDiT(model.config, compute_dtype=bf16).blocks[0]
    assert not plain.feed_forward_takes_update(tokens, e0, bf16)
    monkeypatch.setattr(chunks, "FFN_HIDDEN_BYTES", 64)
    assert not block.feed_forward_takes_update(tokens, e0, bf16)
    update = dit_block.ResidualUpdate(torch.zeros(tokens.shape, dtype=bf16), None)
    with torch.no_grad(), pytest.raises(ValueError, match="one chunk"):
        block.feed_forward_update(tokens.clone(), e0, bf16, pending=update)


@needs_scaled_mm
@pytest.mark.parametrize("pieces", [2, 3])
def test_an_fp8_ffn_makes_its_hidden_codes_in_pieces_to_the_bit(monkeypatch, pieces):
    """feed_forward with its hidden activation made a row piece at a time (the first product
    of each piece, its GELU codes into rows of one tensor): the whole FFN's output, to the bit,
    from a norm's codes and from a bf16 activation, also with LoRA'd layers."""
    from wan_enhanced.lora.layers import LoraFp8Linear

    def wrapped(layer, down, up):
        lora = LoraFp8Linear(layer)
        lora.add("low_rank", (down, up), 0.5)
        return lora

    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    torch.manual_seed(0)
    fp8 = SCHEMES["fp8_e4m3fn_fast"]
    ffn = torch.nn.Sequential(fp8.quantize(torch.nn.Linear(64, 96)),
                              torch.nn.GELU(approximate="tanh"),
                              fp8.quantize(torch.nn.Linear(96, 64)))
    h = torch.randn(2, 7, 64).bfloat16()
    rows = RowCodes(*quantize_rows(h.reshape(-1, 64), FP8), h.shape, h.dtype)

    def same_in_pieces():
        for x in (h, rows):
            out = dit_ffn.feed_forward(ffn, x, pieces)
            assert out.shape == (2, 7, 64)
            assert torch.equal(out, dit_ffn.feed_forward(ffn, x)) and out.abs().max() > 0

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        same_in_pieces()
        ffn[0] = wrapped(ffn[0], torch.randn(4, 64, generator=gen) / 8,
                         torch.randn(96, 4, generator=gen) / 8)
        ffn[2] = wrapped(ffn[2], torch.randn(4, 96, generator=gen) / 8,
                         torch.randn(64, 4, generator=gen) / 8)
        same_in_pieces()


@needs_scaled_mm
def test_a_lora_first_layer_sums_its_terms_once_for_all_pieces(monkeypatch):
    """A LoRA'd fp8 first layer whose terms are summed into its codes for a call of this many
    rows (lora.layers.merges_per_call) forms that sum once for the FFN's hidden pieces, not once
    per piece, and the pieces take the whole input's choice (a piece alone, with fewer rows,
    would add the terms to its output instead): the output is the whole FFN's, to the bit."""
    from wan_enhanced.lora import layers as lora_layers

    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    torch.manual_seed(0)
    fp8 = SCHEMES["fp8_e4m3fn_fast"]
    ffn = torch.nn.Sequential(fp8.quantize(torch.nn.Linear(64, 96)),
                              torch.nn.GELU(approximate="tanh"),
                              fp8.quantize(torch.nn.Linear(96, 64)))
    gen = torch.Generator().manual_seed(1)
    first = lora_layers.LoraFp8Linear(ffn[0])
    first.add("low_rank", (torch.randn(4, 64, generator=gen) / 8,
                           torch.randn(96, 4, generator=gen) / 8), 0.5)
    ffn[0] = first
    h = torch.randn(2, 60, 64).bfloat16()  # 120 rows: the terms are summed into the codes
    assert lora_layers.merges_per_call(120, 64, 96)
    assert not lora_layers.merges_per_call(60, 64, 96)
    sums = []
    real_sum = lora_layers.fp8_sum

    def counted(*args):
        sums.append(1)
        return real_sum(*args)
    monkeypatch.setattr(lora_layers, "fp8_sum", counted)
    with torch.no_grad():
        whole = dit_ffn.feed_forward(ffn, h)
        assert len(sums) == 1
        for pieces in (2, 3):
            sums.clear()
            out = dit_ffn.feed_forward(ffn, h, pieces)
            assert len(sums) == 1, pieces
            assert torch.equal(out, whole) and out.abs().max() > 0


@needs_scaled_mm
def test_an_fp8_layer_multiplies_row_codes_as_its_own(monkeypatch):
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    torch.manual_seed(0)
    layer = SCHEMES["fp8_e4m3fn_fast"].quantize(torch.nn.Linear(96, 80))
    h = torch.randn(3, 5, 96).bfloat16()
    rows = RowCodes(*quantize_rows(h.reshape(-1, 96), FP8), h.shape, h.dtype)
    assert torch.equal(layer(rows), layer.scaled_forward(h))
    assert torch.equal(layer.scaled_forward_without_bias(rows),
                       layer.scaled_forward_without_bias(h))
    narrow = RowCodes(*quantize_rows(h[..., :48].reshape(-1, 48), FP8), h[..., :48].shape,
                      h.dtype)
    with pytest.raises(ValueError, match="input codes of width 48 for a layer of 96"):
        layer(narrow)


@needs_scaled_mm
def test_a_lora_fp8_layer_multiplies_row_codes_with_its_terms(monkeypatch):
    """A LoRA'd fp8 layer (its terms read the input's codes too) gives for a norm's codes what
    it gives for the activation itself, to the bit, with and without the bias."""
    from wan_enhanced.lora.layers import LoraFp8Linear

    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    torch.manual_seed(0)
    layer = LoraFp8Linear(SCHEMES["fp8_e4m3fn_fast"].quantize(torch.nn.Linear(96, 80)))
    layer.add("low_rank", (torch.randn(4, 96) * 0.1, torch.randn(80, 4) * 0.1), 0.7)
    layer.add("bias_diff", (torch.randn(80) * 0.1,), 1.0)
    h = torch.randn(2, 5, 96).bfloat16()
    rows = RowCodes(*quantize_rows(h.reshape(-1, 96), FP8), h.shape, h.dtype)
    assert torch.equal(layer(rows), layer(h))
    assert torch.equal(layer.scaled_forward_without_bias(rows),
                       layer.scaled_forward_without_bias(h))
    assert not torch.equal(layer(rows), layer.base(h))  # the terms are in it


def test_only_fp8_layers_that_run_their_matmul_take_codes(monkeypatch):
    from wan_enhanced.lora.layers import LoraFp8Linear, LoraLinear

    x = torch.randn(1, 4, 96)
    fast = SCHEMES["fp8_e4m3fn_fast"].quantize(torch.nn.Linear(96, 80))
    assert not glue.takes_row_codes((fast,), x)  # the CPU has no fp8 matmul
    monkeypatch.setattr(quant_linear, "fp8_matmul_unavailable", lambda device: None)
    assert glue.takes_row_codes((fast,), x)
    assert not glue.takes_row_codes((fast,), x.bfloat16())  # the float32 stream only
    assert not glue.takes_row_codes((fast, torch.nn.Linear(96, 80)), x)
    assert not glue.takes_row_codes((SCHEMES["fp8_e4m3fn"].quantize(torch.nn.Linear(96, 80)),), x)
    assert glue.takes_row_codes((LoraFp8Linear(fast),), x)  # its terms read the codes too
    assert not glue.takes_row_codes((LoraLinear(torch.nn.Linear(96, 80)),), x)


# -- the kernel ----------------------------------------------------------------------------------

def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _case(width: int, groups: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")
    x = randn(2, 12 * groups, width) * 3 + randn(1, 1, width)
    x[0, 3] = 0  # a constant row: its norm is 0
    y = (randn(2, 12 * groups, width) * 2).bfloat16()
    gate, shift, scale = (randn(2, 6, groups, width)[:, i] for i in range(3))  # strided views
    return x, y, gate, shift, scale


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1000, 1536, 3072, 5120])
def test_gpu_norm_codes_kernel_is_its_statement_to_the_bit(width):
    """The kernel (update, norm, modulation or affine, rounding to bf16, codes) against
    norm_codes_statement (the eager steps: add_gated_, the norm, quantize_rows): the same x after
    the update, the same scales and codes (but a code in 10^5, one fp8 step off), with
    per-group tables, ungated and gated updates."""
    _cuda_or_skip()
    gen = torch.Generator().manual_seed(width)
    norm = torch.nn.LayerNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(width, generator=gen))
        norm.bias.copy_(0.2 * torch.randn(width, generator=gen))
    norm = norm.cuda()
    for seed, groups in ((0, 1), (1, 3), (2, 1), (3, 2)):
        x, y, gate, shift, scale = _case(width, groups, seed)
        for kwargs in ({"shift": shift, "scale": scale}, {"norm": norm}):
            for pending in (None, (y, gate), (y, None)):
                got_x, ref_x = x.clone(), x.clone()
                got = glue.norm_codes(got_x, 1e-6, torch.bfloat16, pending=pending, **kwargs)
                ref = glue.norm_codes_statement(ref_x, 1e-6, torch.bfloat16, pending=pending,
                                                **kwargs)
                assert torch.equal(got_x, ref_x)
                assert torch.equal(got.scales, ref.scales)
                # the same float32 steps, but fused multiply-adds formed differently in the
                # two kernels can move an h within an ulp of a bf16 rounding edge: a code in 10^5
                differ = got.codes.view(torch.uint8) != ref.codes.view(torch.uint8)
                assert float(differ.float().mean()) < 1e-4, (
                    f"{int(differ.sum())} codes differ: {sorted(kwargs)}, update "
                    f"{pending is not None}, groups {groups}")
                steps = (got.codes.float() - ref.codes.float()).abs()
                assert bool((steps <= ref.codes.float().abs() * 0.125 + 2 ** -9).all())
                assert got.shape == x.shape and got.dtype == torch.bfloat16


@pytest.mark.gpu
def test_gpu_compiled_norm_codes_are_one_operator_writing_the_stream_in_place():
    """Inside a compiled graph the update and the norm's codes are the kernel, an operator of
    its own (not inductor's reductions), writing into the graph's input x (no copy): the eager
    results to the bit."""
    _cuda_or_skip()
    x, y, gate, shift, scale = _case(3072, 1, 2)

    def step(stream, y, gate):
        rows = glue.norm_codes(stream, 1e-6, torch.bfloat16, shift=shift, scale=scale,
                               pending=(y, gate))
        return rows.codes, rows.scales

    eager_x = x.clone()
    eager = step(eager_x, y, gate)
    targets = []

    def recording(graph, inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes)
        return graph

    torch._dynamo.reset()
    torch.compile(step, backend=recording, fullgraph=True)(x.clone(), y, gate)
    assert any("add_norm_codes" in target for target in targets), targets
    torch._dynamo.reset()
    compiled_x = x.clone()
    pointer = compiled_x.data_ptr()
    codes, scales = torch.compile(step, fullgraph=True)(compiled_x, y, gate)
    torch._dynamo.reset()
    assert compiled_x.data_ptr() == pointer and torch.equal(compiled_x, eager_x)
    assert torch.equal(scales, eager[1])
    assert torch.equal(codes.view(torch.uint8), eager[0].view(torch.uint8))


@pytest.mark.gpu
def test_gpu_compiled_block_phases_take_the_codes_without_a_graph_break():
    """Each compiled phase of an fp8 block is one graph with the norm's codes operator in it (a
    graph break would hand the codes back to Python, alive through the rest of the phase), and
    gives the eager phase's result up to the compiled steps' rounding."""
    _cuda_or_skip()
    if quant_linear.fp8_matmul_unavailable(torch.device("cuda")) is not None:
        pytest.skip("no fp8 matmul on this GPU")
    model = _fp8_model().cuda()
    block, cls = model.blocks[0], type(model.blocks[0])
    tokens, grid = model.patchify(torch.randn(1, 16, 2, 8, 8, device="cuda"))
    _, e0 = model.embed_time(torch.tensor([300.0], device="cuda"), 1, grid)
    rope = RotaryTable(grid, model.config.rope_pairs, device="cuda")
    text = model.embed_text(torch.randn(1, 5, 4096, device="cuda")).bfloat16()
    sdpa, bf16 = get_backend("sdpa", torch.device("cuda")), torch.bfloat16
    pending = dit_block.ResidualUpdate(torch.randn(tokens.shape, device="cuda").bfloat16(),
                                 torch.randn(1, 1, tokens.shape[-1], device="cuda"))
    crossed = dit_block.ResidualUpdate(pending.y, None)
    phases = ((cls.self_attention_update, (e0, rope, sdpa, bf16, pending)),
              (cls.cross_attention_phase, (text, None, sdpa, bf16, None, pending)),
              (cls.cross_attention_update, (text, None, sdpa, bf16, pending)),
              (cls.feed_forward_update, (e0, bf16)),
              (cls.feed_forward_update, (e0, bf16, crossed)))
    with torch.no_grad():
        for phase, args in phases:
            targets = []

            def recording(graph, inputs):
                targets.extend(str(node.target) for node in graph.graph.nodes)
                return graph

            torch._dynamo.reset()
            torch.compile(phase, backend=recording, fullgraph=True)(block, tokens.clone(), *args)
            assert any("norm_codes" in target for target in targets), (phase.__name__, targets)
            # the hidden codes in pieces: written into the graph's own buffer
            assert (any("gelu_fp8_rows_into" in target for target in targets)
                    == (args[-1] is crossed)), (phase.__name__, targets)
            torch._dynamo.reset()
            eager_x, compiled_x = tokens.clone(), tokens.clone()
            eager = phase(block, eager_x, *args)
            compiled = torch.compile(phase, fullgraph=True, dynamic=False)(block, compiled_x,
                                                                         *args)
            torch._dynamo.reset()
            eager = eager.y if isinstance(eager, dit_block.ResidualUpdate) else eager
            compiled = compiled.y if isinstance(compiled, dit_block.ResidualUpdate) else compiled
            torch.testing.assert_close(compiled_x, eager_x, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled.float(), eager.float(), rtol=0.02,
                                       atol=0.02 * float(eager.abs().max()))


@pytest.mark.gpu
def test_gpu_gelu_codes_in_pieces_are_the_whole_activations_to_the_bit():
    """gelu_quantize_in_pieces with the row kernel writing each piece's rows into one tensor,
    eager and compiled (the operator writing into the graph's buffer): gelu_quantize's codes and
    scales of the whole activation, to the bit."""
    from wan_enhanced.quant.gelu_fp8 import gelu_quantize, gelu_quantize_in_pieces

    _cuda_or_skip()
    gen = torch.Generator("cuda").manual_seed(0)
    x = (torch.randn(1000, 1792, device="cuda", generator=gen) * 3).bfloat16()
    bias = torch.randn(1792, device="cuda", generator=gen).bfloat16()
    whole = gelu_quantize(x, bias)
    pieces = [(0, 300), (300, 640), (640, 1000)]

    def in_pieces(x, bias):
        return gelu_quantize_in_pieces(lambda start, end: x[start:end] * 1, x.shape[0],
                                       x.shape[1], bias, pieces, x.device)
    for run in (in_pieces, torch.compile(in_pieces, fullgraph=True, dynamic=False)):
        codes, scales = run(x, bias)
        assert torch.equal(codes.view(torch.uint8), whole[0].view(torch.uint8))
        assert torch.equal(scales, whole[1])
    torch._dynamo.reset()
