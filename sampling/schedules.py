"""Flow-matching noise schedules with shift, as the official Wan samplers build them.

A schedule is a descending list of noise levels sigma (1 = pure noise, 0 = clean) plus the
integer timestep the model sees at each step. Two grids exist:

- the UniPC grid (also used by Euler): linspace from float32(0.999) down to 0;
- the DPM++ grid: linspace from 1 down to 0.

Both are computed in float64 with numpy, shifted, multiplied by 1000 and *truncated* to int64,
in exactly that order: the truncation is sensitive to the last float64 bit (a shifted sigma of
0.49999999999999994 gives timestep 499, not 500), so the order of operations is part of the
contract. The sigmas the solvers use are the float32 roundings of the same float64 values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000

# The highest noise level of the training grid, 1 - 1/1000, as the float32 value the official
# scheduler reads back from its float32 table (0.99900001287..., not 0.999).
UNIPC_SIGMA_MAX = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))


@dataclass(frozen=True, eq=False)
class FlowSchedule:
    """The noise levels of one sampling run.

    sigmas: float32 [steps + 1], descending, ending at 0; step i goes from sigmas[i] to sigmas[i+1].
    timesteps: int64 [steps], the timestep handed to the model at step i.
    """

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    def __post_init__(self):
        if self.sigmas.dtype != torch.float32 or self.sigmas.dim() != 1:
            raise ValueError("sigmas must be a 1-D float32 tensor")
        if self.timesteps.dtype != torch.int64 or self.timesteps.dim() != 1:
            raise ValueError("timesteps must be a 1-D int64 tensor")
        if self.sigmas.numel() != self.timesteps.numel() + 1 or self.timesteps.numel() < 1:
            raise ValueError(f"need steps >= 1 and steps + 1 sigmas, got {self.timesteps.numel()} "
                             f"timesteps and {self.sigmas.numel()} sigmas")

    @property
    def steps(self) -> int:
        return self.timesteps.numel()

    @property
    def model_timesteps(self) -> torch.Tensor:
        """The timesteps as float32, the form the model takes (integers are exact in float32)."""
        return self.timesteps.to(torch.float32)

    def timestep(self, index: int) -> int:
        return int(self.timesteps[index])

    def tail(self, start: int) -> "FlowSchedule":
        """The schedule from step `start` on: what a partial denoise runs."""
        if not 0 <= start < self.steps:
            raise ValueError(f"start step {start} outside 0..{self.steps - 1}")
        return FlowSchedule(self.sigmas[start:].clone(), self.timesteps[start:].clone())


def _check_steps_and_shift(steps: int, shift: float) -> None:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise ValueError(f"steps must be an integer, got {steps!r}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not isinstance(shift, (int, float, np.floating)) or not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a finite number > 0, got {shift!r}")


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """sigma' = shift * sigma / (1 + (shift - 1) * sigma), in float64, in this operation order."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _schedule_from_float64(shifted: np.ndarray) -> FlowSchedule:
    # Multiply in float64 first, then truncate toward zero (int64 conversion), never round.
    timesteps = torch.from_numpy(shifted * NUM_TRAIN_TIMESTEPS).to(torch.int64)
    sigmas = np.concatenate([shifted, [0.0]]).astype(np.float32)
    return FlowSchedule(torch.from_numpy(sigmas), timesteps)


def denoise_start_step(steps: int, denoise: float) -> int:
    """First step of a partial denoise, which runs the last floor(steps * denoise) steps (>= 1)."""
    if not isinstance(denoise, (int, float, np.floating)) or not 0 < denoise <= 1:
        raise ValueError(f"denoise must be in (0, 1], got {denoise!r}")
    # The small epsilon keeps products such as 100 * 0.29 = 28.999999999999996 at 29.
    run = max(1, min(steps, int(steps * denoise + 1e-6)))
    return steps - run


def _with_denoise(schedule: FlowSchedule, denoise: float) -> FlowSchedule:
    start = denoise_start_step(schedule.steps, denoise)
    return schedule if start == 0 else schedule.tail(start)


def unipc_schedule(steps: int, shift: float, denoise: float = 1.0) -> FlowSchedule:
    """The grid of the official UniPC sampler (Euler uses it too). The first timestep is 999."""
    _check_steps_and_shift(steps, shift)
    base = np.linspace(UNIPC_SIGMA_MAX, 0.0, steps + 1)[:-1]
    return _with_denoise(_schedule_from_float64(shift_sigmas(base, float(shift))), denoise)


def dpm_schedule(steps: int, shift: float, denoise: float = 1.0) -> FlowSchedule:
    """The grid of the official DPM++ sampler: linspace(1, 0), shifted once; first timestep 1000."""
    _check_steps_and_shift(steps, shift)
    base = np.linspace(1.0, 0.0, steps + 1)[:steps]
    return _with_denoise(_schedule_from_float64(shift_sigmas(base, float(shift))), denoise)
