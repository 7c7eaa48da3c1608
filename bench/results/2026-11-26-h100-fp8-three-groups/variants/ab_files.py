"""A/B of kernel files (module copies of wan/fp8_attention_hopper.py) on the same operands:
output against the shipped kernel and a float32 reference, and timing in turns."""
import sys, importlib.util, json
import torch
import wan_enhanced.wan
from wan_enhanced.bench.fp8_attention_gpu import SHAPES, bench_ms, draw, errors, float32_reference
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import fp8_attention_hopper as base

def load(path):
    name = "wan_enhanced.wan._v_" + path.split('/')[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

paths = sys.argv[1].split(',')
mods = {p.split('/')[-1][:-3]: load(p) for p in paths}
shapes = sys.argv[2].split(',')
rounds = int(sys.argv[3])
res = {}
for L, H in ((1000, 3), (4097, 2), (27280, 2)):
    q, k, v = draw(L, H, seed=L, device="cuda")
    ops = fa.quantize_only(q, k, v)
    ref = torch.empty_like(q); base.attend(ops, ref)
    f32 = float32_reference(q, k, v)
    print(f"check L={L}: base vs fp32 {errors(ref, f32)}")
    for name, mod in mods.items():
        out = torch.full_like(q, float('nan')); mod.attend(ops, out)
        print(f"  {name}: vs base {errors(out, ref)}; vs fp32 {errors(out, f32)}; nan {out.isnan().any().item()}")
for shape in shapes:
    L, H = SHAPES[shape]
    q, k, v = draw(L, H, seed=0, device="cuda")
    ops = fa.quantize_only(q, k, v)
    out = torch.empty_like(q)
    flops = 4 * L * L * 128 * H
    fns = {"base": lambda: base.attend(ops, out)}
    for name, mod in mods.items():
        fns[name] = (lambda m=mod: m.attend(ops, out))
    times = {kk: [] for kk in fns}
    for r in range(rounds):
        for kk, fn in fns.items():
            times[kk].append(bench_ms(fn))
    for kk, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        print(f"{shape} {kk:8s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s rounds {['%.3f' % t for t in ts]}")
        res[f"{shape}/{kk}"] = ts
    if shape in ("5b",):
        f32 = float32_reference(q, k, v)
        for name, mod in mods.items():
            o2 = torch.empty_like(q); mod.attend(ops, o2)
            print(f"  {shape} {name} vs fp32: {errors(o2, f32)}")
        base.attend(ops, out); print(f"  {shape} base vs fp32: {errors(out, f32)}")
json.dump(res, open(sys.argv[4], 'w'), indent=1)
