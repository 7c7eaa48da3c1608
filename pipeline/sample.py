"""Sampling a video latent with a Wan DiT (or the two Wan2.2 A14B experts).

LATENT follows ComfyUI: samples are raw VAE latents (not normalised), float32 on the CPU. The
DiT works on normalised latents, so they are normalised on the way in and restored on the way
out. CONDITIONING follows ComfyUI too: [[rows [1, L, 4096], {...}]]; ours and ComfyUI's own
umT5 encoding both work. The keys either may carry (a start image, ComfyUI's noise_mask and
WanImageToVideo's keys) are read by sampler_inputs.py (contracts.py lists them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .. import host
from ..sampling.experts import HIGH_NOISE, ExpertPair, SingleModel
from ..sampling.loop import denoise as run_denoise
from ..sampling.loop import noise_latent
from ..sampling.solvers import SOLVER_NAMES, make_schedule, make_solver
from ..sampling.magcache import MagCache
from ..sampling.residual_cache import ResidualCache
from ..sampling.step_cache import EasyCacheModel
from ..sampling.teacache import TeaCache
from ..wan.configs import EXPERT_BOUNDARY
from .handles import WanModelHandle
from .dit_placement import DiTPlacement
from .placement import DevicePlacement
from .errors import InputError
from .native_keys import noise_for
from .sampler_inputs import gather_inputs
from .step_caches import CacheChoice, cache_choice

_LOG = logging.getLogger("wan_enhanced")

BLOCK_SWAP_FIT = -1  # block_swap: the fewest blocks that let the run fit (memory_guard)


@dataclass(frozen=True)
class SamplerSettings:
    seed: int
    steps: int = 30
    cfg: float = 5.0
    shift: float = 5.0
    scheduler: str = "unipc"
    denoise: float = 1.0
    # Wan2.2 A14B: the low-noise expert's guidance scale (None: same as cfg) and the switch point
    # (None: the pair's own, EXPERT_BOUNDARY: T2V 0.875, I2V 0.900)
    cfg_low_noise: float | None = None
    boundary: float | None = None
    # placement: the first `block_swap` DiT blocks stream from CPU memory (BLOCK_SWAP_FIT: as
    # few as fit the free device memory), `prefetch_blocks` copied ahead of the one computing
    block_swap: int = 0
    prefetch_blocks: int = 1
    # several GPUs (distributed/): the run split over this many, the blocks sharded with fsdp
    gpus: int = 1
    fsdp: bool = False
    # step caching (pipeline/step_caches.py): "off" or a method of CACHE_METHODS; its threshold
    # (None: the method's default)
    cache: str = "off"
    cache_threshold: float | None = None


def _fitting_block_swap(model: WanModelHandle, latent_shape, device: torch.device,
                        prefetch_blocks: int, cache_branches: int = 0) -> int:
    """memory_guard.fitting_block_swap, said once in the log (an A14B pair's experts have one
    shape, so the high-noise expert's count serves both)."""
    from .memory_guard import fitting_block_swap

    count = fitting_block_swap(model, latent_shape, device, prefetch_blocks, cache_branches)
    blocks = len(getattr(model.model, "blocks", []))
    _LOG.info("Wan Sampler: block_swap %d: %s of %s's %d blocks stream from CPU memory",
              BLOCK_SWAP_FIT, count, model.name, blocks)
    return count


def expert_boundary(boundary: float | None, model: WanModelHandle) -> float:
    """The switch point of an A14B pair: as given, or the one its kind was released with (the
    I2V experts take 20 image channels beside the 16 latent ones)."""
    if boundary is not None:
        return boundary
    image_to_video = model.config.in_dim > model.latent_channels
    return EXPERT_BOUNDARY["i2v" if image_to_video else "t2v"]


def check_finite(settings: SamplerSettings) -> None:
    """No NaN or infinity in a number of the settings (a linked value is seen only here)."""
    for name in ("cfg", "shift", "denoise", "boundary", "cfg_low_noise", "cache_threshold"):
        value = getattr(settings, name)
        if value is not None and not math.isfinite(value):
            raise InputError(f"{name}: {value} is not a finite number")


def schedule_for(settings: SamplerSettings):
    """`steps` model steps; with denoise < 1 they cover the last part of a longer schedule of
    steps / denoise steps, as ComfyUI's samplers do."""
    if settings.scheduler not in SOLVER_NAMES:
        raise InputError(f"scheduler: {settings.scheduler!r} is not one of {list(SOLVER_NAMES)}")
    if not 0 < settings.denoise <= 1:
        raise InputError(f"denoise: {settings.denoise} is outside (0, 1]")
    total = max(settings.steps, int(settings.steps / settings.denoise))
    full = make_schedule(settings.scheduler, total, settings.shift)
    return full.tail(total - settings.steps) if total > settings.steps else full


def _dit_fn(handle: WanModelHandle, placement: DiTPlacement, y: torch.Tensor | None = None,
            clip_tokens: torch.Tensor | None = None):
    """The model callable of `handle`; its optional block_stack is a step cache's hook
    (sampling/residual_cache.py)."""
    def forward(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                block_stack=None) -> torch.Tensor:
        return handle.model(x, t, context, y=y, clip_tokens=clip_tokens,
                            attention=handle.attention, compiled=handle.compile,
                            blocks=placement.blocks(handle),
                            between_blocks=host.check_interrupt, block_stack=block_stack)
    return forward


def residual_cache(cache: CacheChoice, schedule, cond, uncond,
                   high_noise_steps: int | None) -> ResidualCache:
    """TeaCache or MagCache over the run's `schedule` (one state for an A14B pair, as MagCache's
    reference keeps)."""
    steps = schedule.steps
    policy = TeaCache(cache.teacache(), steps) if cache.method != "magcache" else \
        MagCache(cache.magcache(high_noise_steps), steps)
    return ResidualCache(policy, steps, cond=cond, uncond=uncond)


def sample(model: WanModelHandle, positive, negative, latent: dict, settings: SamplerSettings,
           *, low_noise_model: WanModelHandle | None = None, device=None,
           on_step: Callable[[int, int], None] | None = None) -> dict:
    """Denoise `latent` and return a new LATENT (CPU, float32, raw VAE space)."""
    device = torch.device(device) if device is not None else host.compute_device()
    inputs = gather_inputs(model, positive, negative, latent, settings.cfg != 1 or (
        settings.cfg_low_noise not in (None, 1)))
    clean, cond, uncond = inputs.samples, inputs.cond, inputs.uncond
    first_frame, condition, clip_tokens = (inputs.fixed_frames, inputs.image_condition,
                                           inputs.clip_tokens)
    if low_noise_model is not None:
        if low_noise_model.config != model.config.renamed(low_noise_model.config.name):
            raise InputError(f"low_noise_model: {low_noise_model.name} does not have the shape "
                             f"of {model.name}; the A14B experts are a matching pair")
    if settings.block_swap < BLOCK_SWAP_FIT or settings.prefetch_blocks < 1:
        raise InputError(f"block_swap {settings.block_swap} / prefetch_blocks "
                         f"{settings.prefetch_blocks}: expected block_swap >= 0 (0: no swap; "
                         f"{BLOCK_SWAP_FIT}: as few as fit) and prefetch_blocks >= 1")
    check_finite(settings)
    if settings.gpus < 1 or (settings.fsdp and settings.gpus == 1):
        raise InputError(f"gpus {settings.gpus} / fsdp {settings.fsdp}: expected gpus >= 1, and "
                         f"fsdp only with gpus > 1 (it shards the model over them)")
    schedule = schedule_for(settings)
    cache = cache_choice(settings.cache, settings.cache_threshold, model, low_noise_model,
                         clean.shape, first_frame is not None)
    fmt = model.latent_format
    group_run = None
    if settings.gpus > 1:  # refused here, before anything is allocated or started
        if cache is not None:
            raise InputError(f"cache: {settings.cache} runs on one GPU; with gpus "
                             f"{settings.gpus} set it to off")
        from ..distributed.sampler import GroupRun
        if settings.block_swap == BLOCK_SWAP_FIT:  # several GPUs share the blocks instead
            settings = replace(settings, block_swap=0)
        group_run = GroupRun.checked(model, low_noise_model, clean.shape, settings)
    else:
        if device.type == "cuda":  # a warm several-GPU group holds GPU memory: let it go
            from ..distributed.group import shutdown_worker_group
            shutdown_worker_group()
        from .memory_guard import check_sampling  # before the first latent-sized allocation
        # TeaCache / MagCache keep the block stack's residual of each guidance branch
        branches = 0 if cache is None or cache.method == "easycache" else \
            (1 if uncond is None else 2)
        if settings.block_swap == BLOCK_SWAP_FIT:
            settings = replace(settings, block_swap=_fitting_block_swap(
                model, clean.shape, device, settings.prefetch_blocks, branches))
        check_sampling(model, clean.shape, device, settings.block_swap, settings.prefetch_blocks,
                       branches)

    noise = noise_for(latent, clean.shape, settings.seed)
    if settings.denoise < 1:
        start = noise_latent(fmt.normalise(clean), noise, schedule)
    else:
        start = noise
    del noise
    if group_run is not None:
        result = group_run.sample(
            start, cond, uncond, settings, schedule,
            boundary=None if low_noise_model is None else expert_boundary(settings.boundary,
                                                                          model),
            first_frame=None if first_frame is None else fmt.normalise(first_frame), y=condition,
            clip_tokens=clip_tokens, on_step=on_step)
        return {"samples": fmt.denormalise(result)}

    y = None if condition is None else condition.to(device, torch.float32)
    image_tokens = None if clip_tokens is None else clip_tokens.to(device, torch.float32)
    cond = cond.to(device, torch.float32)
    uncond = None if uncond is None else uncond.to(device, torch.float32)
    cached = []  # EasyCache: the step caches of this run, one per model
    blocks_cache = None  # TeaCache / MagCache: one for the run
    if cache is not None and cache.method != "easycache":
        high_noise_steps = None
        if low_noise_model is not None:  # the steps the pair below gives its high-noise expert
            pair = ExpertPair(None, None, expert_boundary(settings.boundary, model))
            high_noise_steps = pair.plan(schedule).count(HIGH_NOISE)
        blocks_cache = residual_cache(cache, schedule, cond, uncond, high_noise_steps)

    def model_fn(handle: WanModelHandle, scale: float):
        fn = _dit_fn(handle, dit_placement, y, image_tokens)
        if cache is None:
            return fn
        if blocks_cache is not None:
            return blocks_cache.model(fn)
        cached.append(EasyCacheModel(fn, cache.easycache, settings.shift, cond=cond,
                                     uncond=uncond, uses_uncond=scale != 1))
        return cached[-1]

    with DevicePlacement(device) as placement, DiTPlacement(
            placement, settings.block_swap, settings.prefetch_blocks) as dit_placement:
        if low_noise_model is None:
            dit_placement.place(model)
            selector = SingleModel(model_fn(model, settings.cfg), settings.cfg)
        else:
            handles = {"high_noise": model, "low_noise": low_noise_model}
            low_cfg = settings.cfg if settings.cfg_low_noise is None else settings.cfg_low_noise
            selector = ExpertPair(
                model_fn(model, settings.cfg),
                model_fn(low_noise_model, low_cfg),
                expert_boundary(settings.boundary, model),
                (low_cfg, settings.cfg),
                on_switch=lambda _old, new: dit_placement.place(handles[new.name]))

        def step_done(index: int, total: int, _x: torch.Tensor) -> None:
            if on_step is not None:
                on_step(index, total)

        result = run_denoise(
            selector, start.to(device), make_solver(settings.scheduler, schedule),
            cond, uncond=uncond,
            first_frame=None if first_frame is None else fmt.normalise(first_frame).to(device),
            callback=step_done, interrupt=host.check_interrupt)
        out = fmt.denormalise(result).to("cpu")
        del result
    if cached:
        skipped = sum(len(c.skipped) for c in cached)
        _LOG.info("Wan Sampler: %s skipped %d of %d steps; the output is an approximation of "
                  "the full run", cache.describe(), skipped, schedule.steps)
    if blocks_cache is not None:
        _LOG.info("Wan Sampler: %s skipped the transformer blocks in %d of %d forwards over %d "
                  "steps; the output is an approximation of the full run", cache.describe(),
                  len(blocks_cache.skipped), blocks_cache.calls, schedule.steps)
    return {"samples": out}

