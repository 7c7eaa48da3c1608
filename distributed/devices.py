"""How many GPUs a run may use, and what the `gpus` input is refused for.

On a CUDA compute device the count is the GPUs PyTorch sees (CUDA_VISIBLE_DEVICES applies).
With the compute device forced to the CPU (WAN_ENHANCED_DEVICE=cpu: tests, CI, a machine
without a GPU that wants the several-process path checked), `gpus` counts CPU worker
processes instead (gloo), at most CPU_RANKS_MAX of them (they share the cores; a check, not a
speed-up). Without CUDA and without that setting there are no GPUs to use.
"""

from __future__ import annotations

import os

import torch

FORCED_CPU = "WAN_ENHANCED_DEVICE"
CPU_RANKS_MAX = 8


def worker_device_type() -> str:
    """"cuda" when the models compute on a GPU (ComfyUI's device, or ours headless), else
    "cpu"."""
    from .. import host
    return "cuda" if host.compute_device().type == "cuda" else "cpu"


def available(device_type: str | None = None) -> tuple[int, str]:
    """(how many ranks this machine can run, what they are, for messages)."""
    device_type = device_type or worker_device_type()
    if device_type == "cuda":
        count = torch.cuda.device_count()
        return count, f"{count} CUDA GPU{'s' if count != 1 else ''}"
    if os.environ.get(FORCED_CPU, "").startswith("cpu"):
        return CPU_RANKS_MAX, f"room for {CPU_RANKS_MAX} CPU processes ({FORCED_CPU}=cpu: the " \
                              f"ranks are CPU processes)"
    if torch.cuda.is_available():
        return 0, "its models computing on the CPU (no GPU in use)"
    return 0, "no CUDA GPU"


def gpus_problem(gpus) -> str | None:
    """Why the sampler's `gpus` input cannot be honoured here, or None (1: always fine)."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus <= 1:
        return None
    count, what = available()
    if gpus > count:
        return f"gpus: {gpus} asked for; this machine has {what}"
    return None
