"""MagCache for Wan2.1 and Wan2.2 as its reference decides (MagCache4Wan2.1 and MagCache4Wan2.2
magcache_generate.py, github.com/Zehong-Ma/MagCache at df81cb181776c2c61477c08e1d21f87fda1cd938):
a SkipPolicy for sampling/residual_cache.py.

The reference counts sampling calls (two a step: conditional, then unconditional) and keeps per
branch an accumulated magnitude ratio, error and skip count. On a call past the retention
window it multiplies the accumulated ratio by the published ratio of that call, counts one more
step, adds |1 - accumulated ratio| to the error, and skips while the error stays under the
threshold and the count under max_skips + 1 (magcache_K); otherwise the call runs and the
branch's ratio, error and count start over. The decisions depend on the table and the step
count only, so they are planned when the run starts.

Tables (sampling/magcache_ratios.py) get the reference's leading pair of 1.0 and, for a run of
another step count than the table's, are resampled per branch to nearest entries
(round(i * (n_table - 1) / (steps - 1)), numpy's round half to even; one step takes the last).

Retention window (calls that always run): Wan2.1 and TI2V-5B: the first
int(2 steps * retention_ratio) calls. An A14B pair (one plan over both experts, `split` = the
calls of the high-noise expert): T2V: the first int(split * retention_ratio) calls, and the
low-noise expert's calls from `split` to (2 steps - split) * retention_ratio + split inclusive
(compared in float32, as the reference's tensor counter compares);
I2V: every call before int(split + (2 steps - split) * retention_ratio).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the reference scripts' defaults: magcache_thresh (Wan2.1 0.12, Wan2.2 0.04), magcache_K and
# retention_ratio
DEFAULT_THRESHOLD = {"wan2.1": 0.12, "wan2.2": 0.04}
DEFAULT_MAX_SKIPS = 2
DEFAULT_RETENTION = 0.2


def per_call_ratios(table: tuple[float, ...], steps: int) -> list[float]:
    """The table with its leading (1.0, 1.0), resampled to `steps` steps where its length
    differs: [cond, uncond] per step."""
    ratios = np.array((1.0, 1.0) + tuple(table))
    if len(ratios) == 2 * steps:
        return ratios.tolist()
    branches = []
    for branch in (ratios[0::2], ratios[1::2]):
        if steps == 1:
            branches.append(branch[-1:])
            continue
        scale = (len(branch) - 1) / (steps - 1)
        branches.append(branch[np.round(np.arange(steps) * scale).astype(int)])
    return np.stack(branches, axis=1).reshape(-1).tolist()


@dataclass(frozen=True)
class MagCacheSettings:
    table: tuple[float, ...]  # published ratios, without the leading pair
    threshold: float
    max_skips: int = DEFAULT_MAX_SKIPS
    retention_ratio: float = DEFAULT_RETENTION
    # A14B pair: the high-noise expert's step count (None: one model) and the pair's kind
    high_noise_steps: int | None = None
    image_to_video: bool = False


def retained(call: int, calls: int, settings: MagCacheSettings) -> bool:
    """Whether call `call` of `calls` runs whatever the ratios say (the retention window)."""
    r = settings.retention_ratio
    if settings.high_noise_steps is None:
        return call < int(calls * r)
    split = 2 * settings.high_noise_steps
    if settings.image_to_video:
        return call < int(split + (calls - split) * r)
    # the Wan2.2 reference counts calls in a torch integer tensor: its comparison with this
    # float bound runs in float32
    low_end = float(np.float32((calls - split) * r + split))
    return call < int(split * r) or split <= call <= low_end


def plan(settings: MagCacheSettings, steps: int) -> list[bool]:
    """Whether each call of a run of `steps` steps skips: [2 * step + branch]."""
    ratios = per_call_ratios(settings.table, steps)
    calls = 2 * steps
    ratio, error, count = [1.0, 1.0], [0.0, 0.0], [0, 0]
    skips = []
    for call in range(calls):
        branch = call % 2
        if retained(call, calls, settings):
            skips.append(False)
            continue
        ratio[branch] *= ratios[call]
        count[branch] += 1
        error[branch] += abs(1 - ratio[branch])
        if error[branch] < settings.threshold and count[branch] <= settings.max_skips:
            skips.append(True)
            continue
        ratio[branch], error[branch], count[branch] = 1.0, 0.0, 0
        skips.append(False)
    return skips


class MagCache:
    """MagCache's decisions over a run of `steps` steps."""

    def __init__(self, settings: MagCacheSettings, steps: int):
        self.settings = settings
        self.plan = plan(settings, steps)

    def skips(self, step: int, branch: int, e: torch.Tensor, e0: torch.Tensor) -> bool:
        return self.plan[2 * step + branch]
