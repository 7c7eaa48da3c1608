"""Classifier-free guidance: v = u + g * (c - u), in float32.

The model contract is `model(x, t, cond) -> v`; conditionings are opaque to this module. To
batch cond and uncond into one forward, the caller provides `batched`: the two conditionings
already joined along the batch axis, cond rows first (only the caller knows how to join its
conditioning, e.g. text embeddings padded to the same length). Without it, or when the caller
does not want the larger batch, two forwards run. A scale of exactly 1 needs no uncond at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

ModelFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True, eq=False)
class CfgConditioning:
    cond: Any
    uncond: Any = None
    # cond and uncond joined along the batch axis (cond rows first) for a batch-2 forward.
    batched: Any = None


def check_guidance_scale(scale: float, conditioning: CfgConditioning) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"guidance scale must be a finite number, got {scale!r}")
    if scale != 1 and conditioning.uncond is None and conditioning.batched is None:
        raise ValueError(f"guidance scale {scale} needs an unconditional input (uncond)")


def combine_guidance(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    v_cond = v_cond.to(torch.float32)
    v_uncond = v_uncond.to(torch.float32)
    return v_uncond + float(scale) * (v_cond - v_uncond)


def guided_velocity(model: ModelFn, x: torch.Tensor, t: torch.Tensor,
                    conditioning: CfgConditioning, scale: float) -> torch.Tensor:
    """The guided velocity at (x, t), float32. One forward for scale 1, else one or two."""
    if scale == 1:
        return model(x, t, conditioning.cond).to(torch.float32)
    if conditioning.batched is not None:
        batch = x.shape[0]
        both = model(torch.cat([x, x]), torch.cat([t, t]), conditioning.batched)
        if both.shape[0] != 2 * batch:
            raise ValueError(f"batched guidance: the model returned batch {both.shape[0]}, "
                             f"expected {2 * batch} (cond rows then uncond rows)")
        return combine_guidance(both[:batch], both[batch:], scale)
    if conditioning.uncond is None:
        raise ValueError(f"guidance scale {scale} needs an unconditional input (uncond)")
    v_cond = model(x, t, conditioning.cond)
    v_uncond = model(x, t, conditioning.uncond)
    return combine_guidance(v_cond, v_uncond, scale)
