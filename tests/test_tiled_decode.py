"""Tiled decode: the tile grid, exactness against the untiled decode, seam blending, the IMAGE
format, interrupts that leave nothing behind, and the tile size chosen from a memory budget."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn

from wan_enhanced.checkpoints.tiny import TINY_VAE, random_vae_state
from wan_enhanced.vae_tiling import decode as decode_module
from wan_enhanced.vae_tiling.budget import DecodeCost, estimate_decode_bytes, plan_budget_tiles
from wan_enhanced.vae_tiling.decode import decode_to_images
from wan_enhanced.vae_tiling.tiles import (Span, axis_spans, axis_weights, even_spans,
                                           latent_tile_and_stride, plan_even_tiles, plan_tiles)
from wan_enhanced.wan.vae21 import WanVAE21
from wan_enhanced.wan.vae22 import WanVAE22

# Latent (h, w) and (x, y) tile / stride in pixels per VAE: several tiles in both directions,
# and for Wan2.2 a last column moved back so that three columns overlap.
CASES = {
    "vae21": dict(hw=(12, 16), tile=(64, 64), stride=(32, 32)),
    "vae22": dict(hw=(8, 10), tile=(96, 96), stride=(48, 48)),
}


def build_vae(kind: str) -> nn.Module:
    vae = {"vae21": WanVAE21, "vae22": WanVAE22}[kind](**TINY_VAE[kind])
    vae.load_state_dict(random_vae_state(kind))
    return vae.eval()


def as_images(video: torch.Tensor) -> torch.Tensor:
    """Decoded [B, 3, F, H, W] -> [B, F, H, W, 3] in 0..1, as the node's output."""
    return video.clamp(-1, 1).add(1).mul(0.5).permute(0, 2, 3, 4, 1)


def random_latent(vae: nn.Module, hw, frames: int = 2, batch: int = 1, seed: int = 1):
    return torch.randn(batch, vae.z_dim, frames, *hw, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(CASES))
def decoded(request):
    """A tiny random VAE, a latent, its untiled and tiled decodes, and each tile decoded alone."""
    kind = request.param
    case = CASES[kind]
    vae = build_vae(kind)
    latent = random_latent(vae, case["hw"])
    untiled = as_images(vae.decode(latent))
    tiled = decode_to_images(vae, latent, tile=case["tile"], stride=case["stride"])
    grid = plan_tiles(*case["hw"], vae.spatial_stride, case["tile"], case["stride"])
    alone = [as_images(vae.decode(tile.latent_of(latent))) for tile in grid]
    return dict(kind=kind, vae=vae, latent=latent, untiled=untiled,
                tiled=tiled.view(untiled.shape), grid=grid, alone=alone)


# -- stand-in VAEs with known outputs ------------------------------------------------------------

class StubVAE(nn.Module):
    """Decodes each latent pixel to an 8x8 block of its first three channels, frame k of a chunk
    shifted by 0.01 k. With `context`, every tile also gets the mean of its channel 3 added: a
    stand-in for the frame-wide attention, whose output depends on the whole tile. With
    `constant`, every pixel is that value."""

    spatial_stride, temporal_stride, z_dim = 8, 4, 4

    def __init__(self, context: bool = False, constant: float | None = None) -> None:
        super().__init__()
        self.context, self.constant = context, constant
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the decode a device and dtype

    def decode_frames(self, mu):
        s = self.spatial_stride
        for t in range(mu.shape[2]):
            x = mu[:, :3, t:t + 1]
            if self.context:
                x = x + mu[:, 3:4, t:t + 1].mean(dim=(-2, -1), keepdim=True)
            x = x.repeat_interleave(s, dim=-2).repeat_interleave(s, dim=-1)
            steps = torch.arange(1 if t == 0 else self.temporal_stride).view(1, 1, -1, 1, 1)
            chunk = x + 0.01 * steps
            yield torch.full_like(chunk, self.constant) if self.constant is not None else chunk


