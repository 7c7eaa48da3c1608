"""Which model runs at which step: one model, or the Wan2.2 A14B pair of experts.

The A14B models split the trajectory between two experts: the high-noise expert runs while the
integer timestep t >= boundary * 1000, the low-noise expert afterwards, each with its own
guidance scale. Timesteps only decrease, so the active expert changes at most once; the
`on_switch` hook fires before the first step of each expert (and before the very first step),
which is where a caller moves the outgoing expert off the GPU and the incoming one onto it.
`plan()` tells in advance which steps go to which expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .guidance import ModelFn
from .schedules import NUM_TRAIN_TIMESTEPS, FlowSchedule

HIGH_NOISE = "high_noise"
LOW_NOISE = "low_noise"


@dataclass(frozen=True, eq=False)
class Expert:
    name: str
    model: ModelFn
    guidance_scale: float


SwitchHook = Callable[[Optional[Expert], Expert], None]


class ModelSelector:
    """Picks the model and guidance scale for a step from its integer timestep."""

    on_switch: SwitchHook | None = None

    def select(self, timestep: int) -> Expert:
        raise NotImplementedError

    def experts(self) -> list[Expert]:
        """Every model this selector can pick."""
        raise NotImplementedError

    def plan(self, schedule: FlowSchedule) -> list[str]:
        """The expert name of every step of `schedule`."""
        return [self.select(int(t)).name for t in schedule.timesteps]

    def steps_of(self, schedule: FlowSchedule) -> dict[str, list[int]]:
        """Step indices per expert name, in run order."""
        out: dict[str, list[int]] = {}
        for index, name in enumerate(self.plan(schedule)):
            out.setdefault(name, []).append(index)
        return out

    def notify_switch(self, previous: Expert | None, current: Expert) -> None:
        if self.on_switch is not None:
            self.on_switch(previous, current)


class SingleModel(ModelSelector):
    def __init__(self, model: ModelFn, guidance_scale: float = 1.0,
                 on_switch: SwitchHook | None = None):
        self.expert = Expert("model", model, float(guidance_scale))
        self.on_switch = on_switch

    def select(self, timestep: int) -> Expert:
        return self.expert

    def experts(self) -> list[Expert]:
        return [self.expert]


class ExpertPair(ModelSelector):
    """The two A14B experts.

    guidance_scales: (low_noise, high_noise), the order of the official configs (T2V (3.0, 4.0),
    I2V (3.5, 3.5)); a single number applies to both.
    """

    def __init__(self, high_noise_model: ModelFn, low_noise_model: ModelFn, boundary: float,
                 guidance_scales: float | Sequence[float] = 1.0,
                 on_switch: SwitchHook | None = None,
                 num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        if isinstance(boundary, bool) or not isinstance(boundary, (int, float)) \
                or not 0 <= boundary <= 1:
            raise ValueError(f"boundary must be a number in [0, 1], got {boundary!r}")
        if isinstance(guidance_scales, (int, float)):
            low_scale = high_scale = float(guidance_scales)
        else:
            if len(guidance_scales) != 2:
                raise ValueError("guidance_scales must be one number or a "
                                 "(low_noise, high_noise) pair")
            low_scale, high_scale = (float(g) for g in guidance_scales)
        for scale in (low_scale, high_scale):
            if not math.isfinite(scale):
                raise ValueError(f"guidance scale must be finite, got {scale}")
        self.boundary = float(boundary)
        # Compared against the integer timestep as a float, like the official pipeline.
        self.boundary_timestep = self.boundary * num_train_timesteps
        self.high_noise = Expert(HIGH_NOISE, high_noise_model, high_scale)
        self.low_noise = Expert(LOW_NOISE, low_noise_model, low_scale)
        self.on_switch = on_switch

    def is_high_noise(self, timestep: int) -> bool:
        return timestep >= self.boundary_timestep

    def select(self, timestep: int) -> Expert:
        return self.high_noise if self.is_high_noise(timestep) else self.low_noise

    def experts(self) -> list[Expert]:
        return [self.high_noise, self.low_noise]
