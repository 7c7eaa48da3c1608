"""Our Hopper kernels under whatever Triton is first on the path (argv: kernel-file variants to
run beside them, e.g. a copy of wan/fp8_attention_hopper.py): build, bitwise equality with the
portable kernel, exact bf16 kernel against SDPA, and timing (kernel alone)."""
import importlib.util
import sys
import torch, triton
print("triton", triton.__version__, triton.__file__, "torch", torch.__version__, flush=True)
from wan_enhanced.bench.fp8_attention_gpu import SHAPES, draw, errors
from wan_enhanced.bench.harness import bench_ms
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import bf16_attention as ba
import torch.nn.functional as F

mod = fa._hopper_module()
print("fp8 hopper module:", mod if isinstance(mod, str) else "imported", flush=True)
variants = {}
for path in sys.argv[1:]:
    name = "wan_enhanced.wan._v_" + path.split('/')[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m)
    variants[path.split('/')[-1][:-3]] = m
for L, H in ((1000, 3), (4097, 2), (27280, 2)):
    q, k, v = draw(L, H, seed=L, device="cuda")
    ops = fa.quantize_only(q, k, v)
    a = torch.empty_like(q); fa.attend_quantized(ops, a, kernel="hopper")
    b = torch.empty_like(q); fa.attend_quantized(ops, b, kernel="portable")
    line = f"L={L} H={H}: hopper == portable bitwise {torch.equal(a, b)}"
    for name, m in variants.items():
        c = torch.full_like(q, float("nan")); m.attend(ops, c)
        line += f"; {name} == hopper {torch.equal(c, a)}"
    print(line, flush=True)
    o = ba.bf16_hopper_attention(q, k, v)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    print(f"   bf16_hopper vs SDPA {errors(o, ref)}", flush=True)
for shape in ("5b", "14b", "1_3b"):
    L, H = SHAPES[shape]
    q, k, v = draw(L, H, seed=0, device="cuda")
    ops = fa.quantize_only(q, k, v)
    out = torch.empty_like(q)
    flops = 4 * L * L * 128 * H
    fns = {"hopper": lambda: fa.attend_quantized(ops, out, kernel="hopper"),
           "portable": lambda: fa.attend_quantized(ops, out, kernel="portable"),
           "bf16_hopper": lambda: ba.bf16_hopper_attention(q, k, v)}
    for name, m in variants.items():
        fns[name] = lambda m=m: m.attend(ops, out)
    times = {n: [] for n in fns}
    for _ in range(3):
        for n, fn in fns.items():
            times[n].append(bench_ms(fn))
    for n, ts in times.items():
        ms = sorted(ts)[1]
        print(f"{shape} {n:16s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s {['%.3f' % t for t in ts]}", flush=True)
    torch.cuda.empty_cache()

