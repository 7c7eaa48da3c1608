"""What the two Hopper attention kernels need to know about the Triton release that builds them:
Gluon (Triton's lower-level dialect) is experimental, and releases rename its functions and
allocate a kernel's registers differently. The facts, taken once:

- `tma_load`: a TMA copy of one block from global into shared memory, signalled on an mbarrier.
  Triton 3.6 and 3.7 (PyTorch 2.11-2.13) call it `tma.async_copy_global_to_shared`; 3.8 adds
  `tma.async_load`, and 3.9 keeps only that name (the old one raises when a kernel is built).
- `STORE_P_EARLY` and `FP8_PTXAS_OPTIONS`: where the fp8 kernel's consumer groups store P to
  shared memory, and how ptxas builds it. Triton 3.6 and 3.7 build it fastest as it was written
  first: P stored when the group next multiplies, ptxas at its default -O3 (~880 TFLOP/s on the
  H100). From 3.8 on, ptxas at -O3 keeps part of the float32 accumulator in local memory (3.8:
  ~760, the portable kernel's speed; 3.9: ~415); at -O1 nothing spills, and with P stored right
  after the softmax the kernel runs at 873-908 on 3.8 and 876-921 on 3.9. The bits are the same
  in every form. bench/results/2026-11-26-h100-triton-releases/ has the
  measurements.

Imported only where Triton has Gluon (gpu_support.import_gluon_kernel turns a Triton without
these names into a reason the kernels cannot run)."""

import re

import triton
from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a Triton version string ("3.8.0", "3.9.0+git1234"); (0, 0) if it has
    none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


# from 3.8 on, ptxas at -O3 spills the fp8 kernel's accumulator: both choices below follow it
_SPILLS_AT_O3 = release(triton.__version__) >= (3, 8)
STORE_P_EARLY = _SPILLS_AT_O3
FP8_PTXAS_OPTIONS = "-O1" if _SPILLS_AT_O3 else None