# -- (a) one tile is the untiled decode ----------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_single_tile_equals_the_untiled_decode(kind):
    vae = build_vae(kind)
    latent = random_latent(vae, (5, 6))
    reference = as_images(vae.decode(latent)).reshape(-1, 5 * vae.spatial_stride,
                                                      6 * vae.spatial_stride, 3)
    untiled = decode_to_images(vae, latent, tiled=False)
    one_tile = decode_to_images(vae, latent, tile=(512, 512), stride=(256, 256))
    assert torch.equal(untiled, reference)
    assert torch.equal(one_tile, reference)


# -- (b) tiled against untiled on a random VAE ---------------------------------------------------

def test_b_tiled_output_is_the_feathered_blend_of_the_tiles(decoded):
    """The whole difference to the untiled decode comes from each tile's own (smaller) context:
    blending the tiles decoded one by one with the grid's weights gives the engine's output."""
    blend = torch.zeros_like(decoded["untiled"])
    scale = decoded["vae"].spatial_stride
    for tile, image in zip(decoded["grid"], decoded["alone"]):
        blend[:, :, tile.rows.pixels(scale), tile.cols.pixels(scale)] += (
            image * tile.weights()[..., None])
    assert (decoded["tiled"] - blend).abs().max() <= 1e-6


def test_b_tiled_error_is_bounded_by_the_tiles_own_error(decoded):
    """Weights are positive and sum to 1, so each output pixel is a convex combination of the
    tiles covering it and its error can never exceed the worst of those tiles' own errors."""
    untiled, scale = decoded["untiled"], decoded["vae"].spatial_stride
    worst_tile = torch.zeros_like(untiled)
    for tile, image in zip(decoded["grid"], decoded["alone"]):
        rows, cols = tile.rows.pixels(scale), tile.cols.pixels(scale)
        own = (image - untiled[:, :, rows, cols]).abs()
        worst_tile[:, :, rows, cols] = torch.maximum(worst_tile[:, :, rows, cols], own)
    error = (decoded["tiled"] - untiled).abs()
    print(f"{decoded['kind']}: tiled vs untiled max {error.max():.4f}, mean {error.mean():.4f}; "
          f"a single tile's own error max {worst_tile.max():.4f}, mean {worst_tile.mean():.4f}")
    assert (error <= worst_tile + 1e-6).all()


def test_b_feathering_beats_hard_seams(decoded):
    """The ramps weight each tile's well-informed middle over its context-starved border: the
    mean error is below that of a mosaic that cuts every overlap in the middle (hard seams)."""
    untiled, scale = decoded["untiled"], decoded["vae"].spatial_stride
    height, width = untiled.shape[2:4]
    mosaic = torch.zeros_like(untiled)
    nearest = torch.full((height, width), float("inf"))  # distance to the owning tile's centre
    for tile, image in zip(decoded["grid"], decoded["alone"]):
        rows, cols = tile.rows.pixels(scale), tile.cols.pixels(scale)
        y = torch.arange(rows.start, rows.stop).view(-1, 1) + 0.5 - (rows.start + rows.stop) / 2
        x = torch.arange(cols.start, cols.stop).view(1, -1) + 0.5 - (cols.start + cols.stop) / 2
        distance = torch.maximum(y.abs(), x.abs())
        closer = distance < nearest[rows, cols]
        nearest[rows, cols] = torch.where(closer, distance, nearest[rows, cols])
        mosaic[:, :, rows, cols] = torch.where(closer[..., None], image, mosaic[:, :, rows, cols])
    feathered = (decoded["tiled"] - untiled).abs()
    hard = (mosaic - untiled).abs()
    print(f"{decoded['kind']}: mean error feathered {feathered.mean():.4f}, "
          f"hard seams {hard.mean():.4f}; max feathered {feathered.max():.4f}, "
          f"hard seams {hard.max():.4f}")
    assert feathered.mean() < hard.mean()
    assert feathered.max() < hard.max()


