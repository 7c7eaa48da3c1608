"""The tile grid of a tiled decode: where the spatial tiles lie and how their outputs blend.

Tiles are laid out in latent units (a tile must start and end on latent pixels) and blended in
pixel units, on each tile's decoded output. Along each axis a tile ramps its weight linearly
across the overlap with a neighbouring tile and keeps weight 1 elsewhere, image borders included
(there the tile is the only source, so fading it would only lose precision). The weights of the
tiles that cover a pixel are then divided by their sum, so they add up to 1 everywhere.

Horizontal and vertical weights are independent, so a tile's 2D weight is the outer product of
its row and column weights, and the normalisation can be done axis by axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch


@dataclass(frozen=True)
class Span:
    """A tile's extent along one axis, in latent units: [start, stop)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def pixels(self, scale: int) -> slice:
        return slice(self.start * scale, self.stop * scale)


@dataclass(frozen=True, eq=False)
class Tile:
    """One spatial tile: its latent rows and columns, its normalised pixel blend weights, and
    the part of it that no later tile of the grid covers (its blend is complete once this tile
    is added, when tiles are added in grid order)."""

    rows: Span
    cols: Span
    row_weights: torch.Tensor  # [tile height in pixels], float32
    col_weights: torch.Tensor  # [tile width in pixels], float32
    last_rows: Span
    last_cols: Span

    def latent_of(self, latent: torch.Tensor) -> torch.Tensor:
        """This tile's part of a latent [..., h, w] (a view, all frames)."""
        return latent[..., self.rows.start:self.rows.stop, self.cols.start:self.cols.stop]

    def weights(self) -> torch.Tensor:
        """The tile's pixel weights [tile height, tile width]."""
        return torch.outer(self.row_weights, self.col_weights)


@dataclass(frozen=True, eq=False)
class TileGrid:
    """The tiles covering a latent plane of `height` x `width`, decoded at `scale` px per latent."""

    height: int
    width: int
    scale: int
    rows: tuple[Span, ...]
    cols: tuple[Span, ...]
    tiles: tuple[Tile, ...]  # row-major

    def __len__(self) -> int:
        return len(self.tiles)

    def __iter__(self):
        return iter(self.tiles)


# -- pixels to latent units --------------------------------------------------------------------

