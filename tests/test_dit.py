"""The DiT against the reference outputs, plus invariants of its inputs and numerics."""

import json

import pytest
import torch

from wan_enhanced.conformance import run_dit
from wan_enhanced.conformance.golden_file import read_golden
from wan_enhanced.wan.configs import KNOWN_DITS, DiTConfig
from wan_enhanced.wan.attention import get_backend
from wan_enhanced.wan.glue import add_gated_
from wan_enhanced.wan.compiled_blocks import OwedUpdate, compiled_block_forward
from wan_enhanced.wan.dit import WanDiT, group_timesteps, sinusoidal_embedding
from wan_enhanced.wan.rope import RotaryTable, rope_angles
from tiny_sets import tiny_block


@pytest.mark.parametrize("name", ["dit_wan21", "dit_wan22_ti2v"])
def test_golden(golden_dir, name):
    scores = run_dit.run(read_golden(golden_dir / f"{name}.safetensors"))
    for s in scores:
        print(s.line())
    assert scores and all(s.passed for s in scores)
    # a faithful float32 implementation lands near 1e-6, far inside the 1e-5 tolerance
    assert max(s.max_rel for s in scores) < 2e-6


def test_golden_intermediates(golden_dir):
    """The embeddings and the first block agree with the reference's debug tensors."""
    golden = read_golden(golden_dir / "dit_wan21.safetensors")
    model = run_dit.build(golden)
    case = golden.cases()[0]
    x, t, context = case.inputs["x"], case.inputs["t"], case.inputs["context"]
    with torch.no_grad():
        tokens, grid = model.patchify(x)
        e, e0 = model.embed_time(t, 1, grid)
        text = model.embed_text(context)
    debug = {k[len("debug."):]: v for k, v in golden.tensors.items() if k.startswith("debug.")}
    torch.testing.assert_close(tokens, debug["patch_embedding"], rtol=0, atol=1e-5)
    torch.testing.assert_close(e[:, 0], debug["time_embedding"], rtol=0, atol=1e-5)
    torch.testing.assert_close(e0[:, 0].flatten(1), debug["time_projection"], rtol=0, atol=1e-4)
    torch.testing.assert_close(text, debug["text_embedding"], rtol=0, atol=1e-5)


def test_missing_padding_is_detected(golden_dir):
    """Feeding the reference's y_nopad case proves the text padding matters (~40% of max|y|)."""
    golden = read_golden(golden_dir / "dit_wan21.safetensors")
    model = run_dit.build(golden)
    case = golden.cases()[0]
    with torch.no_grad():
        y = model(case.inputs["x"], case.inputs["t"], case.inputs["context"])
    nopad = golden.tensors["output.y_nopad"]
    assert (y - nopad).abs().max() / nopad.abs().max() > 0.1


def _tiny(**kw) -> WanDiT:
    torch.manual_seed(0)
    cfg = DiTConfig(dim=64, ffn_dim=96, num_heads=2, num_layers=2, **kw)
    model = WanDiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_timestep_forms_agree():
    """[B], [B, F] and [B, L] timesteps give the same output when they carry the same values."""
    model = _tiny(in_dim=48, out_dim=48)
    x = torch.randn(1, 48, 3, 4, 6)
    ctx = torch.randn(1, 5, 4096)
    per_frame = torch.tensor([[0.0, 500.0, 500.0]])
    per_token = per_frame.repeat_interleave(2 * 3, dim=1)
    with torch.no_grad():
        a = model(x, per_frame, ctx)
        b = model(x, per_token, ctx)
        c = model(x, torch.tensor([500.0]), ctx)
        d = model(x, torch.full((1, 3), 500.0), ctx)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # one time-MLP row against three: only matmul rounding differs
    assert (c - d).abs().max() / c.abs().max() < 1e-5
    assert (a - c).abs().max() > 1e-3  # frame 0 at t=0 changes the result


def test_group_timesteps_shapes():
    grid = (3, 2, 2)
    assert group_timesteps(torch.tensor([5.0]), 2, grid).shape == (2, 1)
    assert group_timesteps(torch.ones(2, 3), 2, grid).shape == (2, 3)
    varying = torch.arange(12.0).view(1, 12)
    assert group_timesteps(varying, 1, grid).shape == (1, 12)
    with pytest.raises(ValueError, match="per latent frame"):
        group_timesteps(torch.ones(1, 5), 1, grid)