# -- (c) seams are blended -----------------------------------------------------------------------

def test_c_weights_are_positive_and_sum_to_one():
    for hw, tile, stride in [((12, 16), (64, 64), (32, 32)), ((20, 23), (64, 48), (40, 24)),
                             ((7, 9), (32, 32), (8, 8))]:
        grid = plan_tiles(*hw, 8, tile, stride)
        total = torch.zeros(hw[0] * 8, hw[1] * 8, dtype=torch.float64)
        for t in grid:
            weights = t.weights()
            assert (weights > 0).all()
            total[t.rows.pixels(8), t.cols.pixels(8)] += weights
        assert (total - 1).abs().max() <= 1e-6


def test_c_a_constant_colour_stays_constant():
    latent = torch.zeros(1, 4, 2, 12, 17)
    out = decode_to_images(StubVAE(constant=0.4), latent, tile=(48, 64), stride=(24, 40))
    assert (out - 0.7).abs().max() <= 1e-6


def test_c_no_jump_at_tile_borders():
    """Tiles that disagree by a per-tile offset (as attention context differs between tiles)
    meet in a linear cross-fade: a step between neighbouring pixels is at most the offsets'
    spread over the ramp width (n + 1 steps), where hard seams would jump by the whole spread."""
    latent = torch.zeros(1, 4, 1, 12, 16)
    latent[:, 3] = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))  # offsets
    vae = StubVAE(context=True)
    tile, stride = (64, 64), (32, 32)  # 32 px overlaps, never three tiles on one pixel
    out = decode_to_images(vae, latent, tile=tile, stride=stride)[0, ..., 0]
    grid = plan_tiles(12, 16, 8, tile, stride)
    offsets = torch.stack([0.5 * t.latent_of(latent)[0, 3].mean() for t in grid])
    spread = float(offsets.max() - offsets.min())
    steps = torch.cat([(out[1:] - out[:-1]).abs().flatten(),
                       (out[:, 1:] - out[:, :-1]).abs().flatten()])
    overlap = 32
    assert spread > 0.1  # hard seams would jump by up to this much
    assert steps.max() <= spread / (overlap + 1) + 1e-6


# -- (d) the tile grid ---------------------------------------------------------------------------

def test_d_pixels_to_latent_units():
    assert latent_tile_and_stride(272, 144, 8, "x") == (34, 18)
    assert latent_tile_and_stride(272, 128, 16, "y") == (17, 8)
    assert latent_tile_and_stride(100, 50, 16) == (6, 3)  # 6.25 -> 6; the stride rounds down
    assert latent_tile_and_stride(104, 50, 16) == (7, 3)  # 6.5 -> 7
    assert latent_tile_and_stride(40, 8, 16) == (3, 1)  # a stride under one latent pixel -> 1
    tile, stride = latent_tile_and_stride(34, 33, 16)  # 2.1 and 2.06 latent pixels
    assert stride < tile  # kept overlapping after rounding


@pytest.mark.parametrize("tile, stride, field", [
    ((272, 272), (272, 128), "stride_x"),
    ((272, 272), (144, 300), "stride_y"),
    ((0, 272), (144, 128), "tile_x"),
    ((272, 272.0), (144, 128), "tile_y"),
    ((272, 272), (-1, 128), "stride_x"),
    ((16, 272), (8, 128), "tile_x"),  # one 16 px latent pixel of Wan2.2 cannot overlap
])
def test_d_bad_sizes_name_the_field(tile, stride, field):
    with pytest.raises(ValueError, match=field):
        plan_tiles(20, 20, 16, tile, stride)


@pytest.mark.parametrize("size, tile, stride", [
    (16, 8, 4), (12, 8, 4), (10, 6, 3), (50, 34, 18), (90, 34, 16), (35, 34, 18), (7, 8, 4),
    (8, 8, 4), (9, 2, 1)])
