"""Step caching: a step whose input changed little since the last full forward reuses that
forward's residual instead of running the model (EasyCache).

EasyCache, as ComfyUI's EasyCache node computes it (comfy_extras/nodes_easycache.py), around a
model callable `model(x, t, cond) -> v` (sampling/guidance.py):

- Every full forward keeps, per branch (conditional, unconditional), the residual
  `v - x`; a skipped step returns `x + residual` for each branch it is asked for.
- One branch decides for the step: the unconditional one when guidance runs it (ComfyUI runs it
  first), else the conditional one. From the first step at or below the start sigma on, the
  decider's input and output are remembered (every eighth latent pixel in height and width):
  the input change is the mean absolute difference of the subsampled input to the last full
  forward's; once a transformation rate k (output change over input change between the last two
  full forwards) is known, each step adds k * input change / mean |last output| to a running
  sum, and skips while that sum stays under the threshold (and every branch asked for has a
  residual); a full forward resets the sum.
- Steps at or below the end sigma always run in full and leave the state as it is.
- The mean |last output| is taken over the whole output of the forward that held the decider
  (both branches when they run as one batch), as ComfyUI takes it.

Sigmas are the step's timestep over 1000; the start and end sigmas are ComfyUI's
`percent_to_sigma` of a shifted flow: sigma(p) = shift (1 - p) / (1 + (shift - 1)(1 - p)). They
are compared in float32, as ComfyUI compares its float32 sigma with them.
The state is per sampling run and per model (an A14B pair's experts each keep their own, as
two ComfyUI samplers with EasyCache do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .guidance import ModelFn
from .schedules import NUM_TRAIN_TIMESTEPS, shift_sigmas

COND, UNCOND = "cond", "uncond"
# the sampler's cache values: EasyCache here; TeaCache (sampling/teacache.py; ret_steps: its
# use_ret_steps variant) and MagCache (sampling/magcache.py) skip the DiT's blocks
# (sampling/residual_cache.py)
CACHE_METHODS = ("off", "easycache", "teacache", "teacache_ret_steps", "magcache")


@dataclass(frozen=True)
class EasyCacheSettings:
    threshold: float = 0.2
    start_percent: float = 0.15
    end_percent: float = 0.95
    subsample: int = 8


def percent_to_sigma(percent: float, shift: float) -> float:
    """ComfyUI's percent_to_sigma of a flow model with `shift` (ModelSamplingDiscreteFlow)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return float(shift_sigmas(1.0 - percent, shift))


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


@dataclass
class _State:
    started: bool = False  # a step at or below the start sigma was seen
    x_prev: torch.Tensor | None = None
    output_prev: torch.Tensor | None = None
    output_prev_norm: torch.Tensor | None = None
    rate: torch.Tensor | None = None  # the transformation rate k
    accumulated: Any = 0.0
    skip_step: bool = False
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)


class EasyCacheModel:
    """A model callable with EasyCache around `model` for one sampling run.

    cond / uncond / batched: the conditionings the loop passes (guidance.CfgConditioning); a
    call is told apart by which of them it gets. `uses_uncond`: guidance runs the
    unconditional branch (then it decides)."""

    def __init__(self, model: ModelFn, settings: EasyCacheSettings, shift: float, *,
                 cond: Any, uncond: Any = None, batched: Any = None, uses_uncond: bool = False):
        self.model = model
        self.settings = settings
        self.start_sigma = _float32(percent_to_sigma(settings.start_percent, shift))
        self.end_sigma = _float32(percent_to_sigma(settings.end_percent, shift))
        self.cond, self.uncond, self.batched = cond, uncond, batched
        self.decider = UNCOND if uses_uncond else COND
        self.state = _State()
        self.skipped: list[int] = []  # indices (among the steps it saw) of the steps skipped
        self.steps = 0  # steps seen
        self._step_sigma: float | None = None
        self._t: torch.Tensor | None = None  # the last call's timesteps, and their sigma
        self._sigma = 0.0
        self._input_change: torch.Tensor | None = None

    def _branches(self, conditioning: Any) -> list[str]:
        if conditioning is self.batched and self.batched is not None:
            return [COND, UNCOND]  # the loop's batch: cond rows first
        if conditioning is self.uncond and self.uncond is not None:
            return [UNCOND]
        return [COND]

    def _subsample(self, tensor: torch.Tensor, branches: list[str]) -> torch.Tensor:
        """The decider's rows of a call's tensor, thinned."""
        rows = tensor.shape[0] // len(branches)
        index = branches.index(self.decider)
        return self._thin(tensor[index * rows:(index + 1) * rows])

    def _thin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every `subsample`-th latent pixel in height and width."""
        step = self.settings.subsample
        return tensor[..., ::step, ::step] if step > 1 else tensor

    def __call__(self, x: torch.Tensor, t: torch.Tensor, conditioning: Any) -> torch.Tensor:
        if t is not self._t:  # a step's calls share its timesteps: read them (a device sync)
            # once a step rather than once a call
            self._t, self._sigma = t, _float32(float(t.max()) / NUM_TRAIN_TIMESTEPS)
        sigma = self._sigma
        branches = self._branches(conditioning)
        if not sigma > self.end_sigma:
            return self.model(x, t, conditioning)
        state = self.state
        if sigma != self._step_sigma:  # the step's first call: the step is decided here
            self._step_sigma = sigma
            self.steps += 1
            self._decide(x, branches, sigma)
        if state.skip_step and all(b in state.residuals for b in branches):
            return self._reuse(x, branches)
        output = self.model(x, t, conditioning)
        decides = state.started and self.decider in branches
        if decides and state.output_prev_norm is not None:
            output_change = (self._subsample(output, branches) - state.output_prev) \
                .flatten().abs().mean()
            if self._input_change is not None:
                state.rate = output_change / self._input_change
        residual = output - x
        rows = residual.shape[0] // len(branches)
        for i, branch in enumerate(branches):
            state.residuals[branch] = residual[i * rows:(i + 1) * rows]
        if decides:
            state.x_prev = self._subsample(x, branches).clone()
            state.output_prev = self._subsample(output, branches).clone()
            state.output_prev_norm = output.flatten().abs().mean()
        return output

    def _decide(self, x: torch.Tensor, branches: list[str], sigma: float) -> None:
        """Whether this step is skipped, from its input alone (every branch of a step gets the
        same input, so the decider's view of it is at hand whichever branch comes first)."""
        state = self.state
        state.skip_step = False
        self._input_change = None
        if sigma > self.start_sigma:
            return
        state.started = True
        if state.x_prev is not None:
            rows = x.shape[0] // len(branches)
            decider_input = self._thin(x[:rows])  # the same input as the decider's rows
            self._input_change = (decider_input - state.x_prev).flatten().abs().mean()
        if state.output_prev_norm is not None and state.rate is not None:
            state.accumulated = state.accumulated + \
                state.rate * self._input_change / state.output_prev_norm
            needed = (COND, UNCOND) if self.decider == UNCOND else (COND,)
            if state.accumulated < self.settings.threshold and \
                    all(b in state.residuals for b in needed):
                state.skip_step = True
                self.skipped.append(self.steps - 1)
                return
            state.accumulated = 0.0

    def _reuse(self, x: torch.Tensor, branches: list[str]) -> torch.Tensor:
        rows = x.shape[0] // len(branches)
        out = x.clone()
        for i, branch in enumerate(branches):
            out[i * rows:(i + 1) * rows] += self.state.residuals[branch]
        return out
