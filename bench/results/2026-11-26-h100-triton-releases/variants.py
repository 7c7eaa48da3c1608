"""The fp8 Hopper kernel's build variants (order of P x ptxas options) under the Triton first on
the path: bitwise against the portable kernel, then kernel-alone timing in turns."""
import itertools
import sys
import torch, triton
from wan_enhanced.bench.fp8_attention_gpu import SHAPES, draw
from wan_enhanced.bench.harness import bench_ms
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import fp8_attention_hopper as hopper

print("triton", triton.__version__, flush=True)
combos = list(itertools.product((False, True), (None, "-O1")))


def run(ops, out, early, opts):
    hopper.P_EARLY, hopper.PTXAS_OPTIONS = early, opts
    return hopper.attend(ops, out)


for L, H in ((1000, 3), (27280, 2)):
    q, k, v = draw(L, H, seed=L, device="cuda")
    ops = fa.quantize_only(q, k, v)
    ref = torch.empty_like(q); fa.attend_quantized(ops, ref, kernel="portable")
    for early, opts in combos:
        out = torch.full_like(q, float("nan")); c = run(ops, out, early, opts)
        print(f"L={L} early={early} opts={opts}: == portable {torch.equal(out, ref)}; "
              f"n_spills {c.n_spills} n_regs {c.n_regs}", flush=True)
for shape in sys.argv[1].split(","):
    L, H = SHAPES[shape]
    q, k, v = draw(L, H, seed=0, device="cuda")
    ops = fa.quantize_only(q, k, v)
    out = torch.empty_like(q)
    flops = 4 * L * L * 128 * H
    fns = {f"early={e} opts={o}": (lambda e=e, o=o: run(ops, out, e, o)) for e, o in combos}
    fns["portable"] = lambda: fa.attend_quantized(ops, out, kernel="portable")
    times = {n: [] for n in fns}
    for _ in range(3):
        for n, fn in fns.items():
            times[n].append(bench_ms(fn))
    for n, ts in times.items():
        ms = sorted(ts)[1]
        print(f"{shape} {n:24s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s "
              f"{['%.3f' % t for t in ts]}", flush=True)
