"""Where loading's arithmetic runs: quantizing block matrices and merging LoRAs.

On a CUDA device a matrix is copied there, merged and quantized, and its codes come back: a
fraction of the time the CPU takes (its float32 pass over every weight is what made loading and
a LoRA's merge slow). The result is the same as on the CPU for an unmerged matrix (the same
elementwise operations); a merged one may differ from a CPU merge by float32 rounding (another
summation order of the low-rank product). Without CUDA, or with less free device memory than a
few of the largest matrices need, the CPU does it.
"""

from __future__ import annotations

import torch

from .. import host

# free device memory needed: a 14B feed-forward matrix in float32 with its codes, several times
NEEDED_FREE_BYTES = 2 * 2 ** 30


def load_work_device() -> torch.device | None:
    """The CUDA device to quantize and merge on, or None for the CPU."""
    device = host.compute_device()
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return device if free >= NEEDED_FREE_BYTES else None