def test_d_spans_cover_the_axis_and_end_at_the_border(size, tile, stride):
    spans = axis_spans(size, tile, stride)
    covered = torch.zeros(size, dtype=torch.bool)
    for span in spans:
        covered[span.start:span.stop] = True
        assert span.size == min(tile, size)  # no partial tiles
    assert covered.all()
    assert spans[0].start == 0 and spans[-1].stop == size
    starts = [span.start for span in spans]
    assert starts == sorted(set(starts))
    for before, after in zip(spans, spans[1:]):
        assert after.start < before.stop  # neighbours overlap
        assert after.start - before.start <= stride


def test_d_frame_smaller_than_a_tile_is_one_tile():
    assert axis_spans(5, 34, 18) == (Span(0, 5),)
    grid = plan_tiles(5, 7, 8)  # 40 x 56 px under the 272 px default tile
    assert len(grid) == 1 and (grid.tiles[0].weights() == 1).all()


def disjoint(a: Span, b: Span) -> bool:
    return a.stop <= b.start or b.stop <= a.start


def test_d_each_pixel_is_finished_by_exactly_one_tile():
    """The part of each tile that no later tile covers: where the canvas clamps, once per pixel."""
    grid = plan_tiles(20, 23, 8, (64, 48), (40, 24))
    finished = torch.zeros(20, 23, dtype=torch.int64)
    for index, tile in enumerate(grid):
        finished[tile.last_rows.start:tile.last_rows.stop,
                 tile.last_cols.start:tile.last_cols.stop] += 1
        for later in grid.tiles[index + 1:]:  # no later tile overlaps the finished part
            assert (disjoint(later.rows, tile.last_rows) or disjoint(later.cols, tile.last_cols))
    assert (finished == 1).all()


def test_d_ramps_cover_the_overlap_only():
    left, right = axis_weights((Span(0, 8), Span(4, 12)), 8)  # 32 px overlap at 32..63
    ramp = torch.arange(1, 33, dtype=torch.float64) / 33
    assert (left[:32] == 1).all() and (right[32:] == 1).all()  # flat, image borders included
    assert torch.allclose(right[:32].double(), ramp, atol=1e-7)
    assert torch.allclose(left[32:].double(), ramp.flip(0), atol=1e-7)


# -- (e) the IMAGE format ------------------------------------------------------------------------

def test_e_image_format(decoded):
    latent, tiled = decoded["latent"], decoded["tiled"]
    frames = 1 + 4 * (latent.shape[2] - 1)
    out = tiled.reshape(-1, *tiled.shape[2:])
    scale = decoded["vae"].spatial_stride
    assert out.shape == (frames, latent.shape[3] * scale, latent.shape[4] * scale, 3)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert out.min() >= 0 and out.max() <= 1


def test_e_frames_and_batch_order():
    latent = torch.rand(2, 4, 3, 6, 7, generator=torch.Generator().manual_seed(0)) - 0.5
    out = decode_to_images(StubVAE(), latent, tile=(32, 32), stride=(16, 16))
    assert out.shape == (2 * 9, 48, 56, 3)
    expected = torch.cat(list(StubVAE().decode_frames(latent)), dim=2)
    assert torch.allclose(out, as_images(expected).reshape(out.shape), atol=1e-6)
    # batch item 0 first: its frames come from latent[0] only
    alone = decode_to_images(StubVAE(), latent[:1], tile=(32, 32), stride=(16, 16))
    assert torch.equal(out[:9], alone)


def test_e_progress_counts_tile_chunks():
    calls = []
    decode_to_images(StubVAE(), torch.zeros(1, 4, 3, 6, 7), tile=(32, 32), stride=(16, 16),
                     progress=lambda done, total: calls.append((done, total)))
    tiles = len(plan_tiles(6, 7, 8, (32, 32), (16, 16)))
    assert calls == [(i, tiles * 3) for i in range(1, tiles * 3 + 1)]