def test_batch_matches_single():
    model = _tiny()
    x = torch.randn(2, 16, 2, 4, 4)
    ctx = torch.randn(2, 7, 4096)
    t = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        both = model(x, t, ctx)
        one = model(x[1:], t[1:], ctx[1:])
    assert (both[1:] - one).abs().max() / one.abs().max() < 1e-5


def test_context_longer_than_text_len_is_used_whole():
    """Rows past text_len (512) are attended to, not cut: changing row 550 changes the output,
    and a context of 600 rows is not the same as its first 512."""
    model = _tiny()
    x = torch.randn(1, 16, 1, 4, 4)
    context = torch.randn(1, 600, 4096)
    changed = context.clone()
    changed[:, 550] += 5.0
    t = torch.tensor([500.0])
    with torch.no_grad():
        y = model(x, t, context)
        assert y.shape == x.shape
        assert not torch.allclose(model(x, t, changed), y, rtol=0, atol=1e-6)
        assert not torch.allclose(model(x, t, context[:, :512]), y, rtol=0, atol=1e-6)
        assert torch.equal(model(x, t, context), y)


def test_blocks_argument_replaces_the_block_list():
    model = _tiny()
    x, ctx, t = torch.randn(1, 16, 1, 4, 4), torch.randn(1, 3, 4096), torch.tensor([10.0])
    calls = []

    def supplied():
        for block in model.blocks:
            calls.append(block)
            yield block

    with torch.no_grad():
        assert torch.equal(model(x, t, ctx, blocks=supplied()), model(x, t, ctx))
    assert calls == list(model.blocks)


def test_bfloat16_compute_close_to_float32():
    model = _tiny()
    x, ctx, t = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 3, 4096), torch.tensor([700.0])
    with torch.no_grad():
        ref = model(x, t, ctx)
        for block in model.blocks:
            for name, module in block.named_modules():
                if isinstance(module, torch.nn.Linear):
                    module.to(torch.bfloat16)
        model.compute_dtype = torch.bfloat16
        low = model(x, t, ctx)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() / ref.abs().max() < 3e-2


def test_bad_inputs_name_what_was_expected():
    model = _tiny()
    with pytest.raises(ValueError, match="expects 16"):
        model(torch.randn(1, 12, 1, 4, 4), torch.tensor([1.0]), torch.randn(1, 3, 4096))
    with pytest.raises(ValueError, match="multiple of the patch"):
        model(torch.randn(1, 16, 1, 5, 4), torch.tensor([1.0]), torch.randn(1, 3, 4096))
    with pytest.raises(ValueError, match="width 768"):
        model(torch.randn(1, 16, 1, 4, 4), torch.tensor([1.0]), torch.randn(1, 3, 768))


def test_rope_split_and_float64_angles():
    cfg = KNOWN_DITS["wan2.1-t2v-14b"].config
    assert cfg.rope_pairs == (22, 21, 21)
    angles = rope_angles((2, 3, 4), (2, 1, 1))
    assert angles.dtype == torch.float64 and angles.shape == (24, 4)
    # token (f=1, h=2, w=3) is index 1*12 + 2*4 + 3 = 23: width pair angle = 3 * 1
    assert angles[23, 3].item() == 3.0 and angles[23, 2].item() == 2.0


def test_sinusoid_is_float64_then_cast():
    t = torch.tensor([873.0, 437.5])
    emb = sinusoidal_embedding(t, 256)
    exact = torch.cat([torch.cos(t.double()[:, None] * torch.pow(10000.0, -torch.arange(
        128).double() / 128)), torch.sin(t.double()[:, None] * torch.pow(10000.0, -torch.arange(
            128).double() / 128))], 1).float()
    assert torch.equal(emb, exact)


def test_known_configs_build_on_meta_with_manifest_shapes():
    manifests = json.load(open(__import__("pathlib").Path(__file__).parent / "data" /
                               "key_manifests.json"))
    pairs = {"wan21_t2v_1.3B": "wan2.1-t2v-1.3b", "wan21_t2v_14B": "wan2.1-t2v-14b",
             "wan21_i2v_14B": "wan2.1-i2v-14b", "wan22_ti2v_5B": "wan2.2-ti2v-5b",
             "wan22_i2v_A14B_expert": "wan2.2-i2v-a14b"}
    for manifest, name in pairs.items():
        with torch.device("meta"):
            model = WanDiT(KNOWN_DITS[name].config)
        ours = {k: list(v.shape) for k, v in model.state_dict().items()}
        theirs = {k: v[0] for k, v in manifests[f"official/{manifest}"].items()}
        assert ours == theirs, name


