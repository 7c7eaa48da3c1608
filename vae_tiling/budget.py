"""Choosing the tile grid of a decode from a device memory budget.

The decode peak of a tile is counted from the decoder's layer widths rather than measured, so a
grid can be planned before anything is placed on the device (DecodeCost); plan_budget_tiles then
takes the grid of least work whose tiles fit the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..wan.vae_blocks import CausalConv3d, FrameAttention, FrameConv2d, Upsample
from .tiles import TileGrid, even_tile_size, plan_even_tiles

DEFAULT_OVERLAP = 64  # pixels between neighbouring tiles of a grid planned from a memory budget

# The decode peak is modelled from the decoder's layer widths rather than measured, so that a
# tile size can be chosen before anything is placed on the device. Wan's decoders are chains of
# causal convolutions, so the activation memory of one chunk is a sum over layers of
# channels x frames x pixels at that layer's resolution; everything scales with the tile's pixel
# count, and the widest layers at the highest resolutions dominate. Per chunk the model counts:
#   - the history every causal convolution keeps for the next chunk (alive for the whole tile);
#   - the largest working set of one layer: its input kept for the residual shortcut, the
#     normalised copy, the input joined with its history, and the output (in a Wan2.2 stage
#     also the stage's input, kept for the stage's shortcut);
#   - the frame attention at the lowest resolution as if it materialised its score matrix
#     (the math fallback; fused kernels need far less), which grows with the square of the tile;
#   - the decoded chunk and its float32 image copies.
# The counts follow the code in wan/vae_blocks.py. The allocated peak measured against the
# count differs by decoder (the Wan2.2 decoder's wider convolutions take larger cuDNN
# workspaces) and by memory layout (the CUDA decode runs in channels_last_3d, its causal
# convolutions streaming into one buffer): MEASURED_OVER_COUNTED carries the measured factor
# of each (NCDHW: bench/results/2026-11-23-h100-vae-decode; channels-last:
# bench/results/2026-11-29-h200-vae-decode). SAFETY_FACTOR then covers what the allocator
# reserves beyond what is allocated (measured in the same runs), so a budget is met in reserved
# device memory, which is what other programs on the GPU see.

MEASURED_OVER_COUNTED = {("Decoder21", "ncdhw"): 1.05, ("Decoder22", "ncdhw"): 1.25,
                         ("Decoder21", "channels_last"): 0.80,
                         ("Decoder22", "channels_last"): 0.85}
UNKNOWN_DECODER = 1.25  # the calibration of a decoder not measured
SAFETY_FACTOR = 1.25


@dataclass(frozen=True)
class _Layer:
    """A convolution of the decoder at the resolution and frame count it runs at."""

    in_channels: int
    out_channels: int
    history: int  # frames carried to the next chunk
    area: int  # pixels per latent pixel at this layer's resolution
    frames: int  # frames per chunk at this layer (a later chunk: the most)
    stage_input: int = 0  # elements per latent pixel a Wan2.2 stage keeps for its shortcut

    def cache_elements(self) -> int:
        return self.history * self.in_channels * self.area

    def working_elements(self) -> int:
        kept_and_normalised = 2 * self.in_channels * self.frames
        joined_with_history = self.in_channels * (self.frames + self.history)
        output = self.out_channels * self.frames
        return (kept_and_normalised + joined_with_history + output) * self.area + self.stage_input


def _decoder_layers(decoder: nn.Module) -> tuple[list[_Layer], list[tuple[int, int]]]:
    """The decoder's convolutions and frame attentions ((area, frames) each), in running order.

    Walks the modules in registration order, which is the running order in both Wan decoders;
    an Upsample is handled as a whole because its time convolution runs before its resampling.
    """
    layers, attentions = [], []
    area, frames = 1, 1
    inside_upsample: set[int] = set()
    stage_members: set[int] = set()
    stage_input = 0
    for module in decoder.modules():
        if id(module) in inside_upsample:
            continue
        if getattr(module, "avg_shortcut", None) is not None:
            # A Wan2.2 upsampling stage holds its input for the shortcut while its layers run.
            stage_members = {id(m) for m in module.modules()}
            stage_input = module.upsamples[0].residual[2].in_channels * frames * area
        kept = stage_input if id(module) in stage_members else 0
        if isinstance(module, Upsample):
            inside_upsample.update(id(m) for m in module.modules())
            if module.time_conv is not None:
                conv = module.time_conv
                layers.append(_Layer(conv.in_channels, conv.out_channels, conv.history_frames,
                                     area, frames, kept))
                frames *= 2
            area *= 4
            conv = module.resample[1]
            layers.append(_Layer(conv.in_channels, conv.out_channels, 0, area, frames, kept))
        elif isinstance(module, CausalConv3d):
            layers.append(_Layer(module.in_channels, module.out_channels, module.history_frames,
                                 area, frames, kept))
        elif isinstance(module, FrameConv2d):
            layers.append(_Layer(module.in_channels, module.out_channels, 0, area, frames, kept))
        elif isinstance(module, FrameAttention):
            attentions.append((area, frames))
    return layers, attentions


class DecodeCost:
    """The estimated device peak of decoding one tile with `vae`, for `batch` videos in `dtype`,
    on the device its weights are on (which sets the decode's memory layout)."""

    def __init__(self, vae: nn.Module, batch: int, dtype: torch.dtype) -> None:
        layers, self._attentions = _decoder_layers(vae.decoder)
        self._per_latent_pixel = (sum(layer.cache_elements() for layer in layers)
                                  + max(layer.working_elements() for layer in layers))
        self.calibration = MEASURED_OVER_COUNTED.get(
            (type(vae.decoder).__name__, decode_layout_name(vae)), UNKNOWN_DECODER)
        # The decoded chunk in `dtype`, then its weighted float32 image and that image's
        # permuted copy.
        chunk_per_latent_pixel = vae.temporal_stride * vae.spatial_stride ** 2 * 3
        self._chunk_bytes_per_latent_pixel = chunk_per_latent_pixel * (dtype.itemsize + 2 * 4)
        self._itemsize = dtype.itemsize
        self._batch = batch

    def bytes(self, height: int, width: int) -> int:
        """Bytes (weights excluded) for a tile of `height` x `width` latent pixels."""
        pixels = height * width
        scores = max((2 * (area * pixels) ** 2 * frames for area, frames in self._attentions),
                     default=0)
        activation_bytes = (self._per_latent_pixel * pixels + scores) * self._itemsize
        chunk_bytes = self._chunk_bytes_per_latent_pixel * pixels
        return int(SAFETY_FACTOR * self.calibration * self._batch
                   * (activation_bytes + chunk_bytes))


def decode_layout_name(vae: nn.Module) -> str:
    """"channels_last" where the VAE decodes in channels_last_3d on its weights' device (see
    wan/vae_blocks.CausalVideoVAE.decode_layout), else "ncdhw"."""
    weight = next(vae.parameters(), None)
    layout_of = getattr(vae, "decode_layout", None)
    if weight is None or layout_of is None:
        return "ncdhw"
    return "channels_last" if layout_of(weight.device) == torch.channels_last_3d else "ncdhw"


def estimate_decode_bytes(vae: nn.Module, tile_latent: tuple[int, int], batch: int,
                          dtype: torch.dtype) -> int:
    """Estimated device peak (bytes, weights excluded) of decoding one tile of
    `tile_latent` = (height, width) latent pixels for `batch` videos in `dtype`."""
    return DecodeCost(vae, batch, dtype).bytes(*tile_latent)


def plan_budget_tiles(vae: nn.Module, latent_shape, budget_bytes: int, dtype: torch.dtype,
                      overlap: int = DEFAULT_OVERLAP) -> TileGrid:
    """The tile grid that decodes the fewest pixels while each tile's estimated peak fits
    `budget_bytes` (device memory for the decode besides the VAE's weights).

    Tiles are of one size per grid, spread evenly, neighbours overlapping by `overlap` pixels
    (rounded up to whole latent pixels). Overlap is decoded twice, so the work of a grid is the
    sum of its tiles' areas; among grids of equal work the one with fewer tiles wins. A frame
    that fits as a whole is one tile: the untiled decode.
    """
    shape = tuple(latent_shape)
    if len(shape) != 5 or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0
                              for n in shape):
        raise ValueError(f"latent_shape: expected [B, C, T, h, w] of positive sizes, got {shape}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) \
            or not budget_bytes > 0:
        raise ValueError(f"budget_bytes: expected a positive number of bytes, got {budget_bytes!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap <= 0:
        raise ValueError(f"overlap: expected a positive whole number of pixels, got {overlap!r}")
    batch, _, _, height, width = shape
    scale = vae.spatial_stride
    overlap_latent = -(-overlap // scale)
    cost = DecodeCost(vae, batch, dtype)
    best = None  # (work, tile count, rows, cols)
    row_tiles, col_tiles = _tile_sizes(height, overlap_latent), _tile_sizes(width, overlap_latent)
    for rows, tile_h in row_tiles.items():
        for cols, tile_w in col_tiles.items():
            if cost.bytes(tile_h, tile_w) > budget_bytes:
                continue
            candidate = (rows * tile_h * cols * tile_w, rows * cols, rows, cols)
            best = candidate if best is None else min(best, candidate)
            break  # more columns of the same rows only add work
    if best is None:
        smallest = cost.bytes(min(row_tiles.values()), min(col_tiles.values()))
        raise ValueError(f"budget_bytes: {budget_bytes} bytes cannot hold even the smallest tile "
                         f"that overlaps its neighbours by {overlap} px (about {smallest} bytes); "
                         f"raise the budget or lower the overlap")
    _, _, rows, cols = best
    return plan_even_tiles(height, width, scale, rows, cols, overlap_latent)


def _tile_sizes(size: int, overlap: int) -> dict[int, int]:
    """Tile count -> tile size, for every count of even tiles that fits an axis of `size`."""
    sizes = {count: even_tile_size(size, count, overlap) for count in range(1, size + 1)}
    return {count: tile for count, tile in sizes.items() if tile is not None}
