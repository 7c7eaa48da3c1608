"""UniPC for flow-matching models: bh2, order 2, data prediction, with the UniC corrector.

Each step:
1. x0 = x - sigma_i * v (data prediction from the velocity);
2. from the second step on, the corrector refines the current sample x using the x0 just
   computed (no extra model call): it re-takes the previous step with the new x0 included;
3. the predictor moves the (corrected) sample to sigma_{i+1}.

The order is 1 on the first step (no history yet) and on the last step, whose target sigma 0
has infinite log-SNR (a second-order last step would give inf/NaN); 2 elsewhere. The corrector
at step i uses the order the predictor used at step i - 1.

History between steps: the last two x0 estimates and the sample the last predictor started
from, nothing else.
"""

from __future__ import annotations

import torch

from .solver_base import FlowSolver, log_snr

SOLVER_ORDER = 2


def _bh2_corrector_weights(ratio: torch.Tensor, neg_h: torch.Tensor,
                           phi1: torch.Tensor) -> tuple[float, float]:
    """Weights (older difference, newest difference) of the order-2 corrector.

    Solves [[1, 1], [ratio, 1]] rho = b, where b holds the first two phi-function moments
    divided by B(h) = expm1(-h) (the bh2 choice). float32 throughout, like the reference.
    """
    moment1 = phi1 / neg_h - 1
    moment2 = moment1 / neg_h - 0.5
    rhs = torch.stack([moment1 * 1 / phi1, moment2 * 2 / phi1])
    lhs = torch.stack([torch.ones(2), torch.stack([ratio, torch.ones(())])])
    rho = torch.linalg.solve(lhs, rhs)
    return float(rho[0]), float(rho[1])


class UniPCSolver(FlowSolver):
    name = "unipc"

    def __init__(self, schedule):
        super().__init__(schedule)
        self._x0_prev: torch.Tensor | None = None    # x0 estimate of step i-1
        self._x0_prev2: torch.Tensor | None = None   # x0 estimate of step i-2
        self._sample_prev: torch.Tensor | None = None  # where the predictor of step i-1 started
        self._order_prev = 0

    def release(self) -> None:
        self._x0_prev = self._x0_prev2 = self._sample_prev = None

    def _order_at(self, index: int) -> int:
        # Warm-up: at most index + 1; lower order at the end: at most the steps left.
        return min(SOLVER_ORDER, index + 1, self.steps - index)

    def _advance(self, index: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x0 = x - float(self.sigma(index)) * v
        if index > 0 and self._sample_prev is not None:
            x = self._correct(index, x, x0)

        order = self._order_at(index)
        self._x0_prev2, self._x0_prev = self._x0_prev, x0
        self._sample_prev = x
        self._order_prev = order
        return self._predict(index, x, order)

    def _predict(self, index: int, x: torch.Tensor, order: int) -> torch.Tensor:
        """UniP: from sigmas[index] to sigmas[index + 1]."""
        sigma_from, sigma_to = self.sigma(index), self.sigma(index + 1)
        lambda_from = log_snr(sigma_from)
        h = log_snr(sigma_to) - lambda_from
        phi1 = torch.expm1(-h)  # also B(h) for bh2
        x0_weight = (1 - sigma_to) * phi1
        x0 = self._x0_prev
        x_next = float(sigma_to / sigma_from) * x - float(x0_weight) * x0
        if order == 1:
            return x_next
        ratio = (log_snr(self.sigma(index - 1)) - lambda_from) / h
        slope = (self._x0_prev2 - x0) / float(ratio)
        # The order-2 predictor weight of the slope is exactly 1/2.
        return x_next - float(x0_weight) * (0.5 * slope)

    def _correct(self, index: int, x: torch.Tensor, x0_now: torch.Tensor) -> torch.Tensor:
        """UniC: redo the step sigmas[index-1] -> sigmas[index] with x0_now included."""
        sigma_from, sigma_to = self.sigma(index - 1), self.sigma(index)
        lambda_from = log_snr(sigma_from)
        h = log_snr(sigma_to) - lambda_from
        phi1 = torch.expm1(-h)  # also B(h) for bh2
        x0_weight = (1 - sigma_to) * phi1
        x0_from = self._x0_prev
        x_base = float(sigma_to / sigma_from) * self._sample_prev - float(x0_weight) * x0_from
        newest = x0_now - x0_from
        if self._order_prev == 1:
            update = 0.5 * newest
        else:
            ratio = (log_snr(self.sigma(index - 2)) - lambda_from) / h
            older = (self._x0_prev2 - x0_from) / float(ratio)
            rho_older, rho_newest = _bh2_corrector_weights(ratio, -h, phi1)
            update = rho_older * older + rho_newest * newest
        return x_base - float(x0_weight) * update
