"""Flow Euler: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v(x_i), in float32."""

from __future__ import annotations

import torch

from .solver_base import FlowSolver


class EulerSolver(FlowSolver):
    name = "euler"

    def _advance(self, index: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # The step size is formed in float32 from the float32 sigmas, then applied.
        dt = float(self.sigma(index + 1) - self.sigma(index))
        return x + dt * v
