"""A/B: the shipped Hopper fp8 kernel (fp8_attention_hopper_orig) against the variant in
wan/fp8_attention_hopper.py (settings by module globals), same operands; bitwise check + timing
in turns."""
import sys, json, itertools
import torch
from wan_enhanced.bench.fp8_attention_gpu import SHAPES, bench_ms, draw
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import fp8_attention_hopper as new
from wan_enhanced.wan import fp8_attention_hopper_orig as orig

variants = [{kv.split('=')[0]: (int(kv.split('=')[1]) if kv.split('=')[0] in ('GROUPS', 'STAGES') else kv.split('=')[1] == '1') for kv in v.split(':')} for v in sys.argv[1].split(',')]
defaults = {k: getattr(new, k) for k in ('GROUPS', 'STAGES', 'TURNS', 'PV_BOTH', 'EARLY_RELEASE', 'P_SMEM', 'HALVES')}
variants = [{**defaults, **v} for v in variants]
names = sys.argv[1].split(',')
shapes = sys.argv[2].split(',')
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3

def run_new(ops, out, cfg):
    for k, v in cfg.items():
        setattr(new, k, v)
    new.attend(ops, out)

# correctness at awkward lengths
ok = True
for L, H in ((1000, 3), (2049, 2), (4097, 2), (27280, 2)):
    q, k, v = draw(L, H, seed=L, device="cuda")
    ops = fa.quantize_only(q, k, v)
    ref = torch.full_like(q, float('nan')); orig.attend(ops, ref)
    for cfg in variants:
        out = torch.full_like(q, float('nan')); run_new(ops, out, cfg)
        same = torch.equal(out, ref)
        d = (out.float() - ref.float()).abs().max().item()
        print(f"check L={L} H={H} {cfg}: bitwise {same} maxdiff {d:.3g} nan {out.isnan().any().item()}")
        ok &= same
res = {}
for name in shapes:
    L, H = SHAPES[name]
    q, k, v = draw(L, H, seed=0, device="cuda")
    ops = fa.quantize_only(q, k, v)
    out = torch.empty_like(q)
    flops = 4 * L * L * 128 * H
    fns = {"orig": lambda: orig.attend(ops, out)}
    for nm, cfg in zip(names, variants):
        fns[nm] = (lambda c=cfg: run_new(ops, out, c))
    times = {k: [] for k in fns}
    for r in range(rounds):
        for key, fn in fns.items():
            times[key].append(bench_ms(fn))
    for key, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        print(f"{name} {key:22s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  rounds {['%.3f' % t for t in ts]}")
        res[f"{name}/{key}"] = ts
print("ALL BITWISE" if ok else "MISMATCH")
json.dump(res, open(sys.argv[4] if len(sys.argv) > 4 else '/dev/null', 'w'), indent=1)
