"""Latent to ComfyUI IMAGE frames with a Wan VAE: spatially tiled, streamed to the CPU.

Each spatial tile is decoded over all its frames with its own causal cache (one decode_frames
pass; Wan already decodes one latent frame at a time, and cutting time into tiles makes the video
flicker). Every chunk the VAE yields is turned into weighted image values on the device and added
straight into one preallocated CPU buffer, so the device holds one tile's activations at a time
and the full video only ever exists on the CPU.

plan_budget_tiles picks the tile grid of least work whose tiles' estimated decode peak fits a
memory budget.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..wan.vae_blocks import CausalConv3d, FrameAttention, FrameConv2d, Upsample
from .tiles import TileGrid, even_spans, plan_even_tiles, plan_tiles, single_tile

DEFAULT_TILE = (272, 272)  # (x, y) pixels, the benchmark scenarios' settings
DEFAULT_STRIDE = (144, 128)
DEFAULT_OVERLAP = 64  # pixels between neighbouring tiles of a grid planned from a memory budget


# -- the decode --------------------------------------------------------------------------------

def decode_to_images(vae: nn.Module, latent: torch.Tensor, *, tiled: bool = True,
                     tile: tuple[int, int] = DEFAULT_TILE,
                     stride: tuple[int, int] = DEFAULT_STRIDE,
                     budget_bytes: int | None = None, overlap: int = DEFAULT_OVERLAP,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                     progress: Callable[[int, int], None] | None = None,
                     check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
    """Raw (de-normalised) latent [B, C, T, h, w] -> IMAGE frames [B*F, H, W, 3], float32 0..1.

    F = 1 + 4(T-1) frames per batch item, batch item 0 first; H, W = h, w times the VAE's
    spatial stride. Decoded values are clamped to [-1, 1] and mapped to (x + 1) / 2.

    tile, stride: (x, y) in pixels. tiled=False decodes the whole frame as one tile, still
    streamed chunk by chunk into the CPU buffer.
    budget_bytes: when given (and tiled), the grid is planned from this device memory budget
        instead (plan_budget_tiles, tiles overlapping by `overlap` px); tile and stride are unused.
    device, dtype: where and in what precision the VAE runs; default where its weights are. The
        caller places the VAE (pipeline/placement.py); a different device or dtype is an error.
    progress(done, total): called after each decoded chunk of each tile.
    check_interrupt(): called between chunks; whatever it raises aborts the decode and
        propagates, leaving nothing of the decode referenced.
    """
    _check_latent(vae, latent)
    device = _run_device(vae, device, dtype)
    batch, _, latent_frames, height, width = latent.shape
    scale = vae.spatial_stride
    grid = plan_grid(vae, latent.shape, tiled=tiled, tile=tile, stride=stride,
                     budget_bytes=budget_bytes, overlap=overlap)
    canvas = ImageCanvas(batch, 1 + vae.temporal_stride * (latent_frames - 1),
                         height * scale, width * scale)
    try:
        _decode_tiles(vae, latent, grid, canvas, device, progress, check_interrupt)
    except BaseException as error:
        # The traceback keeps the frames it passed through, and with them the decode's tensors
        # (device activations, staging buffers, the generator and its cache). Clear them so that
        # an interrupt or an out-of-memory error frees everything before the caller handles it.
        canvas.release()
        traceback.clear_frames(error.__traceback__)
        raise
    return canvas.images()


def plan_grid(vae: nn.Module, latent_shape, *, tiled: bool = True,
              tile: tuple[int, int] = DEFAULT_TILE, stride: tuple[int, int] = DEFAULT_STRIDE,
              budget_bytes: int | None = None, overlap: int = DEFAULT_OVERLAP) -> TileGrid:
    """The tile grid decode_to_images uses for these arguments (ValueError naming the bad one)."""
    height, width = latent_shape[-2:]
    scale = vae.spatial_stride
    if not tiled:
        return single_tile(height, width, scale)
    if budget_bytes is not None:
        return plan_budget_tiles(vae, latent_shape, budget_bytes, _decode_dtype(vae), overlap)
    return plan_tiles(height, width, scale, tile, stride)


def _decode_tiles(vae: nn.Module, latent: torch.Tensor, grid: TileGrid, canvas: ImageCanvas,
                  device: torch.device, progress, check_interrupt) -> None:
    staging = DeviceToHost(device)
    total, done = len(grid) * latent.shape[2], 0
    pending = None  # the previous chunk: added to the canvas while the device decodes the next
    for tile in grid:
        half_weights = (0.5 * tile.weights()).to(device)
        rows, cols = tile.rows.pixels(grid.scale), tile.cols.pixels(grid.scale)
        finished = tile.last_rows.pixels(grid.scale), tile.last_cols.pixels(grid.scale)
        frames = vae.decode_frames(tile.latent_of(latent))
        first_frame = 0
        for chunk in frames:
            image = weighted_image(chunk, half_weights)
            del chunk
            if first_frame + image.shape[1] > canvas.frame_count:
                raise RuntimeError(f"the VAE decoded more than the {canvas.frame_count} frames "
                                   f"expected (1 + {vae.temporal_stride}(T-1))")
            staged = staging.send(image, slice(first_frame, first_frame + image.shape[1]),
                                  (rows, cols), finished)
            del image
            if pending is not None:
                canvas.add(pending)
            pending = staged
            first_frame += staged.frames
            done += 1
            if progress is not None:
                progress(done, total)
            if check_interrupt is not None:
                check_interrupt()
        if first_frame != canvas.frame_count:
            raise RuntimeError(f"the VAE decoded {first_frame} frames, expected "
                               f"{canvas.frame_count} (1 + {vae.temporal_stride}(T-1))")
    if pending is not None:
        canvas.add(pending)


def weighted_image(chunk: torch.Tensor, half_weights: torch.Tensor) -> torch.Tensor:
    """Decoded chunk [B, 3, t, h, w] -> its weighted image values [B, t, h, w, 3], float32.

    (clamp(x) + 1) * (0.5 * weight): the image mapping and the blend weight in one multiply.
    Runs on the device, so only final float32 values cross to the CPU.
    """
    image = chunk.to(torch.float32).clamp_(-1.0, 1.0).add_(1.0).mul_(half_weights)
    return image.permute(0, 2, 3, 4, 1).contiguous()


class StagedChunk:
    """A weighted image chunk on its way to the CPU, and where it goes on the canvas."""

    def __init__(self, values: torch.Tensor, frames: slice, pixels: tuple[slice, slice],
                 finished: tuple[slice, slice], copied: torch.cuda.Event | None) -> None:
        self.values = values  # [B, t, h, w, 3] float32, CPU
        self.frame_slice = frames
        self.pixels = pixels  # (rows, columns) of the canvas
        self.finished = finished  # the pixels whose blend this chunk completes
        self.copied = copied  # recorded after the copy; None when the values are ready

    @property
    def frames(self) -> int:
        return self.values.shape[1]

    def ready(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.values


class DeviceToHost:
    """Moves weighted chunks into CPU memory without stalling the device.

    On CUDA the copy goes, non-blocking, into one of two pinned buffers used in turn: the CPU
    reads a chunk only after the next one has been queued, so the device keeps decoding while the
    CPU blends. The buffer of chunk k is reused for chunk k+2, after chunk k was read. On the CPU
    the chunk passes through; other devices copy synchronously.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def send(self, values: torch.Tensor, frames: slice, pixels: tuple[slice, slice],
             finished: tuple[slice, slice]) -> StagedChunk:
        if not self.pinned:
            return StagedChunk(values.to("cpu"), frames, pixels, finished, None)
        host = self._next_buffer(values.numel())[:values.numel()].view(values.shape)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        return StagedChunk(host, frames, pixels, finished, copied)

    def _next_buffer(self, numel: int) -> torch.Tensor:
        if not self._buffers or self._buffers[0].numel() < numel:
            # All tiles have one size and chunks have at most temporal-stride frames, so this
            # happens on the first (one-frame) chunk and once more on the first full chunk.
            self._buffers = [torch.empty(numel, dtype=torch.float32, pin_memory=True)
                             for _ in range(2)]
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        return buffer


