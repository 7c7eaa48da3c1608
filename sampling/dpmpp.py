"""DPM-Solver++ 2M (multistep, midpoint form) for flow-matching models.

Works on the data prediction x0 = x - sigma * v. The first step has no history and the last
one ends at sigma 0 (infinite log-SNR), so both are first order; the steps between use the
previous x0 estimate for a second-order correction. With the DPM++ grid the first sigma is
exactly 1, where log-SNR is -inf: the first-order update then reduces to
x1 = sigma_1 * x + (1 - sigma_1) * x0, and the second step's correction weight is exactly 0,
as in the reference.
"""

from __future__ import annotations

import torch

from .solver_base import FlowSolver, log_snr


class DPMPlusPlus2MSolver(FlowSolver):
    name = "dpm++"

    def __init__(self, schedule):
        super().__init__(schedule)
        self._x0_prev: torch.Tensor | None = None  # x0 estimate of the previous step

    def release(self) -> None:
        self._x0_prev = None

    def _advance(self, index: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        sigma_now, sigma_next = self.sigma(index), self.sigma(index + 1)
        x0 = x - float(sigma_now) * v

        lambda_now = log_snr(sigma_now)
        h = log_snr(sigma_next) - lambda_now
        # exp(-h) - 1 (not expm1): the reference's formula, kept for identical rounding.
        x0_weight = (1 - sigma_next) * (torch.exp(-h) - 1.0)
        x_next = float(sigma_next / sigma_now) * x - float(x0_weight) * x0

        second_order = index > 0 and index < self.steps - 1 and self._x0_prev is not None
        if second_order:
            ratio = (lambda_now - log_snr(self.sigma(index - 1))) / h
            slope = float(1.0 / ratio) * (x0 - self._x0_prev)
            x_next = x_next - float(0.5 * x0_weight) * slope

        self._x0_prev = x0
        return x_next