def test_e_bad_inputs_name_the_field():
    vae = StubVAE()
    with pytest.raises(ValueError, match="latent"):
        decode_to_images(vae, torch.zeros(1, 16, 2, 4, 4))
    with pytest.raises(ValueError, match="latent"):
        decode_to_images(vae, torch.zeros(4, 2, 4, 4))
    with pytest.raises(ValueError, match="dtype"):
        decode_to_images(vae, torch.zeros(1, 4, 2, 4, 4), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device"):
        decode_to_images(vae, torch.zeros(1, 4, 2, 4, 4), device="meta")
    assert decode_to_images(vae, torch.zeros(1, 4, 2, 4, 4), device="cpu",
                            dtype=torch.float32).shape == (5, 32, 32, 3)


# -- (f) interrupts ------------------------------------------------------------------------------

class Stop(Exception):
    pass


def test_f_interrupt_aborts_and_leaves_nothing_referenced(monkeypatch):
    vae = build_vae("vae21")
    latent = random_latent(vae, (8, 8), frames=3)
    alive: list[weakref.ref] = []

    decode_frames = vae.decode_frames

    def spy_decode_frames(mu):
        for chunk in decode_frames(mu):
            alive.append(weakref.ref(chunk))
            yield chunk

    weighted_image = decode_module.weighted_image

    def spy_weighted_image(chunk, half_weights):
        image = weighted_image(chunk, half_weights)
        alive.extend([weakref.ref(image), weakref.ref(half_weights)])
        return image

    class SpyCanvas(decode_module.ImageCanvas):
        def __init__(self, *args):
            super().__init__(*args)
            alive.append(weakref.ref(self.frames))

    monkeypatch.setattr(vae, "decode_frames", spy_decode_frames)
    monkeypatch.setattr(decode_module, "weighted_image", spy_weighted_image)
    monkeypatch.setattr(decode_module, "ImageCanvas", SpyCanvas)
    calls = 0

    def check_interrupt():
        nonlocal calls
        calls += 1
        if calls == 5:  # the second chunk of the second tile
            raise Stop

    with pytest.raises(Stop) as caught:
        decode_to_images(vae, latent, tile=(48, 48), stride=(24, 24),
                         check_interrupt=check_interrupt)
    assert calls == 5 and len(alive) > 10
    # The exception and its traceback are still held here, yet nothing of the decode is.
    assert caught.value.__traceback__ is not None
    assert [ref for ref in alive if ref() is not None] == []

    monkeypatch.undo()
    assert decode_to_images(vae, latent, tile=(48, 48), stride=(24, 24)).shape == (9, 64, 64, 3)


@pytest.mark.gpu
def test_f_cuda_decode_matches_the_cpu_and_frees_everything():
    vae = build_vae("vae21")
    latent = random_latent(vae, (12, 16), frames=3)
    on_cpu = decode_to_images(vae, latent, tile=(64, 64), stride=(32, 32))
    vae.cuda()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # compare float32 with float32, not TF32 rounding
    try:
        # The first decode creates the process's cuBLAS / cuDNN workspaces, which stay by design;
        # from then on a decode must leave exactly what it found.
        decode_to_images(vae, latent, tile=(64, 64), stride=(32, 32))
        baseline = torch.cuda.memory_allocated()
        on_cuda = decode_to_images(vae, latent, tile=(64, 64), stride=(32, 32))
        assert on_cuda.device.type == "cpu" and (on_cuda - on_cpu).abs().max() <= 1e-4
        assert torch.cuda.memory_allocated() == baseline

        def stop():
            raise Stop

        with pytest.raises(Stop):
            decode_to_images(vae, latent, tile=(64, 64), stride=(32, 32), check_interrupt=stop)
        assert torch.cuda.memory_allocated() == baseline
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        vae.cpu()


# -- (g) Wan2.2 ----------------------------------------------------------------------------------

def test_g_wan22_decodes_at_16x():
    vae = build_vae("vae22")
    assert vae.spatial_stride == 16
    latent = random_latent(vae, (5, 7), frames=2)
    out = decode_to_images(vae, latent, tile=(48, 64), stride=(32, 32))
    assert out.shape == (5, 80, 112, 3)
    assert out.min() >= 0 and out.max() <= 1


# -- tile size from a memory budget --------------------------------------------------------------

@pytest.fixture(scope="module", params=["vae21", "vae22"])
def real_size_vae(request):
    with torch.device("meta"):  # the released widths, no weights
        return {"vae21": WanVAE21, "vae22": WanVAE22}[request.param]()


def brute_force_least_work(vae, height, width, budget, overlap):
    """(work, tiles) of the best grid, by trying every count of even tiles along each axis."""
    cost, best = DecodeCost(vae, 1, torch.bfloat16), None
    for rows in range(1, height + 1):
        for cols in range(1, width + 1):
            try:
                tile_h = even_spans(height, rows, overlap)[0].size
                tile_w = even_spans(width, cols, overlap)[0].size
            except ValueError:
                continue
            if cost.bytes(tile_h, tile_w) <= budget:
                candidate = (rows * tile_h * cols * tile_w, rows * cols)
                best = candidate if best is None else min(best, candidate)
    return best


@pytest.mark.parametrize("gib", [0.5, 1, 2, 4])
def test_budget_grid_does_the_least_work_that_fits(real_size_vae, gib):
    vae, scale = real_size_vae, real_size_vae.spatial_stride
    shape = (1, vae.z_dim, 21, 720 // scale, 1280 // scale)
    budget = int(gib * (1 << 30))
    grid = plan_budget_tiles(vae, shape, budget, torch.bfloat16, overlap=64)
    overlap = 64 // scale
    for tile in grid:
        assert estimate_decode_bytes(vae, (tile.rows.size, tile.cols.size), 1,
                                     torch.bfloat16) <= budget
    for spans in (grid.rows, grid.cols):
        assert spans[0].start == 0 and spans[-1].stop == (shape[3] if spans is grid.rows
                                                          else shape[4])
        assert all(a.stop - b.start >= overlap for a, b in zip(spans, spans[1:]))
        assert len({span.size for span in spans}) == 1
    work = sum(t.rows.size * t.cols.size for t in grid)
    assert (work, len(grid)) == brute_force_least_work(vae, shape[3], shape[4], budget, overlap)


def test_budget_grid_grows_with_the_budget_and_ends_untiled(real_size_vae):
    vae, scale = real_size_vae, real_size_vae.spatial_stride
    shape = (1, vae.z_dim, 21, 704 // scale, 1280 // scale)
    counts = [len(plan_budget_tiles(vae, shape, gib << 30, torch.bfloat16)) for gib in (1, 2, 4, 8)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 1
    assert len(plan_budget_tiles(vae, shape, 1 << 40, torch.bfloat16)) == 1


def test_budget_grid_rejects_bad_input(real_size_vae):
    shape = (1, real_size_vae.z_dim, 21, 44, 80)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_budget_tiles(real_size_vae, shape, 1 << 20, torch.bfloat16)
    with pytest.raises(ValueError, match="latent_shape"):
        plan_budget_tiles(real_size_vae, (44, 80), 1 << 30, torch.bfloat16)
    with pytest.raises(ValueError, match="overlap"):
        plan_budget_tiles(real_size_vae, shape, 1 << 30, torch.bfloat16, overlap=0)


def test_a_planned_grid_is_used_as_given_and_must_fit_the_latent():
    vae = build_vae("vae21")
    latent = random_latent(vae, (12, 16))
    grid = plan_even_tiles(12, 16, vae.spatial_stride, 2, 3, 2)
    by_grid = decode_to_images(vae, latent, grid=grid)
    assert by_grid.shape == decode_to_images(vae, latent, tiled=False).shape
    with pytest.raises(ValueError, match="grid: planned for a 12x16 latent"):
        decode_to_images(vae, random_latent(vae, (8, 16)), grid=grid)


def test_even_spans_cover_the_axis_with_at_least_the_overlap():
    for size in (7, 20, 45, 90):
        for count in range(1, 8):
            for overlap in (1, 2, 5):
                try:
                    spans = even_spans(size, count, overlap)
                except ValueError:
                    assert count > 1
                    continue
                assert len(spans) == count and spans[0].start == 0 and spans[-1].stop == size
                assert len({s.size for s in spans}) == 1
                gaps = [a.stop - b.start for a, b in zip(spans, spans[1:])]
                assert all(overlap <= g for g in gaps)
                assert all(s.size > g for s, g in zip(spans, gaps))


def test_decode_from_a_budget_uses_the_planned_grid(monkeypatch):
    vae = build_vae("vae21")
    latent = random_latent(vae, (12, 16))
    planned = []
    real_plan = decode_module.plan_budget_tiles

    def spy(*args, **kwargs):
        planned.append(real_plan(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(decode_module, "plan_budget_tiles", spy)
    budget = estimate_decode_bytes(vae, (8, 10), 1, torch.float32)
    out = decode_to_images(vae, latent, budget_bytes=budget, overlap=16)
    (grid,) = planned
    assert len(grid) > 1
    assert all(estimate_decode_bytes(vae, (t.rows.size, t.cols.size), 1, torch.float32) <= budget
               for t in grid)
    # The same grid through the tile/stride path gives the same images, bit for bit.
    monkeypatch.setattr(decode_module, "plan_tiles", lambda *args, **kwargs: grid)
    assert torch.equal(out, decode_to_images(vae, latent, tile=(64, 64), stride=(32, 32)))
    untiled = decode_to_images(vae, latent, tiled=False)
    assert out.shape == untiled.shape and not torch.equal(out, untiled)


def test_default_tile_fits_the_memory_target():
    """The 272 px default tile of Wan2.1 at 720p is estimated well under the 2 GiB target, the
    weights (127 M parameters in bf16) included."""
    with torch.device("meta"):
        vae = WanVAE21()
    weights = sum(p.numel() for p in vae.parameters()) * 2
    assert estimate_decode_bytes(vae, (34, 34), 1, torch.bfloat16) + weights < 2 << 30


def test_the_budget_counts_the_channels_last_decode_by_its_own_calibration(real_size_vae):
    """The decoder in channels_last_3d (the CUDA decode) holds less than in NCDHW: its count
    takes its own measured factor, so a budget fits larger tiles (never more of them)."""
    from wan_enhanced.vae_tiling import budget

    vae = real_size_vae
    name = type(vae.decoder).__name__
    shape = (1, vae.z_dim, 31, 704 // vae.spatial_stride, 1280 // vae.spatial_stride)
    ncdhw = DecodeCost(vae, 1, torch.bfloat16)
    grid = plan_budget_tiles(vae, shape, 3 << 30, torch.bfloat16)
    vae.decode_memory_format = torch.channels_last_3d  # as CUDA runs it
    try:
        channels_last = DecodeCost(vae, 1, torch.bfloat16)
        fewer = plan_budget_tiles(vae, shape, 3 << 30, torch.bfloat16)
    finally:
        vae.decode_memory_format = None
    assert ncdhw.calibration == budget.MEASURED_OVER_COUNTED[(name, "ncdhw")]
    assert channels_last.calibration == budget.MEASURED_OVER_COUNTED[(name, "channels_last")]
    assert channels_last.calibration < ncdhw.calibration
    ratio = channels_last.bytes(20, 30) / ncdhw.bytes(20, 30)
    assert ratio == pytest.approx(channels_last.calibration / ncdhw.calibration, rel=1e-6)
    assert len(fewer) <= len(grid)
    assert budget.decode_layout_name(torch.nn.Linear(2, 2)) == "ncdhw"  # no decoder layout