def test_row_chunks_cover_the_rows_in_whole_groups():
    from wan_enhanced.wan.chunks import row_chunks
    assert row_chunks(100, 1, target=100) == [(0, 100)]
    assert row_chunks(45, 1, target=8) == [(s, min(s + 8, 45)) for s in range(0, 45, 8)]
    # 5 frames of 9 tokens: chunks of whole frames (two frames of 9 fit in 20 rows)
    assert row_chunks(45, 5, target=20) == [(0, 18), (18, 36), (36, 45)]
    # a frame larger than the target: one frame per chunk
    assert row_chunks(45, 5, target=4) == [(s, s + 9) for s in range(0, 45, 9)]
    assert row_chunks(45, 45, target=8) == [(s, min(s + 8, 45)) for s in range(0, 45, 8)]


def test_row_chunks_hold_whole_waves_of_the_attention_kernel():
    """With a unit (attention.wave_rows) every chunk but the last holds whole units and whole
    groups, as many units as come nearest the target; where whole units and groups together
    pass 1.5 times the target the unit is not taken. The rows of Wan's eager phases on an H100
    (132 multiprocessors) first."""
    from wan_enhanced.wan.chunks import row_chunks

    def check(length, groups, target, unit, sizes, aligned=True):
        chunks = row_chunks(length, groups, target, unit)
        assert [end - start for start, end in chunks] == sizes
        assert chunks[0][0] == 0 and chunks[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        per_group = length // groups if groups > 1 else 1
        assert all(n % per_group == 0 for n in sizes[:-1])
        assert aligned == all(n % unit == 0 for n in sizes[:-1])

    # 5B (24 heads: 11 programs of 192 rows per head fill 2 waves): 4 chunks of 4 units
    check(27280, 1, 8192, 2112, [8448, 8448, 8448, 1936])
    # the same with one timestep per frame (31 frames of 880 rows): whole frames and units
    check(27280, 31, 8192, 2112, [10560, 10560, 6160])
    # 14B (40 heads: 33 programs per head fill 10 waves): units of 6336 rows
    check(75600, 1, 8192, 6336, [6336] * 11 + [5904])
    # frames of 9 rows and units of 12: chunks of 36 (1.5 times the target of 24)
    check(45, 5, 24, 12, [36, 9])
    # a unit (or units with frames) past 1.5 times the target is not taken
    check(45, 1, 8, 13, [8] * 5 + [5], aligned=False)
    check(45, 5, 20, 12, [18, 18, 9], aligned=False)
    # bf16_hopper's units (11 programs of 128 rows at 24 heads) with 5B's frames of 880 rows
    check(27280, 31, 8192, 1408, [7040] * 3 + [6160])
    assert row_chunks(100, 1, 100, 7) == [(0, 100)]  # one chunk stays one


def test_the_self_attention_phase_chunks_its_rows_in_whole_waves(monkeypatch):
    """self_attention_phase takes its row chunks in units of attention.wave_rows for the backend
    it runs (stood in here: units of 6 rows), with the output of any other chunking to float32
    rounding."""
    from wan_enhanced.wan import dit_block
    from wan_enhanced.wan.sdpa import sdpa

    block, x, e0, _, rope = tiny_block()
    asked, sizes = [], []

    def wave_rows(attend, batch_heads, head_dim, device, dtype):
        asked.append((attend, batch_heads, head_dim, device.type, dtype))
        return 6

    def then(rows, update):
        sizes.append(rows.shape[1])
        add_gated_(rows, *update)
    with torch.no_grad():
        plain = block.self_attention_phase(x.clone(), e0, rope, sdpa, torch.float32, 16, then)
        assert sizes == [16, 16, 13]
        sizes.clear()
        monkeypatch.setattr(dit_block, "wave_rows", wave_rows)
        waves = block.self_attention_phase(x.clone(), e0, rope, sdpa, torch.float32, 16, then)
    assert sizes == [18, 18, 9]
    assert asked == [(sdpa, 2, 128, "cpu", torch.float32)]
    assert (waves - plain).abs().max() <= 2e-6 * plain.abs().max()


@pytest.mark.parametrize("kind,timesteps", [("t2v", "one"), ("ti2v", "per_frame"),
                                            ("ti2v", "per_token"), ("i2v", "one")])
def test_row_chunked_blocks_equal_one_pass(monkeypatch, kind, timesteps):
    """Each block phase over row chunks (short last chunk, chunks of whole frames, per-token
    modulation) gives what one pass over all rows gives, to float32 rounding."""
    from wan_enhanced.wan import chunks
    model = _tiny(**{"t2v": {}, "ti2v": dict(in_dim=48, out_dim=48),
                     "i2v": dict(in_dim=36, image_embedding=True, image_dim=64)}[kind])
    cfg = model.config
    frames = 3
    x = torch.randn(1, cfg.in_dim, frames, 6, 10)
    ctx = torch.randn(1, 5, cfg.text_dim)
    tokens = frames * 3 * 5
    t = {"one": torch.tensor([640.0]),
         "per_frame": torch.tensor([[0.0, 500.0, 500.0]]),
         "per_token": torch.linspace(0, 900, tokens)[None]}[timesteps]
    clip = torch.randn(1, 257, cfg.image_dim) if cfg.image_embedding else None
    with torch.no_grad():
        whole = model(x, t, ctx, clip_tokens=clip)
        monkeypatch.setattr(chunks, "ROW_CHUNK_TOKENS", 7)  # 45 tokens: frames of 15 / rows of 7
        chunked = model(x, t, ctx, clip_tokens=clip)
    assert (chunked - whole).abs().max() <= 2e-6 * whole.abs().max()
    assert len(chunks.row_chunks(tokens, 1)) == 7


@pytest.mark.parametrize("rows", [16, 64])
def test_each_chunk_hands_its_self_attention_update_to_its_cross_attention_norm(monkeypatch, rows):
    """attention_phases: where the cross-attention's query takes fp8 codes, each row chunk's
    self-attention update is added in that chunk's cross-attention norm pass (glue.norm_codes
    with `pending`), not in a pass of its own; the result is the two phases one after the
    other, to the bit."""
    from wan_enhanced.wan import dit_block
    from wan_enhanced.wan.chunks import row_chunks
    from wan_enhanced.wan.glue import add_gated_, norm_affine
    from wan_enhanced.wan.sdpa import sdpa

    block, x, e0, text, rope = tiny_block()
    handed, adds = [], []

    def norm_codes(part, eps, dtype, norm=None, pending=None, **_):
        handed.append(None if pending is None else (part.shape[1], pending.y.shape[1]))
        if pending is not None:
            add_gated_(part, *pending)
        return norm_affine(part, norm, eps, dtype)

    def counted_add(rows, y, gate):
        adds.append(gate is not None)
        return add_gated_(rows, y, gate)
    monkeypatch.setattr(dit_block, "norm_codes", norm_codes)
    monkeypatch.setattr(dit_block.WanBlock, "_query_takes_codes", lambda self, x: True)
    with torch.no_grad():
        phases = block.self_attention_phase(x.clone(), e0, rope, sdpa, torch.float32, rows)
        phases = block.cross_attention_phase(phases, text, None, sdpa, torch.float32, rows)
        handed.clear()
        monkeypatch.setattr(dit_block, "add_gated_", counted_add)
        together = block.attention_phases(x.clone(), e0, rope, text, None, sdpa, torch.float32,
                                          rows)
    chunks = row_chunks(45, 1, rows)
    assert handed == [(end - start, end - start) for start, end in chunks]
    assert adds == [False] * len(chunks)  # only the cross-attention's own updates
    assert torch.equal(together, phases)


@pytest.mark.parametrize("rows", [8, 16, 64])
def test_a_chunk_norms_its_rows_once_where_q_k_and_v_take_the_codes(monkeypatch, rows):
    """self_attention_phase over row chunks: where q, k and v all take the norm's fp8 codes and
    there are at most HELD_CODE_CHUNKS chunks, each chunk's codes are made once, for its keys and
    values, and held for its queries instead of being made again (over more chunks, made twice);
    the result is the same to the bit (the codes path stood in by the norm)."""
    from wan_enhanced.wan import dit_block
    from wan_enhanced.wan.chunks import row_chunks
    from wan_enhanced.wan.glue import norm_modulate
    from wan_enhanced.wan.sdpa import sdpa

    block, x, e0, _, rope = tiny_block()
    normed = []

    def norm_codes(part, eps, dtype, shift=None, scale=None, pending=None, **_):
        normed.append(part.shape[1])
        return norm_modulate(part, shift, scale, eps, dtype)
    monkeypatch.setattr(dit_block, "norm_codes", norm_codes)
    with torch.no_grad():
        plain = block.self_attention_phase(x.clone(), e0, rope, sdpa, torch.float32, rows)
        assert normed == []  # no layer here takes codes: the norm in compute_dtype, per use
        monkeypatch.setattr(dit_block, "takes_row_codes", lambda layers, x: True)
        shared = block.self_attention_phase(x.clone(), e0, rope, sdpa, torch.float32, rows)
    chunks = row_chunks(45, 1, rows)
    once = [end - start for start, end in chunks]
    assert normed == (once if len(chunks) <= dit_block.HELD_CODE_CHUNKS else once + once)
    assert len(chunks) == {8: 6, 16: 3, 64: 1}[rows]
    assert torch.equal(shared, plain)


def test_forward_leaves_its_inputs_alone():
    """The blocks update the residual stream in place; the caller's tensors are not touched."""
    model = _tiny()
    x, ctx, t = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 5, 4096), torch.tensor([300.0])
    copies = [x.clone(), ctx.clone(), t.clone()]
    with torch.no_grad():
        first = model(x, t, ctx)
        second = model(x, t, ctx)
    assert all(torch.equal(a, b) for a, b in zip((x, ctx, t), copies))
    assert torch.equal(first, second)


