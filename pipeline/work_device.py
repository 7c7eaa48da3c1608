"""Where a LoRA's merge runs: the float32 sums of the block matrices a merged LoRA changes.

On a CUDA device each such matrix is copied there, merged (its low-rank products and sums) and
quantized, and its codes come back: the CPU's float32 pass over every changed weight was most
of the first step of a LoRA'd run. A merged matrix may differ from a CPU merge by a code step
(float32 rounding of another summation order, and of the scales' division). Matrices no merge
touches are read on the CPU as a load reads them, so taking a LoRA out restores the loaded
codes exactly. Without CUDA, or with less free device memory than a few of the largest matrices
need, the CPU does it all.
"""

from __future__ import annotations

import torch

from .. import host
from .memory_guard import free_bytes

# free device memory needed: a 14B feed-forward matrix in float32 with its codes, several times
NEEDED_FREE_BYTES = 2 * 2 ** 30


def merge_work_device() -> torch.device | None:
    """The CUDA device to merge and quantize on, or None for the CPU."""
    device = host.compute_device()
    if device.type != "cuda":
        return None
    return device if free_bytes(device) >= NEEDED_FREE_BYTES else None