class ImageCanvas:
    """The CPU buffer the video is blended into: [B, F, H, W, 3] float32.

    Tile weights are normalised beforehand (they sum to 1 at every pixel), so adding the weighted
    chunks leaves the final image: no weight buffer and no pass over the video at the end.
    """

    def __init__(self, batch: int, frames: int, height: int, width: int) -> None:
        self.frames: torch.Tensor | None = torch.zeros(batch, frames, height, width, 3)

    @property
    def frame_count(self) -> int:
        return self.frames.shape[1]

    def add(self, chunk: StagedChunk) -> None:
        rows, cols = chunk.pixels
        self.frames[:, chunk.frame_slice, rows, cols].add_(chunk.ready())
        # Weights summing to 1 in float32 can overshoot by a rounding step; clamp each pixel once,
        # when its last tile is in and its values are still in cache.
        rows, cols = chunk.finished
        self.frames[:, chunk.frame_slice, rows, cols].clamp_(0.0, 1.0)

    def images(self) -> torch.Tensor:
        batch, frames, height, width, _ = self.frames.shape
        return self.frames.view(batch * frames, height, width, 3)

    def release(self) -> None:
        self.frames = None


# -- choosing the tile size from a memory budget -----------------------------------------------
#
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
# The counts follow the code in wan/vae_blocks.py. Measured on an H100 in bf16 at three tile
# sizes each (bench/results/2026-11-23-h100-vae-decode), the allocated peak was 0.95-1.04x the
# count for Wan2.1 and 1.23-1.25x for Wan2.2, whose wider convolutions take larger cuDNN
# workspaces: MEASURED_OVER_COUNTED carries that per decoder. SAFETY_FACTOR then covers what the
# allocator reserves beyond what is allocated (1.17-1.18x in the same runs), so a budget is met
# in reserved device memory, which is what other programs on the GPU see.

