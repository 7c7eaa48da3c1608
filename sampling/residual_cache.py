"""Step caches that skip the DiT's transformer blocks (TeaCache, MagCache): on a skipped call the
tokens entering the first block get the residual of the branch's last full pass added (the last
block's output minus the first block's input) and the head runs on them as usual.

`ResidualCache.model(forward)` turns the pipeline's DiT call `forward(x, t, conditioning,
block_stack)` (block_stack: a wan/dit.py BlockStackHook) into a model callable for the denoise
loop. Calls are told apart by their conditioning: the conditional branch (0) or the
unconditional one (1), the references' even and odd calls. The loop (sampling/guidance.py) calls
the conditional branch first in every step, so a conditional call begins a step. Which calls
skip is a policy's (`SkipPolicy.skips`, asked once per call, in call order); a call the policy
would skip with no residual of its branch at hand yet runs the blocks.

One cache serves one sampling run; an A14B pair may share one (MagCache keeps one state over
both experts, as its reference does).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Protocol

import torch

from ..wan.dit import BlockStackHook
from .guidance import ModelFn

COND_BRANCH, UNCOND_BRANCH = 0, 1

# the pipeline's DiT call with a hook around its blocks
CachedForward = Callable[[torch.Tensor, torch.Tensor, Any, BlockStackHook], torch.Tensor]


class SkipPolicy(Protocol):
    """Decides, per call, whether the blocks are skipped. step: 0-based step of the run;
    branch: COND_BRANCH or UNCOND_BRANCH; e [B, G, D], e0 [B, G, 6, D]: the call's time
    embedding and its projection (wan/dit.py)."""

    def skips(self, step: int, branch: int, e: torch.Tensor, e0: torch.Tensor) -> bool:
        ...


class ResidualCache:
    """Per-branch residuals of the block stack, reused on the calls `policy` skips.

    steps: the run's step count; cond / uncond: the conditionings the loop passes."""

    def __init__(self, policy: SkipPolicy, steps: int, *, cond: Any, uncond: Any = None):
        self.policy = policy
        self.steps = steps
        self.cond, self.uncond = cond, uncond
        self.residuals: dict[int, torch.Tensor] = {}
        self.step = -1  # the step of the last call
        self.skipped: list[tuple[int, int]] = []  # (step, branch) of each call that skipped
        self.calls = 0  # calls seen

    def model(self, forward: CachedForward) -> ModelFn:
        """A model callable `(x, t, conditioning) -> v` running `forward` with this cache."""
        def call(x: torch.Tensor, t: torch.Tensor, conditioning: Any) -> torch.Tensor:
            branch = self._branch(conditioning)
            if branch == COND_BRANCH:
                self.step += 1
            if not 0 <= self.step < self.steps:
                raise ValueError(f"step cache: a call for step {self.step + 1} of a run of "
                                 f"{self.steps} steps (each step begins with the conditional "
                                 f"branch)")
            self.calls += 1
            return forward(x, t, conditioning, partial(self._blocks, branch))
        return call

    def _branch(self, conditioning: Any) -> int:
        if conditioning is self.cond:
            return COND_BRANCH
        if self.uncond is not None and conditioning is self.uncond:
            return UNCOND_BRANCH
        raise ValueError("step cache: a call with a conditioning that is neither the run's "
                         "conditional nor its unconditional one")

    def _blocks(self, branch: int, tokens: torch.Tensor, e: torch.Tensor, e0: torch.Tensor,
                run_blocks: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        skip = self.policy.skips(self.step, branch, e, e0)
        residual = self.residuals.get(branch)
        if skip and residual is not None:
            self.skipped.append((self.step, branch))
            return tokens.add_(residual)
        self.residuals.pop(branch, None)  # (let it go before the blocks' activations come)
        first = tokens.clone()  # the blocks update `tokens` in place
        out = run_blocks(tokens)
        self.residuals[branch] = first.neg_().add_(out)  # out - first, in first's memory
        return out
