"""A/B of the exact Hopper kernel (wan/bf16_attention_hopper.py) against file copies: bitwise
check and timing in turns."""
import sys, importlib.util, json
import torch
import wan_enhanced.wan
from wan_enhanced.bench.fp8_attention_gpu import SHAPES, bench_ms, draw, errors, float32_reference
from wan_enhanced.wan import bf16_attention_hopper as base

def load(path):
    name = "wan_enhanced.wan._vb_" + path.split('/')[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

mods = {p.split('/')[-1][:-3]: load(p) for p in sys.argv[1].split(',')}
ok = True
for L, Lq, H in ((1000, 1000, 3), (4097, 4097, 2), (27280, 27280, 2), (2000, 700, 2)):
    g = torch.Generator(device="cuda").manual_seed(L)
    q = torch.randn(2, Lq, H, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, L, H, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(2, L, H, 128, device="cuda", generator=g).bfloat16()
    ref = torch.empty_like(q); base.attend(q, k, v, ref)
    for name, mod in mods.items():
        out = torch.full_like(q, float('nan')); mod.attend(q, k, v, out)
        same = torch.equal(out, ref); ok &= same
        print(f"check B=2 L={L} Lq={Lq} H={H} {name}: bitwise {same} maxdiff {(out.float()-ref.float()).abs().max().item():.3g}")
res = {}
for shape in sys.argv[2].split(','):
    L, H = SHAPES[shape]
    q, k, v = draw(L, H, seed=0, device="cuda")
    out = torch.empty_like(q)
    flops = 4 * L * L * 128 * H
    fns = {"base": lambda: base.attend(q, k, v, out)}
    for name, mod in mods.items():
        fns[name] = (lambda m=mod: m.attend(q, k, v, out))
    times = {kk: [] for kk in fns}
    for r in range(int(sys.argv[3])):
        for kk, fn in fns.items():
            times[kk].append(bench_ms(fn))
    for kk, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        print(f"{shape} {kk:8s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s rounds {['%.3f' % t for t in ts]}")
        res[f"{shape}/{kk}"] = ts
print("ALL BITWISE" if ok else "MISMATCH")
json.dump(res, open(sys.argv[4], 'w'), indent=1)
