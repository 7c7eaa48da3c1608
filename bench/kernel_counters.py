"""Hardware counters of the fp8 attention kernel (the Hopper one, or --kernel portable) at one of
Wan's shapes, read by Nsight Compute: where its time goes when the timings of variants cannot
say (issue slots, the tensor and special-function pipes, warp stall reasons per source line).

    bench/run_kernel_counters.sh OUT [--shape 5b] [--kernel hopper]

runs this under `ncu` (on a GPU machine that lets ncu read the counters; see the device notes).
Alone it quantizes drawn operands (bench/fp8_attention_gpu.draw), warms the kernel up, then runs
it `--launches` times between cudaProfilerStart and Stop, so that `ncu --profile-from-start off`
measures those launches only, and prints the kernel's median time per launch unprofiled
(bench/fp8_attention_gpu.bench_ms) for comparison with ncu's (ncu fixes the clocks unless told
otherwise).
"""

from __future__ import annotations

import argparse
import sys

import torch

from wan_enhanced.bench.fp8_attention_gpu import SHAPES, bench_ms, draw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="5b", choices=sorted(SHAPES))
    parser.add_argument("--kernel", default="hopper", choices=("hopper", "portable"))
    parser.add_argument("--launches", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_counters: no CUDA GPU here", file=sys.stderr)
        return 2
    from wan_enhanced.wan import fp8_attention as fa

    length, heads = SHAPES[args.shape]
    q, k, v = draw(length, heads, seed=0, device="cuda")
    ops = fa.quantize_only(q, k, v)
    out = torch.empty_like(q)

    def run():
        fa.attend_quantized(ops, out, kernel=args.kernel)

    ms = bench_ms(run)  # warms the kernel up, too
    flops = 4 * length * length * 128 * heads
    print(f"{args.kernel} kernel, {args.shape} ({length} tokens x {heads} heads): {ms:.3f} ms "
          f"per launch, {flops / ms / 1e9:.0f} TFLOP/s (median, unprofiled)")
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.launches):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
