"""TeaCache for Wan2.1 as its reference decides (TeaCache4Wan2.1/teacache_generate.py,
github.com/ali-vilab/TeaCache at 7c10efc4702c6b619f47805f7abe4a7a08085aa0): a SkipPolicy for
sampling/residual_cache.py.

Per branch (conditional, unconditional: the reference's even and odd calls), each call compares
its modulated input with the branch's previous call's: the time embedding e, or with
`ret_steps` (the reference's use_ret_steps) its projection e0. The relative L1 change
mean |now - before| / mean |before| (float32) is rescaled by the model's published polynomial
and added to the branch's running sum; the call skips while the sum stays under the threshold,
and a call that runs resets the sum. Always run: the first step, and the last one; with
ret_steps the first five steps and no last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Published rescaling polynomials, highest power first (numpy.poly1d's order), per model and
# per modulated input: False for e (the default), True for e0 (use_ret_steps).
COEFFICIENTS: dict[str, dict[bool, tuple[float, ...]]] = {
    "wan2.1-t2v-1.3b": {
        False: (2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00,
                1.37887774e-01),
        True: (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01,
               -4.99875664e-02),
    },
    "wan2.1-t2v-14b": {
        False: (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404),
        True: (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01,
               -3.15583525e-01),
    },
    "wan2.1-i2v-14b-480p": {
        False: (-3.02331670e+02, 2.23948934e+02, -5.25463970e+01, 5.87348440e+00,
                -2.01973289e-01),
        True: (2.57151496e+05, -3.54229917e+04, 1.40286849e+03, -1.35890334e+01,
               1.32517977e-01),
    },
    "wan2.1-i2v-14b-720p": {
        False: (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683),
        True: (8.10705460e+03, 2.13393892e+03, -3.72934672e+02, 1.66203073e+01,
               -4.17769401e-02),
    },
}

# the reference script's default teacache_thresh, for every model and either input
DEFAULT_THRESHOLD = 0.2


def polynomial(coefficients: tuple[float, ...], x: float) -> float:
    """sum c_i x^(n-i), by Horner's rule in float64 as numpy.polyval evaluates it."""
    y = 0.0
    for c in coefficients:
        y = y * x + c
    return y


@dataclass(frozen=True)
class TeaCacheSettings:
    coefficients: tuple[float, ...]
    threshold: float = DEFAULT_THRESHOLD
    ret_steps: bool = False  # compare e0, keep the first 5 steps (else e, first and last step)


@dataclass
class TeaCache:
    """TeaCache's decisions over a run of `steps` steps."""
    settings: TeaCacheSettings
    steps: int
    _previous: dict[int, torch.Tensor] = field(default_factory=dict)
    _accumulated: dict[int, float] = field(default_factory=dict)

    def always_runs(self, step: int) -> bool:
        if self.settings.ret_steps:
            return step < 5
        return step < 1 or step >= self.steps - 1

    def skips(self, step: int, branch: int, e: torch.Tensor, e0: torch.Tensor) -> bool:
        now = e0 if self.settings.ret_steps else e
        before = self._previous.get(branch)
        self._previous[branch] = now.clone()
        if self.always_runs(step) or before is None:
            self._accumulated[branch] = 0.0
            return False
        change = ((now - before).abs().mean() / before.abs().mean()).item()
        total = self._accumulated.get(branch, 0.0) + polynomial(self.settings.coefficients,
                                                                change)
        if total < self.settings.threshold:
            self._accumulated[branch] = total
            return True
        self._accumulated[branch] = 0.0
        return False
