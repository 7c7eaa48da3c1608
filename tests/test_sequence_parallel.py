"""Sequence parallel over gloo processes equals the single-process DiT to float32 rounding:
Ulysses and ring, head counts that do and do not divide, lengths that do not divide, every
timestep form, batch 2, image-to-video inputs; plus the shard arithmetic it rests on."""

import math

import pytest
import torch
import torch.nn.functional as F

from wan_enhanced.distributed.contracts import ForwardCase, ForwardRequest, ModelSpec
from wan_enhanced.distributed.layout import SequenceLayout, group_rows_for
from wan_enhanced.distributed.lse_attention import _plain, attention_with_lse, merge
from wan_enhanced.distributed.sequence_split import (LocalRotaryTable, _group_table,
                                                     choose_mode)
from wan_enhanced.wan.configs import DiTConfig
from wan_enhanced.wan.dit import WanDiT
from wan_enhanced.wan.rope import RotaryTable

TIMEOUT = 120


# -- the arithmetic, in this process -------------------------------------------------------------

@pytest.mark.parametrize("length,world,multiple", [(48, 2, 1), (45, 2, 1), (45, 3, 1), (5, 3, 1),
                                                   (4, 3, 1), (45, 2, 5), (30, 4, 5)])
def test_layout_covers_every_row_once(length, world, multiple):
    layouts = [SequenceLayout.make(length, world, r, multiple) for r in range(world)]
    shard = layouts[0].shard
    assert shard % multiple == 0 and shard * world >= length
    assert shard * world - length < world * multiple  # no more padding than needed
    rows = [row for lay in layouts for row in range(lay.start, lay.start + lay.valid_rows())]
    assert rows == list(range(length))
    assert all(lay.shard == shard for lay in layouts)


