"""Which of torch's low-precision matrix kernels this CPU build has (they vary by version:
some builds' CPU torch._scaled_mm takes only one scale per tensor)."""

import functools

import torch


@functools.cache
def has_cpu_kernel(name: str) -> bool:
    """`_scaled_mm` with row-wise scales, or `_int_mm`, on the CPU."""
    try:
        if name == "_scaled_mm":
            a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                             out_dtype=torch.bfloat16)
        else:
            torch._int_mm(torch.zeros(17, 16, dtype=torch.int8),
                          torch.zeros(16, 16, dtype=torch.int8))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
