"""Latent to IMAGE frames with a Wan VAE, tiled or not, streamed to the CPU."""

from __future__ import annotations

import math
import warnings

import torch

from .. import host
from ..vae_tiling.budget import DecodeCost
from ..wan.configs import VAES
from ..vae_tiling.decode import FrameListener, decode_to_images, plan_grid
from . import memory_guard as guard
from .handles import WanVAEHandle
from .placement import DevicePlacement
from .errors import InputError

VAE_NAMES = {kind: spec.name for kind, spec in VAES.items()}


def check_latent_for_vae(vae: WanVAEHandle, latent, field: str = "latent") -> torch.Tensor:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.dim() != 5:
        raise InputError(f"{field}: expected a video LATENT {{'samples': [B, C, T, H, W]}}")
    z_dim = vae.model.z_dim
    if samples.shape[1] != z_dim:
        other = "Wan2.2 (TI2V-5B)" if samples.shape[1] == 48 else (
            "Wan2.1 / Wan2.2 A14B" if samples.shape[1] == 16 else "another")
        raise InputError(f"{field}: a {samples.shape[1]}-channel latent of a {other} model "
                         f"cannot be decoded by {vae.name}, a {VAE_NAMES[vae.kind]} "
                         f"({z_dim} channels)")
    return samples


DECODE_MODES = ("tiled", "untiled", "auto")


def decode(vae: WanVAEHandle, latent: dict, *, mode: str = "auto", tile=(272, 272),
           stride=(144, 128), budget_gb: float = 3.0, overlap: int = 64, device=None,
           progress=None, listener: FrameListener | None = None) -> torch.Tensor:
    """IMAGE frames [B*F, H, W, 3] float32 in 0..1 on the CPU.

    mode "tiled" uses tile/stride (pixels, (x, y)); "untiled" decodes whole frames; "auto" plans
    the grid of least work whose tiles fit `budget_gb` GiB of device memory besides the VAE's
    weights (0: the memory the device has free once the VAE is placed and the host has made
    room for an untiled decode), tiles overlapping by `overlap` pixels.
    listener: told of the frames as they become final (vae_tiling.decode.FrameListener).
    """
    if mode not in DECODE_MODES:
        raise InputError(f"mode: expected one of {list(DECODE_MODES)}, got {mode!r}")
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or \
            not math.isfinite(budget_gb) or budget_gb < 0:
        raise InputError(f"vram_budget_gb: expected 0 (what is free) or a positive number of "
                         f"GiB, got {budget_gb!r}")
    samples = check_latent_for_vae(vae, latent)
    device = torch.device(device) if device is not None else host.compute_device()
    size = guard.size_of_latent(samples.shape, vae.kind)
    guard.check_decoded_frames(size, vae.model.spatial_stride)
    with DevicePlacement(device) as placement:
        placement.place(vae.model)
        if mode == "untiled":
            cost = DecodeCost(vae.model, samples.shape[0], next(vae.model.parameters()).dtype)
            guard.check_untiled_decode(cost, size, vae.model.spatial_stride, device)
        budget = None
        if mode == "auto":
            budget = int(budget_gb * (1 << 30)) if budget_gb > 0 else \
                free_after_room(vae, samples, device)
        tiled = mode == "tiled" or (mode == "auto" and budget is not None)

        def plan(budget_bytes):
            try:
                return plan_grid(vae.model, samples.shape, tiled=tiled, tile=tile, stride=stride,
                                 budget_bytes=budget_bytes, overlap=overlap)
            except ValueError as error:  # named as the node's field
                raise InputError(str(error).replace("budget_bytes:", "vram_budget_gb:", 1)) \
                    from None

        def run(grid):
            return decode_to_images(vae.model, samples, grid=grid, device=device,
                                    progress=progress, check_interrupt=host.check_interrupt,
                                    listener=listener)

        grid = plan(budget)
        if budget is None:
            return run(grid)
        host.make_room(budget, device)  # the host's own models leave room for the budget
        return decode_within_budget(run, plan, grid, budget, device)


# A budget the device cannot hold after all (other programs, fragmentation) is halved and the
# decode run again, this many times, before the out-of-memory error goes to the user.
OOM_RETRIES = 3


def decode_within_budget(run, plan, grid, budget: int, device: torch.device) -> torch.Tensor:
    """run(grid), then run(plan(budget)) with halved budgets after out-of-memory errors
    (decode_to_images leaves nothing allocated when it fails, so a retry starts from the same
    memory)."""
    for attempt in range(OOM_RETRIES + 1):
        try:
            return run(grid)
        except torch.cuda.OutOfMemoryError:
            smaller = budget // 2
            try:
                grid = None if attempt == OOM_RETRIES else plan(smaller)
            except InputError:  # not even the smallest grid fits half the budget
                grid = None
            if grid is None:
                raise
        # Out of the except block, so the error and what its traceback holds are gone.
        host.release_cached_memory()
        warnings.warn(f"Wan Tiled Decode: out of device memory with a {budget / (1 << 30):.2f} "
                      f"GiB budget on {device}; decoding again with {smaller / (1 << 30):.2f} "
                      f"GiB", stacklevel=2)
        budget = smaller


def free_after_room(vae: WanVAEHandle, samples: torch.Tensor, device: torch.device) -> int | None:
    """What the device has free (free_device_bytes) after the host was asked to make room for
    the untiled decode: the host's own models (ComfyUI's, evictable) leave what the decode
    could use, so "what is free" does not depend on what the host happens to keep loaded."""
    if device.type != "cuda":
        return None
    cost = DecodeCost(vae.model, samples.shape[0], next(vae.model.parameters()).dtype)
    host.make_room(cost.bytes(*samples.shape[-2:]), device)
    return free_device_bytes(device)


# Left free of a budget taken from free memory: allocator rounding and other streams' work.
FREE_MEMORY_MARGIN = 0.9


def free_device_bytes(device: torch.device) -> int | None:
    """What the device has free (memory_guard.free_bytes: within the process's cap), less a
    margin; None (no limit: untiled) on the CPU."""
    if device.type != "cuda":
        return None
    return int(FREE_MEMORY_MARGIN * guard.free_bytes(device))