def _per_row(table, length):
    """A [B, G, ...] group table expanded to one row per token."""
    return table.repeat_interleave(length // table.shape[1], dim=1)


@pytest.mark.parametrize("grid,world", [((3, 3, 5), 2), ((3, 4, 4), 3), ((5, 2, 3), 4)])
@pytest.mark.parametrize("form", ["frame", "token"])
def test_local_tables_follow_global_position(grid, world, form):
    length = math.prod(grid)
    groups = grid[0] if form == "frame" else length
    table = torch.randn(2, groups, 6, 8)
    whole = _per_row(table, length)
    for rank in range(world):
        layout = SequenceLayout.make(length, world, rank, grid[2] if form == "frame" else 1)
        local = _group_table(table, layout, groups)
        assert layout.shard % local.shape[1] == 0
        if form == "frame":
            assert group_rows_for(length, groups, layout.shard) >= grid[2]
        rows = _per_row(local, layout.shard)
        real = layout.valid_rows()
        assert torch.equal(rows[:, :real], whole[:, layout.start:layout.start + real])


def test_local_rotary_rows_and_identity_padding():
    table = RotaryTable((3, 3, 5), (6, 5, 5))
    layout = SequenceLayout.make(45, 2, 1)  # rows 23..44 and one padding row
    local = LocalRotaryTable(table, layout)
    assert torch.equal(local.cos[:22], table.cos[23:])
    assert torch.equal(local.cos[22], torch.ones_like(local.cos[22]))
    assert torch.equal(local.sin[22], torch.zeros_like(local.sin[22]))
    x = torch.randn(1, 23, 2, 32)
    assert torch.equal(local.rotate(x)[:, :22], table.rotate(x[:, :22], 23))


def test_mode_choice():
    assert choose_mode(40, 2) == "ulysses" and choose_mode(40, 3) == "ring"
    assert choose_mode(12, 8) == "ring" and choose_mode(12, 4, "ring") == "ring"
    with pytest.raises(ValueError, match="divide"):
        choose_mode(12, 8, "ulysses")


def test_attention_with_lse_and_merging():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 7, 3, 16), torch.randn(2, 11, 3, 16), torch.randn(2, 11, 3, 16)
    full = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    out, lse = attention_with_lse(q, k, v)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-6)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k) / 4.0
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-5)
    plain_out, plain_lse = _plain(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(plain_out.transpose(1, 2), full, rtol=0, atol=1e-6)
    a = attention_with_lse(q, k[:, :4], v[:, :4])
    b = attention_with_lse(q, k[:, 4:], v[:, 4:])
    merged, merged_lse = merge(*a, *b)
    torch.testing.assert_close(merged, full, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=1e-5)


# -- over gloo processes ---------------------------------------------------------------------------

def _model(heads: int, **kw) -> WanDiT:
    torch.manual_seed(heads)
    config = DiTConfig(dim=24 * heads, ffn_dim=64, num_heads=heads, num_layers=2, **kw)
    model = WanDiT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _spec(model: WanDiT) -> ModelSpec:
    return ModelSpec(config=model.config.to_dict(), state=model.state_dict())


def _check(group, model, cases, mode="auto", tolerance=2e-6):
    request = ForwardRequest(_spec(model), tuple(cases), mode=mode)
    result = group.run(".distributed.tasks:forward", request, timeout_s=TIMEOUT)
    for case, out in zip(cases, result.outputs):
        with torch.no_grad():
            reference = model(case.x, case.t, case.context, y=case.y,
                              clip_tokens=case.clip_tokens)
        assert out.shape == reference.shape
        error = ((out - reference).abs().max() / reference.abs().max()).item()
        assert error <= tolerance, f"relative error {error:.2e}"
    return result


# (world, heads, mode): heads that divide (Ulysses) and that do not (ring); ring forced where
# Ulysses would do
CASES = [(2, 2, "auto"), (2, 3, "auto"), (3, 3, "auto"), (3, 2, "auto"), (2, 4, "ring"),
         (3, 6, "ring")]


@pytest.mark.parametrize("world,heads,mode", CASES)
def test_split_equals_single_process(gloo_group, world, heads, mode):
    model = _model(heads)
    torch.manual_seed(1)
    context = torch.randn(1, 9, 4096)
    cases = [ForwardCase(torch.randn(1, 16, 3, 6, 10), torch.tensor([611.0]), context),  # 45 rows
             ForwardCase(torch.randn(2, 16, 2, 4, 8), torch.tensor([300.0, 800.0]),
                         torch.randn(2, 5, 4096))]  # batch 2 (cond and uncond), 16 rows
    result = _check(gloo_group(world), model, cases, mode)
    expected = "all_to_all" if mode == "auto" and heads % world == 0 else "ring"
    used = {kind for m in result.metrics for kind in ("all_to_all", "ring") if m[f"{kind}_calls"]}
    assert used == {expected}
    assert [m["rank"] for m in result.metrics] == list(range(world))


@pytest.mark.parametrize("world", [2, 3])
def test_per_frame_and_per_token_timesteps(gloo_group, world):
    """TI2V: frame 0 at t=0 (per frame, rounded shards), and per-token timesteps that no frame
    grouping can hold."""
    model = _model(2, in_dim=48, out_dim=48)
    torch.manual_seed(2)
    x = torch.randn(1, 48, 3, 6, 10)
    per_frame = torch.tensor([[0.0, 611.0, 611.0]])
    per_token = torch.linspace(0, 999, 45)[None]
    context = torch.randn(1, 7, 4096)
    _check(gloo_group(world), model, [ForwardCase(x, per_frame, context),
                                      ForwardCase(x, per_token, context)])


def test_image_to_video_inputs(gloo_group):
    """Wan2.1 I2V: conditioning channels and CLIP image tokens (cross-attention stays local)."""
    model = _model(2, in_dim=36, image_embedding=True, image_dim=32)
    torch.manual_seed(3)
    case = ForwardCase(torch.randn(1, 16, 2, 6, 6), torch.tensor([700.0]),
                       torch.randn(1, 6, 4096), y=torch.randn(1, 20, 2, 6, 6),
                       clip_tokens=torch.randn(1, 257, 32))
    _check(gloo_group(3), model, [case])


def test_communication_is_counted(gloo_group):
    """Ulysses moves q, k, v out and the output back, (world-1)/world of each per block; the
    output gather moves the other shards' rows."""
    model = _model(2)
    x = torch.randn(1, 16, 2, 4, 8)  # 16 rows: 8 per rank
    case = ForwardCase(x, torch.tensor([500.0]), torch.randn(1, 4, 4096))
    result = _check(gloo_group(2), model, [case])
    m = result.metrics[0]
    shard_bytes = 1 * 8 * model.config.dim * 4  # one tensor of this rank's rows, float32
    per_block = (3 * shard_bytes + shard_bytes) // 2
    assert m["all_to_all_bytes"] == per_block * model.config.num_layers
    assert m["all_to_all_calls"] == 2 * model.config.num_layers
    # 8 rows of 64 head outputs (patch 1x2x2 of 16 channels) from the other rank
    assert m["gather_bytes"] == 8 * 64 * 4
    assert m["forwards"] == 1 and m["forward_seconds"] >= m["all_to_all_seconds"]
    assert m["compute_seconds"] > 0 and m["request_total_seconds"] >= m["forward_seconds"]


@pytest.mark.skipif(not (__import__("shutil").which("c++") or __import__("shutil").which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_split(gloo_group):
    """The loader's compile option with the sequence split: the compiled graph breaks at the
    sequence-wide attention (run eagerly with its collectives) and compiles the rest."""
    model = _model(2)
    torch.manual_seed(5)
    case = ForwardCase(torch.randn(1, 16, 3, 6, 10), torch.tensor([[0.0, 500.0, 500.0]]),
                       torch.randn(1, 7, 4096))
    request = ForwardRequest(ModelSpec(config=model.config.to_dict(), state=model.state_dict(),
                                       compile=True), (case,))
    out = gloo_group(2).run(".distributed.tasks:forward", request, timeout_s=600).outputs[0]
    with torch.no_grad():
        reference = model(case.x, case.t, case.context)
    assert (out - reference).abs().max() / reference.abs().max() < 2e-6
