"""Latent to ComfyUI IMAGE frames with a Wan VAE: spatially tiled, streamed to the CPU.

Each spatial tile is decoded over all its frames with its own causal cache (one decode_frames
pass; Wan already decodes one latent frame at a time, and cutting time into tiles makes the video
flicker). Every chunk the VAE yields is turned into weighted image values on the device and added
straight into one preallocated CPU buffer, so the device holds one tile's activations at a time
and the full video only ever exists on the CPU.

The grid comes from a tile size and stride (plan_tiles) or from a device memory budget
(budget.py, plan_budget_tiles).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn as nn

from .budget import DEFAULT_OVERLAP, plan_budget_tiles
from .tiles import TileGrid, plan_tiles, single_tile

DEFAULT_TILE = (272, 272)  # (x, y) pixels, the benchmark scenarios' settings
DEFAULT_STRIDE = (144, 128)


# -- the decode --------------------------------------------------------------------------------

class FrameListener(Protocol):
    """Told which frames of the decode's output are final while the decode goes on (a video
    writer encodes them meanwhile)."""

    def started(self, images: torch.Tensor, frames: int) -> None:
        """The output [B*F, H, W, 3] the frames are blended into, F = `frames` a batch item;
        nothing of it is final yet. (Called again if the decode starts over.)"""

    def final(self, frames: int) -> None:
        """Frames 0..frames-1 of every batch item hold their final values (they are not written
        again). May raise to stop the decode."""


def decode_to_images(vae: nn.Module, latent: torch.Tensor, *, tiled: bool = True,
                     tile: tuple[int, int] = DEFAULT_TILE,
                     stride: tuple[int, int] = DEFAULT_STRIDE,
                     budget_bytes: int | None = None, overlap: int = DEFAULT_OVERLAP,
                     grid: TileGrid | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                     progress: Callable[[int, int], None] | None = None,
                     check_interrupt: Callable[[], None] | None = None,
                     listener: FrameListener | None = None) -> torch.Tensor:
    """Raw (de-normalised) latent [B, C, T, h, w] -> IMAGE frames [B*F, H, W, 3], float32 0..1.

    F = 1 + 4(T-1) frames per batch item, batch item 0 first; H, W = h, w times the VAE's
    spatial stride. Decoded values are clamped to [-1, 1] and mapped to (x + 1) / 2.

    tile, stride: (x, y) in pixels. tiled=False decodes the whole frame as one tile, still
    streamed chunk by chunk into the CPU buffer.
    budget_bytes: when given (and tiled), the grid is planned from this device memory budget
        instead (plan_budget_tiles, tiles overlapping by `overlap` px); tile and stride are unused.
    grid: a grid planned already (plan_grid); the arguments above are then unused.
    device, dtype: where and in what precision the VAE runs; default where its weights are. The
        caller places the VAE (pipeline/placement.py); a different device or dtype is an error.
    progress(done, total): called after each decoded chunk of each tile.
    check_interrupt(): called between chunks; whatever it raises aborts the decode and
        propagates, leaving nothing of the decode referenced.
    listener: told of the output tensor, then of the frames that are final: every frame's last
        tile is the grid's last, so frames become final chunk by chunk during the last tile.
    """
    _check_latent(vae, latent)
    device = _run_device(vae, device, dtype)
    batch, _, latent_frames, height, width = latent.shape
    scale = vae.spatial_stride
    if grid is None:
        grid = plan_grid(vae, latent.shape, tiled=tiled, tile=tile, stride=stride,
                         budget_bytes=budget_bytes, overlap=overlap)
    elif (grid.height, grid.width, grid.scale) != (height, width, scale):
        raise ValueError(f"grid: planned for a {grid.height}x{grid.width} latent at "
                         f"{grid.scale} px, not {height}x{width} at {scale} px")
    canvas = ImageCanvas(batch, 1 + vae.temporal_stride * (latent_frames - 1),
                         height * scale, width * scale)
    try:
        if listener is not None:
            listener.started(canvas.images(), canvas.frame_count)
        _decode_tiles(vae, latent, grid, canvas, device, progress, check_interrupt, listener)
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
                  device: torch.device, progress, check_interrupt, listener) -> None:
    staging = DeviceToHost(device)
    total, done = len(grid) * latent.shape[2], 0
    pending = None  # the previous chunk: added to the canvas while the device decodes the next
    last_tile = len(grid) - 1

    def add(chunk: StagedChunk, tile_index: int) -> None:
        canvas.add(chunk)
        if listener is not None and tile_index == last_tile:
            listener.final(chunk.frame_slice.stop)

    for tile_index, tile in enumerate(grid):
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
                add(*pending)
            pending = staged, tile_index
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
        add(*pending)


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
