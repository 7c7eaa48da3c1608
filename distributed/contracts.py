"""What the driver sends the worker group for a run, and what comes back: small typed records.

Tensors in them travel by value (messages.py) and are CPU tensors; each rank moves what it needs
to its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ModelSpec:
    """How every rank gets the same DiT. Exactly one source:

    checkpoint: a model file (or folder) loaded as the Wan Model Loader loads it (weight_dtype);
    golden:     the weights of a golden reference file (conformance/golden_file.py);
    state:      a state dict sent along (small test models), with `config`;
    seed:       random weights drawn on each rank from this seed (benchmarks), with `config`.

    fsdp: shard the blocks over the group (sharded_blocks.py) instead of a whole copy per rank.
    load_in_turns: the ranks load the model one after another instead of all at once (the driver
           asks for it where a copy per rank would not fit the host's free memory); the model is
           the same either way.
    loras: with `checkpoint`, the LoRAs the rank brings the model to after loading it, as the
           Wan LoRA Loader chain asked: (file, strength, mode, the file's (size, mtime_ns) when
           the run was checked: a changed file is a different model for the rank's cache).
    """
    config: dict | None = None  # DiTConfig.to_dict()
    checkpoint: str | None = None
    weight_dtype: str = "bf16"
    golden: str | None = None
    state: dict[str, torch.Tensor] | None = field(default=None, compare=False)
    seed: int | None = None
    dtype: str = "float32"  # storage and compute dtype of `state` / `seed` models
    attention: str = "sdpa"
    compile: bool = False
    fsdp: bool = False
    loras: tuple[tuple[str, float, str, tuple[int, int]], ...] = ()
    load_in_turns: bool = False

    def key(self) -> tuple | None:
        """What identifies the loaded model in a rank's cache; None: not cached (a state dict
        arrives as a new copy with every request)."""
        if self.state is not None:
            return None
        config = None if self.config is None else tuple(sorted(
            (k, str(v)) for k, v in self.config.items()))
        return (config, self.checkpoint, self.weight_dtype, self.golden, self.seed, self.dtype,
                self.attention, self.compile, self.fsdp, self.loras)


@dataclass(frozen=True)
class ForwardCase:
    """One model forward: the inputs of WanDiT.forward."""
    x: torch.Tensor
    t: torch.Tensor
    context: torch.Tensor
    y: torch.Tensor | None = None
    clip_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardRequest:
    model: ModelSpec
    cases: tuple[ForwardCase, ...]
    mode: str = "auto"  # sequence-parallel attention: auto, ulysses, ring
    repeats: int = 1  # forwards per case (timing); the output of the last is returned
    keep_model: bool = True  # keep the model in the ranks' cache for the next request
    # one more forward of the last case after the timed ones, under torch.profiler on every
    # rank, its kernel totals in the rank's metrics ("kernels"; not counted in the others)
    profile: bool = False


@dataclass
class ForwardResult:
    outputs: list[torch.Tensor]
    metrics: list[dict]  # one per rank (metrics.py)
    seconds: list[float]  # wall time of each forward on rank 0 (synchronized)


@dataclass(frozen=True)
class SampleRequest:
    """One sampling run of the sampler node, done by the worker group: the start latent
    (normalised, noise already added), the conditioning and the schedule; the ranks run the
    whole denoise loop and rank 0 returns the final latent."""
    models: tuple[ModelSpec, ...]  # one model, or the A14B (high_noise, low_noise) experts
    start: torch.Tensor  # [B, C, F, H, W] float32
    cond: torch.Tensor  # [1, L, 4096]
    uncond: torch.Tensor | None
    scheduler: str
    schedule: Any  # sampling.schedules.FlowSchedule
    cfg: float
    cfg_low_noise: float | None = None  # A14B: the low-noise expert's guidance
    boundary: float | None = None  # A14B: the switch point
    first_frame: torch.Tensor | None = None  # normalised [B, C, 1, H, W]
    y: torch.Tensor | None = None  # image-to-video conditioning channels
    clip_tokens: torch.Tensor | None = None
    mode: str = "auto"
    cfg_parallel: bool = True


@dataclass
class SampleResult:
    latent: torch.Tensor  # the final (normalised) sample, CPU float32
    metrics: list[dict]  # one per rank (metrics.py)
    experts: list[str]  # the expert of every step


@dataclass(frozen=True)
class Float32Settings:
    """The driver's float32 precision settings, taken by the ranks for every task.

    Whether float32 matrix products and convolutions may round their inputs to TF32 is process
    state (torch.backends), and a worker process starts with torch's defaults (TF32 for cuDNN
    convolutions, not for matrix products). A rank that computed with other settings than the
    process that asked would differ from the one-process path by TF32's rounding (about 1e-3), so
    every task carries the settings the driver has when it asks, and the ranks apply them first."""
    matmul_precision: str  # torch.get_float32_matmul_precision(): highest / high / medium
    matmul_tf32: bool  # torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32: bool  # torch.backends.cudnn.allow_tf32

    @classmethod
    def current(cls) -> "Float32Settings":
        return cls(torch.get_float32_matmul_precision(),
                   bool(torch.backends.cuda.matmul.allow_tf32),
                   bool(torch.backends.cudnn.allow_tf32))

    def apply(self) -> None:
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32  # after: precision sets it too
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