def test_compiled_blocks_run_as_phase_graphs_that_update_the_residual_in_place():
    """compiled=True: every block goes through three compiled graphs (self-attention,
    cross-attention, FFN: a graph spanning two residual updates held a float32 working copy of
    the residual between them), shared by the blocks, plus the first block's self-attention
    graph, which has no FFN update of a block before it to add; each block's residual x is
    updated in place, as in eager mode, and the output is the eager one up to the fused kernels'
    rounding. Handed an OwedUpdate, a block adds the update it holds first and leaves its own
    FFN update in it: added after, the result is the whole block's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _tiny(in_dim=48, out_dim=48)
    x = torch.randn(1, 48, 3, 8, 8)
    ctx = torch.randn(1, 5, 4096)
    with torch.no_grad():
        eager = model(x, torch.tensor([500.0]), ctx)
        compiled = model(x, torch.tensor([500.0]), ctx, compiled=True)
        assert counters["stats"]["unique_graphs"] == 4  # both blocks share them
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5 * eager.abs().max())

        block = model.blocks[0]
        tokens, grid = model.patchify(x)
        _, e0 = model.embed_time(torch.tensor([500.0]), 1, grid)
        rope = RotaryTable(grid, model.config.rope_pairs)
        text = model.embed_text(ctx)
        args = (e0, rope, text, None, get_backend("sdpa"), torch.float32, tokens.shape[1])
        expected = block(tokens.clone(), *args)
        residual = tokens.clone()
        out = compiled_block_forward()(block, residual, *args)
        assert out.data_ptr() == residual.data_ptr()
        torch.testing.assert_close(residual, expected, rtol=1e-5,
                                   atol=1e-5 * expected.abs().max())

        owed, partial = OwedUpdate(), tokens.clone()
        out = compiled_block_forward()(block, partial, *args, owed=owed)
        assert out.data_ptr() == partial.data_ptr() and owed.update is not None
        gap = (partial - expected).abs().max()
        assert gap > 1e-3 * expected.abs().max()  # the FFN's update is still owed
        add_gated_(partial, *owed.take())
        assert owed.update is None
        torch.testing.assert_close(partial, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
        # the next block adds what it is owed before its own work: two blocks as the model runs
        owed, twice = OwedUpdate(), tokens.clone()
        compiled_block_forward()(block, twice, *args, owed=owed)
        compiled_block_forward()(model.blocks[1], twice, *args, owed=owed)
        add_gated_(twice, *owed.take())
        expected_twice = model.blocks[1](block(tokens.clone(), *args), *args)
    torch.testing.assert_close(twice, expected_twice, rtol=1e-5,
                               atol=1e-5 * expected_twice.abs().max())


def test_the_compiled_phase_graphs_can_be_wrapped_by_name(monkeypatch):
    """compiled_blocks.wrap_phase_graphs hands each phase graph to a wrapper with its name (the
    phase-peak bench measures them so): a block then runs through the wrapped graphs, in phase
    order, with the same output."""
    from wan_enhanced.wan import compiled_blocks

    monkeypatch.setattr(compiled_blocks, "_GRAPHS", {})  # this test's graphs only
    torch._dynamo.reset()
    model = _tiny()
    block = model.blocks[0]
    x = torch.randn(1, 16, 2, 8, 8)
    tokens, grid = model.patchify(x)
    _, e0 = model.embed_time(torch.tensor([500.0]), 1, grid)
    rope = RotaryTable(grid, model.config.rope_pairs)
    args = (e0, rope, model.embed_text(torch.randn(1, 5, 4096)), None, get_backend("sdpa"),
            torch.float32, tokens.shape[1])
    called = []

    def wrap(name, graph):
        def call(*a, **kw):
            called.append(name)
            return graph(*a, **kw)
        return call
    with torch.no_grad():
        plain = compiled_block_forward()(block, tokens.clone(), *args)
        compiled_blocks.wrap_phase_graphs(type(block), wrap)
        wrapped = compiled_block_forward()(block, tokens.clone(), *args)
    torch._dynamo.reset()
    assert called == ["self_attention", "cross_attention", "feed_forward"]
    assert torch.equal(wrapped, plain)


def test_the_ffn_chunks_count_what_its_first_layer_holds(monkeypatch):
    """The FFN's row chunks are sized by the bytes per hidden element its first layer holds: the
    compute dtype's, or for int8 W8A8 the int32 products beside it, so those matrices run the
    5B 720p FFN in three chunks where bf16 and fp8 run it whole; the chunks the phase takes
    follow (counted at its first layer's calls)."""
    from wan_enhanced.quant import SCHEMES
    from wan_enhanced.wan import chunks
    bf16 = torch.bfloat16
    plain = torch.nn.Linear(8, 16)
    int8 = SCHEMES["int8_dynamic"].quantize(plain)
    assert chunks.hidden_bytes(plain, bf16) == 2
    assert chunks.hidden_bytes(SCHEMES["fp8_e4m3fn_fast"].quantize(plain), bf16) == 2
    assert chunks.hidden_bytes(SCHEMES["int8"].quantize(plain), bf16) == 2  # weight-only
    assert chunks.hidden_bytes(int8, bf16) == 6
    from wan_enhanced.lora.layers import LoraLinear
    assert chunks.hidden_bytes(LoraLinear(int8), bf16) == 6  # a LoRA'd layer: what its base holds
    assert chunks.hidden_bytes(LoraLinear(plain), bf16) == 2
    assert len(chunks.ffn_chunks(27280, 1, 14336, 2)) == 1
    assert len(chunks.ffn_chunks(27280, 1, 14336, 6)) == 3

    model = _tiny()
    block = model.blocks[0]
    width = block.ffn[0].out_features
    x = torch.randn(1, 40, model.config.dim)
    e0 = torch.randn(1, 1, 6, model.config.dim)
    calls = []
    block.ffn[0].register_forward_hook(lambda *args: calls.append(args[1][0].shape[1]))
    # 40 rows of float32 (4 bytes) fit; of 12 bytes (a layer holding 8 more) they take 3 chunks
    monkeypatch.setattr(chunks, "FFN_HIDDEN_BYTES", 40 * width * 5)
    with torch.no_grad():
        whole = block.feed_forward_phase(x.clone(), e0, torch.float32)
        assert calls == [40]
        monkeypatch.setattr(block.ffn[0], "output_bytes", lambda dtype: dtype.itemsize + 8,
                            raising=False)
        chunked = block.feed_forward_phase(x.clone(), e0, torch.float32)
    assert calls[1:] == [14, 14, 12]
    assert (chunked - whole).abs().max() <= 2e-6 * whole.abs().max()