MEASURED_OVER_COUNTED = {"Decoder21": 1.05, "Decoder22": 1.25}
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
    """The estimated device peak of decoding one tile with `vae`, for `batch` videos in `dtype`."""

    def __init__(self, vae: nn.Module, batch: int, dtype: torch.dtype) -> None:
        layers, self._attentions = _decoder_layers(vae.decoder)
        self._per_latent_pixel = (sum(layer.cache_elements() for layer in layers)
                                  + max(layer.working_elements() for layer in layers))
        self._calibration = MEASURED_OVER_COUNTED.get(type(vae.decoder).__name__, 1.25)
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
        return int(SAFETY_FACTOR * self._calibration * self._batch
                   * (activation_bytes + chunk_bytes))


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
    for rows in _tile_counts(height, overlap_latent):
        tile_h = even_spans(height, rows, overlap_latent)[0].size
        for cols in _tile_counts(width, overlap_latent):
            tile_w = even_spans(width, cols, overlap_latent)[0].size
            if cost.bytes(tile_h, tile_w) > budget_bytes:
                continue
            candidate = (rows * tile_h * cols * tile_w, rows * cols, rows, cols)
            best = candidate if best is None else min(best, candidate)
            break  # more columns of the same rows only add work
    if best is None:
        smallest = cost.bytes(2 * overlap_latent + 1, 2 * overlap_latent + 1)
        raise ValueError(f"budget_bytes: {budget_bytes} bytes cannot hold even the smallest tile "
                         f"that overlaps its neighbours by {overlap} px (about {smallest} bytes); "
                         f"raise the budget or lower the overlap")
    _, _, rows, cols = best
    return plan_even_tiles(height, width, scale, rows, cols, overlap_latent)


def _tile_counts(size: int, overlap: int) -> list[int]:
    """The tile counts along an axis of `size` latent pixels that even_spans can lay out."""
    counts = []
    for count in range(1, size + 1):
        try:
            even_spans(size, count, overlap)
        except ValueError:
            continue
        counts.append(count)
    return counts


# -- checks ------------------------------------------------------------------------------------

def _check_latent(vae: nn.Module, latent) -> None:
    z_dim = vae.z_dim
    if not isinstance(latent, torch.Tensor) or latent.dim() != 5:
        shape = list(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        raise ValueError(f"latent: expected a video latent [B, {z_dim}, T, h, w], got {shape}")
    if latent.shape[1] != z_dim:
        raise ValueError(f"latent: this VAE decodes {z_dim}-channel latents, got "
                         f"{latent.shape[1]} channels ({list(latent.shape)})")
    if not latent.is_floating_point():
        raise ValueError(f"latent: expected floating-point values, got {latent.dtype}")
    if min(latent.shape) == 0:
        raise ValueError(f"latent: is empty ({list(latent.shape)})")


def _decode_dtype(vae: nn.Module) -> torch.dtype:
    return next(vae.parameters()).dtype


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":  # "cuda" means the current CUDA device
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == \
            (b.index if b.index is not None else current)
    return a.index is None or b.index is None or a.index == b.index


def _run_device(vae: nn.Module, device, dtype) -> torch.device:
    """The device the decode runs on: the VAE's, which must match `device` and `dtype` if given."""
    weight = next(vae.parameters(), None)
    if weight is None:
        raise ValueError("vae: the VAE has no weights")
    if device is not None and not _same_device(torch.device(device), weight.device):
        raise ValueError(f"device: the VAE's weights are on {weight.device}, not {device}; "
                         f"place the VAE on the decode device first")
    if dtype is not None and dtype != weight.dtype:
        raise ValueError(f"dtype: the VAE's weights are {weight.dtype}, not {dtype}; "
                         f"load or cast the VAE in the decode precision")
    return weight.device