def _check_pixels(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{field}: expected a positive whole number of pixels, got {value!r}")
    return int(value)


def latent_tile_and_stride(tile_px: int, stride_px: int, scale: int,
                           axis: str = "x") -> tuple[int, int]:
    """Tile size and stride along one axis, converted from pixels to latent units.

    The tile rounds to the nearest latent unit; the stride rounds down, so the overlap never
    shrinks below what was asked by more than the tile's rounding, and it is held to at most
    tile - 1 so neighbouring tiles always overlap by at least one latent pixel.
    """
    tile_field, stride_field = f"tile_{axis}", f"stride_{axis}"
    tile_px = _check_pixels(tile_field, tile_px)
    stride_px = _check_pixels(stride_field, stride_px)
    if stride_px >= tile_px:
        raise ValueError(f"{stride_field}: must be smaller than {tile_field} ({tile_px} px) so "
                         f"that tiles overlap, got {stride_px} px")
    tile = int(tile_px / scale + 0.5)
    if tile < 2:
        raise ValueError(f"{tile_field}: must be at least {2 * scale} px (2 latent pixels of "
                         f"{scale} px) so that tiles can overlap, got {tile_px} px")
    stride = min(max(stride_px // scale, 1), tile - 1)
    return tile, stride


# -- layout along one axis ---------------------------------------------------------------------

def axis_spans(size: int, tile: int, stride: int) -> tuple[Span, ...]:
    """Spans of `tile` every `stride` covering [0, size); the last one ends exactly at `size`.

    No partial tiles and no padding: the last span is moved back to end at the border (so it may
    overlap its neighbour by more than the others do). A size up to one tile is a single span.
    """
    if size <= tile:
        return (Span(0, size),)
    starts = list(range(0, size - tile, stride)) + [size - tile]
    return tuple(Span(start, start + tile) for start in starts)


def even_tile_size(size: int, count: int, overlap: int) -> int | None:
    """The size of `count` equal spans covering [0, size) with neighbours overlapping by at
    least `overlap`; None when they do not fit (each must be longer than the overlap and start
    after the previous one)."""
    if count == 1:
        return size
    tile = -(-(size + (count - 1) * overlap) // count)
    return None if tile <= overlap or size - tile < count - 1 else tile


def even_spans(size: int, count: int, overlap: int) -> tuple[Span, ...]:
    """`count` spans of one size covering [0, size), neighbours overlapping by at least `overlap`
    (by `overlap` or one more, as the rounding falls). Raises ValueError when `count` such spans
    do not fit (see even_tile_size)."""
    tile = even_tile_size(size, count, overlap)
    if tile is None:
        raise ValueError(f"{count} tiles overlapping by {overlap} do not fit in {size}")
    if count == 1:
        return (Span(0, size),)
    # Integer steps of floor or ceil((size - tile) / (count - 1)), never more than tile - overlap.
    starts = [i * (size - tile) // (count - 1) for i in range(count)]
    return tuple(Span(start, start + tile) for start in starts)


def _ramp(length: int, fade_in: int, fade_out: int) -> torch.Tensor:
    """Weight 1 over `length` pixels, rising linearly over the first `fade_in` and falling over
    the last `fade_out`. Ramp values are k/(n+1), never 0: a tile's border pixels still count,
    and two opposite ramps over the same n pixels add up to exactly 1."""
    weights = torch.ones(length, dtype=torch.float64)
    if fade_in:
        weights[:fade_in] = torch.arange(1, fade_in + 1, dtype=torch.float64) / (fade_in + 1)
    if fade_out:
        falling = torch.arange(fade_out, 0, -1, dtype=torch.float64) / (fade_out + 1)
        weights[length - fade_out:] = torch.minimum(weights[length - fade_out:], falling)
    return weights


def axis_weights(spans: tuple[Span, ...], scale: int) -> tuple[torch.Tensor, ...]:
    """Each span's pixel weights along the axis, normalised so that they sum to 1 at every pixel."""
    raw = []
    for i, span in enumerate(spans):
        fade_in = (spans[i - 1].stop - span.start) * scale if i > 0 else 0
        fade_out = (span.stop - spans[i + 1].start) * scale if i + 1 < len(spans) else 0
        raw.append(_ramp(span.size * scale, fade_in, fade_out))
    total = torch.zeros(spans[-1].stop * scale, dtype=torch.float64)
    for span, weights in zip(spans, raw):
        total[span.pixels(scale)] += weights
    return tuple((weights / total[span.pixels(scale)]).float()
                 for span, weights in zip(spans, raw))


# -- the grid ----------------------------------------------------------------------------------

def last_covered(spans: tuple[Span, ...]) -> tuple[Span, ...]:
    """For each span, the part no later span covers: up to where the next one starts."""
    return tuple(Span(span.start, following.start)
                 for span, following in zip(spans, spans[1:])) + (spans[-1],)


def _grid(height: int, width: int, scale: int, rows: tuple[Span, ...],
          cols: tuple[Span, ...]) -> TileGrid:
    row_parts = zip(rows, axis_weights(rows, scale), last_covered(rows))
    col_parts = list(zip(cols, axis_weights(cols, scale), last_covered(cols)))
    tiles = tuple(Tile(r, c, rw, cw, r_last, c_last) for r, rw, r_last in row_parts
                  for c, cw, c_last in col_parts)
    return TileGrid(height, width, scale, rows, cols, tiles)


def plan_tiles(height: int, width: int, scale: int, tile: tuple[int, int] = (272, 272),
               stride: tuple[int, int] = (144, 128)) -> TileGrid:
    """The tile grid for a latent plane of `height` x `width` decoded at `scale` px per latent.

    `tile` and `stride` are (x, y) in pixels, as the node's tile_x, tile_y, stride_x, stride_y.
    """
    for name, pair in (("tile", tile), ("stride", stride)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{name}: expected (x, y) in pixels, got {pair!r}")
    tile_x, stride_x = latent_tile_and_stride(tile[0], stride[0], scale, "x")
    tile_y, stride_y = latent_tile_and_stride(tile[1], stride[1], scale, "y")
    return _grid(height, width, scale, axis_spans(height, tile_y, stride_y),
                 axis_spans(width, tile_x, stride_x))


def plan_even_tiles(height: int, width: int, scale: int, rows: int, cols: int,
                    overlap: int) -> TileGrid:
    """`rows` x `cols` tiles of one size over a latent plane of `height` x `width`, neighbours
    overlapping by `overlap` latent pixels (see even_spans)."""
    return _grid(height, width, scale, even_spans(height, rows, overlap),
                 even_spans(width, cols, overlap))


def single_tile(height: int, width: int, scale: int) -> TileGrid:
    """The whole plane as one tile: the untiled decode."""
    return _grid(height, width, scale, (Span(0, height),), (Span(0, width),))
