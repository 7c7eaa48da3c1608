"""Rowwise against blockwise (1x128 activations, 128x128 weights) fp8 matmuls at Wan's o-projection
shapes, on this machine's torch: is the blockwise product available and as fast?"""
import torch, traceback
import torch.nn.functional as F
from wan_enhanced.bench.harness import bench_ms

print(torch.__version__, torch.version.cuda, flush=True)
dev = "cuda"
for name, m, k, n in (("5b_o", 27280, 3072, 3072), ("14b_o", 75600, 5120, 5120), ("5b_ffn2", 27280, 14336, 3072)):
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    sa_row = torch.rand(m, 1, device=dev) + 0.5
    sb_row = torch.rand(1, n, device=dev) + 0.5
    flops = 2 * m * n * k
    row = lambda: torch._scaled_mm(a, b.t(), sa_row, sb_row, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)
    t = bench_ms(row)
    print(f"{name} rowwise {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s", flush=True)
    sa_blk = (torch.rand(m, k // 128, device=dev) + 0.5)
    sb_blk = (torch.rand(n // 128, k // 128, device=dev) + 0.5)
    tries = {}
    if hasattr(F, "scaled_mm"):
        from torch.nn.functional import ScalingType, SwizzleType
        def fblk(fast):
            return F.scaled_mm(a, b.t(), sa_blk, ScalingType.BlockWise1x128, sb_blk.t(), ScalingType.BlockWise128x128,
                               output_dtype=torch.bfloat16, use_fast_accum=fast)
        tries["F.scaled_mm 1x128/128x128 fast"] = lambda: fblk(True)
        tries["F.scaled_mm 1x128/128x128"] = lambda: fblk(False)
    tries["_scaled_mm blockwise scales (t)"] = lambda: torch._scaled_mm(a, b.t(), sa_blk.t().contiguous().t(), sb_blk.t(), out_dtype=torch.bfloat16)
    tries["_scaled_mm blockwise scales"] = lambda: torch._scaled_mm(a, b.t(), sa_blk, sb_blk, out_dtype=torch.bfloat16)
    for label, fn in tries.items():
        try:
            out = fn()
            t = bench_ms(fn)
            print(f"{name} {label}: {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as exc:
            print(f"{name} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
