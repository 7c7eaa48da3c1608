"""The sampler node's several-GPU path, on the driver's side: check the run, then hand it to
the warm worker group and wait, relaying progress and interrupts.

Everything that can be refused is refused before a worker starts or a weight loads: more GPUs
than there are (naming `gpus` and the count found), block swap (each rank holds its model
whole or sharded), a model not loaded from a file (the ranks load it themselves), a LoRA file
that cannot be read (the ranks apply a model's LoRAs after loading it), and a model, video and
GPU count whose per-rank estimate does not fit (memory.py).
After the run each rank's metrics go into the memory event log (stage "ranks").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import host
from ..pipeline.errors import InputError
from .contracts import ModelSpec, SampleRequest, SampleResult
from .devices import gpus_problem, worker_device_type
from .memory import RankEstimate, check_fits_group

SAMPLE_TASK = ".distributed.sampling:sample"
METRICS_STAGE = "ranks"


@dataclass
class GroupRun:
    handles: list  # WanModelHandle: the model, or the A14B (high_noise, low_noise) pair
    gpus: int
    fsdp: bool
    cfg_parallel: bool
    device_type: str
    mode: str = "auto"
    estimate: RankEstimate | None = None  # what one rank needs (memory.py)
    loras: list[tuple] = field(default_factory=list)  # per handle: ModelSpec.loras

    @classmethod
    def checked(cls, model, low_noise_model, latent_shape, settings) -> "GroupRun":
        problem = gpus_problem(settings.gpus)
        if problem:
            raise InputError(problem)
        if settings.block_swap:
            raise InputError(f"block_swap: {settings.block_swap} with gpus {settings.gpus}; "
                             f"over several GPUs each holds its model whole or sharded: use "
                             f"block_swap 0 (and fsdp to shard)")
        handles = [model] if low_noise_model is None else [model, low_noise_model]
        loras = []
        for name, handle in zip(("model", "low_noise_model"), handles):
            if handle.weight_dtype is None or handle.info is None:
                raise InputError(f"{name}: {handle.name} was not loaded from a file by Wan "
                                 f"Model Loader; the GPUs' processes load the model from its "
                                 f"file")
            loras.append(_lora_specs(name, handle))
        wants_uncond = settings.cfg != 1 or settings.cfg_low_noise not in (None, 1)
        device_type = worker_device_type()
        run = cls(handles, settings.gpus, settings.fsdp, wants_uncond and settings.gpus % 2 == 0,
                  device_type, loras=loras)
        run.estimate = check_fits_group(handles, latent_shape, settings.gpus, settings.fsdp,
                                        run.cfg_parallel, device_type)
        return run

    def specs(self) -> tuple[ModelSpec, ...]:
        loras = self.loras or [()] * len(self.handles)
        return tuple(ModelSpec(checkpoint=str(h.info.path), weight_dtype=h.weight_dtype,
                               attention=h.attention, compile=h.compile, fsdp=self.fsdp,
                               loras=chosen, load_in_turns=load_in_turns(h, self.gpus))
                     for h, chosen in zip(self.handles, loras))

    def sample(self, start: torch.Tensor, cond, uncond, settings, schedule, *,
               boundary: float | None = None, first_frame=None, y=None, clip_tokens=None,
               on_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """The final (normalised) sample of the run, on the CPU."""
        from .group import worker_group

        request = SampleRequest(
            models=self.specs(), start=start.cpu(), cond=cond.cpu(),
            uncond=None if uncond is None else uncond.cpu(), scheduler=settings.scheduler,
            schedule=schedule, cfg=settings.cfg, cfg_low_noise=settings.cfg_low_noise,
            boundary=boundary, first_frame=_cpu(first_frame), y=_cpu(y),
            clip_tokens=_cpu(clip_tokens), mode=self.mode, cfg_parallel=self.cfg_parallel)
        if self.device_type == "cuda" and self.estimate is not None:
            # rank 0 shares GPU 0 with the host: its cached models make way
            host.make_room(self.estimate.total, torch.device("cuda", 0))
        group = worker_group(self.gpus, self.device_type)

        def progress(data):
            if on_step is not None:
                on_step(data["step"] - 1, data["total"])

        began = time.perf_counter()
        result: SampleResult = group.run(SAMPLE_TASK, request, on_progress=progress,
                                         interrupt=host.check_interrupt)
        self.record(result, time.perf_counter() - began)
        return result.latent

    def record(self, result: SampleResult, seconds: float) -> None:
        """One event per rank in the memory event log."""
        from ..profiling.events import record_event

        common = {"gpus": self.gpus, "fsdp": self.fsdp, "cfg_parallel": self.cfg_parallel,
                  "device_type": self.device_type, "driver_seconds": round(seconds, 6)}
        for metrics in result.metrics:
            record_event(f"rank {metrics['rank']}", stage=METRICS_STAGE,
                         extra={**common, **metrics})


def load_in_turns(handle, ranks: int) -> bool:
    """Whether the ranks should load `handle`'s model one after another: each loads its own copy
    on the host before placing or sharding it, and `ranks` copies at once would not fit what the
    host has free now."""
    from ..pipeline import memory_guard as guard
    from ..pipeline.placement import tensor_bytes

    return ranks * tensor_bytes(handle.model) > guard.free_bytes("cpu")


def _lora_specs(name: str, handle) -> tuple:
    """The handle's LoRAs as the ranks apply them (ModelSpec.loras), each file checked now."""
    from ..lora.apply import file_stamp

    specs = []
    for choice in getattr(handle, "loras", ()):
        try:
            stamp = file_stamp(choice.path)
        except OSError as exc:
            raise InputError(f"{name}: its LoRA {choice.name} cannot be read "
                             f"({exc.strerror or exc}); the GPUs' processes apply it from its "
                             f"file") from exc
        specs.append((str(choice.path), float(choice.strength), choice.mode, stamp))
    return tuple(specs)


def _cpu(tensor):
    return None if tensor is None else tensor.cpu()
