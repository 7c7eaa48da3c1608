"""Seeded starting noise and the flow-matching forward process."""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

from .schedules import FlowSchedule


def make_noise(shape: Sequence[int], seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal float32 noise of `shape` from a CPU generator seeded with `seed`.

    Drawn on the CPU so the same seed gives the same latent on every device, then moved.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    noise = torch.randn(tuple(shape), generator=generator, dtype=torch.float32, device="cpu")
    return noise.to(device)


def noise_latent(clean: torch.Tensor, noise: torch.Tensor, schedule: FlowSchedule) -> torch.Tensor:
    """The sample at the schedule's first noise level: (1 - sigma) * clean + sigma * noise.

    The starting point of a partial denoise (img2img / video2video) over `schedule`.
    """
    if clean.shape != noise.shape:
        raise ValueError(f"clean latent {list(clean.shape)} and noise {list(noise.shape)} differ")
    sigma = float(schedule.sigmas[0])
    return (1 - sigma) * clean.to(torch.float32) + sigma * noise.to(torch.float32)
