"""The denoise loop: one loop for every solver, model, guidance and conditioning mode.

Model contract: `model(x, t, cond) -> v`
- x: float32 [B, C, F, H, W], the current sample (batch 2B when cond and uncond are batched);
- t: float32 [B], the step's timestep on the 0..1000 scale, or [B, F] (one per latent frame)
  when fixed first frames are used: 0 for those, the step's timestep for the others;
- cond: the caller's conditioning, passed through untouched;
- v: the velocity, shape of x, any float dtype (the loop works in float32).
Where the model runs (GPU, offloaded blocks, several GPUs, quantized weights) is the model
callable's business; the loop only calls it. Between experts, the selector's `on_switch` hook
is where weights move.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch

from .experts import Expert, ModelSelector, SingleModel
from .guidance import CfgConditioning, ModelFn, check_guidance_scale, guided_velocity
from .noise import make_noise, noise_latent
from .solver_base import FlowSolver

StepCallback = Callable[[int, int, torch.Tensor], None]

__all__ = ["denoise", "make_noise", "noise_latent", "StepCallback", "NonFiniteSample"]


class NonFiniteSample(RuntimeError):
    """The sample holds NaN or infinite values after a step: what follows would be a black
    video, so the run stops there."""


def _model_timesteps(value: float, x: torch.Tensor, fixed_frames: int) -> torch.Tensor:
    batch, frames = x.shape[0], x.shape[2]
    if not fixed_frames:
        return torch.full((batch,), value, dtype=torch.float32, device=x.device)
    t = torch.full((batch, frames), value, dtype=torch.float32, device=x.device)
    t[:, :fixed_frames] = 0.0  # the given frames are clean
    return t


def checked_first_frame(first_frame: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`first_frame` as [B or 1, C, k, H, W] float32 beside the sample `x` (k leading frames,
    fewer than x has); ValueError when it does not fit."""
    if not isinstance(first_frame, torch.Tensor):
        raise ValueError(f"first_frame is a {type(first_frame).__name__}, not a tensor")
    if first_frame.dim() == 4:
        first_frame = first_frame.unsqueeze(2)
    b, c, _, h, w = x.shape
    if first_frame.dim() != 5 or not 1 <= first_frame.shape[2] < x.shape[2] \
            or tuple(first_frame.shape[i] for i in (1, 3, 4)) != (c, h, w) \
            or first_frame.shape[0] not in (1, b):
        raise ValueError(f"first_frame {list(first_frame.shape)} does not fit the latent "
                         f"{list(x.shape)}: expected [{b}, {c}, 1, {h}, {w}]")
    return first_frame.to(device=x.device, dtype=torch.float32)


def denoise(model: ModelFn | ModelSelector, noise: torch.Tensor, solver: FlowSolver,
            cond: Any = None, *, uncond: Any = None, batched_cond: Any = None,
            guidance_scale: float = 1.0, first_frame: torch.Tensor | None = None,
            callback: StepCallback | None = None,
            interrupt: Callable[[], None] | None = None) -> torch.Tensor:
    """Run every step of `solver.schedule` from `noise` and return the final sample (float32).

    model: a model callable (see the module docstring), or a ModelSelector such as ExpertPair,
        which then also decides the guidance scale per step (`guidance_scale` is ignored).
    noise: [B, C, F, H, W], the sample at the schedule's first sigma: pure noise for
        generation, `noise_latent(clean, noise, schedule)` for a partial denoise. Not modified.
    solver: a fresh solver for this run (`make_solver(name, schedule)`).
    cond / uncond / batched_cond: conditionings passed to the model; `batched_cond` (cond and
        uncond joined along the batch, cond rows first) selects one batch-2 forward per step.
    guidance_scale: classifier-free guidance; 1 runs the cond forward only.
    first_frame: [B, C, k, H, W] clean leading latent frames kept fixed (image-to-video):
        written into frames 0..k-1 before the first step and after every step; the model sees
        t = 0 for them.
    callback(step_index, total_steps, x): after every step, x is the new sample (read only).
    interrupt(): called before every step; it aborts the run by raising, and the exception
        propagates unchanged after the run's tensors have been let go.
    """
    if noise.dim() != 5:
        raise ValueError(f"noise must be [B, C, F, H, W], got {list(noise.shape)}")
    if solver.step_index != 0:
        raise ValueError("the solver has already been used; create one solver per run")
    selector = model if isinstance(model, ModelSelector) else SingleModel(model, guidance_scale)
    conditioning = CfgConditioning(cond, uncond, batched_cond)
    for candidate in selector.experts():
        check_guidance_scale(candidate.guidance_scale, conditioning)

    schedule = solver.schedule
    total = schedule.steps
    x = noise.to(torch.float32)
    fixed = None
    if first_frame is not None:
        fixed = checked_first_frame(first_frame, x)
        x = x.clone()  # never write into the caller's tensor
        x[:, :, :fixed.shape[2]] = fixed

    active: Expert | None = None
    try:
        for index in range(total):
            if interrupt is not None:
                interrupt()
            timestep = schedule.timestep(index)
            expert = selector.select(timestep)
            if active is None or expert.name != active.name:
                selector.notify_switch(active, expert)
                active = expert
            t = _model_timesteps(float(timestep), x, 0 if fixed is None else fixed.shape[2])
            v = guided_velocity(expert.model, x, t, conditioning, expert.guidance_scale)
            x = solver.step(v, x)
            del v, t
            if not bool(torch.isfinite(x).all()):
                raise NonFiniteSample(
                    f"the sample holds NaN or infinite values after step {index + 1} of {total}"
                    + (f" ({expert.name} expert)" if selector.experts()[1:] else "")
                    + ": the model's weights or a LoRA merged into them give non-finite "
                      "outputs (a NaN in a file, an alpha too large); stopped before decoding "
                      "a black video")
            if fixed is not None:
                x[:, :, :fixed.shape[2]] = fixed
            if callback is not None:
                callback(index, total, x)
        return x
    except BaseException as exc:
        # The traceback keeps this frame and the frames below it alive: drop our tensors and
        # the locals of the finished frames the exception came through (the model's).
        x = v = t = fixed = expert = active = None  # noqa: F841
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        solver.release()
