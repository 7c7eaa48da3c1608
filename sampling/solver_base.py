"""What every flow solver shares: the schedule, the step counter and float32 scalar arithmetic.

A solver is created for one run. `step(v, x)` takes the velocity predicted at the current noise
level and returns the sample at the next one. The history a multistep method needs lives on
the solver instance and is dropped after the last step (or by `release()`), never on the model.

Scalar coefficients are computed with 0-dim float32 CPU tensors, exactly as the reference
schedulers do, then applied as Python floats: a Python float holding a float32 value is
applied to a float32 tensor without any further rounding, on any device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .schedules import FlowSchedule


def log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha) - log(sigma) with alpha = 1 - sigma; +inf at sigma 0, -inf at sigma 1."""
    return torch.log(1 - sigma) - torch.log(sigma)


class FlowSolver(ABC):
    name: str = ""

    def __init__(self, schedule: FlowSchedule):
        self.schedule = schedule
        self.step_index = 0
        # Kept on the CPU in float32: every coefficient is derived from these 0-dim values.
        self._sigmas = schedule.sigmas.detach().to("cpu", torch.float32)

    @property
    def steps(self) -> int:
        return self.schedule.steps

    @property
    def finished(self) -> bool:
        return self.step_index >= self.steps

    def sigma(self, index: int) -> torch.Tensor:
        """sigmas[index] as a 0-dim float32 CPU tensor."""
        return self._sigmas[index]

    def step(self, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Advance x from sigmas[i] to sigmas[i+1] given the velocity v predicted at x.

        The returned tensor is new and belongs to the caller (it may be modified in place).
        """
        if self.finished:
            raise RuntimeError(f"{type(self).__name__}: all {self.steps} steps were already taken")
        if v.shape != x.shape:
            raise ValueError(f"velocity shape {list(v.shape)} != sample shape {list(x.shape)}")
        index = self.step_index
        x_next = self._advance(index, v.to(torch.float32), x.to(torch.float32))
        self.step_index = index + 1
        if self.finished:
            self.release()
        return x_next

    def release(self) -> None:
        """Drop any history tensors (after the last step, or when a run is aborted)."""

    @abstractmethod
    def _advance(self, index: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One step from sigmas[index] to sigmas[index + 1], in float32."""
