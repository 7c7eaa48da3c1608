"""Scratch: Hopper fp8 kernel variants timed in turns at Wan's shapes, with their errors."""
import importlib, json, shutil, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "bench")
from wan_enhanced.wan import fp8_attention as fa
from fp8_attention_gpu import draw, errors, float32_reference, SHAPES
import triton.testing

names = sys.argv[1:] or ["a", "b", "c"]
mods = {}
for n in names:
    shutil.copy(f".device/var/hopper_{n}.py", f"wan/_var_{n}.py")
    mods[n] = importlib.import_module(f"wan_enhanced.wan._var_{n}")
sigma = torch.arange(32).view(2, 2, 4, 2).permute(0, 2, 1, 3).flatten()
res = {}
for shape in ("5b", "14b"):
    length, heads = SHAPES[shape]
    q, k, v = draw(length, heads, 0, torch.device("cuda"))
    flops = 4 * length ** 2 * 128 * heads
    with torch.inference_mode():
        ops = fa.quantize_only(q, k, v)
        lp = ops.vt.shape[-1]
        pos = (torch.arange(lp, device="cuda").view(-1, 32) // 32 * 32 + sigma.cuda()).flatten()
        inv = torch.empty_like(pos); inv[pos] = torch.arange(lp, device="cuda")
        nat = fa.Fp8Operands(**{**ops.__dict__, "vt": ops.vt[..., inv].contiguous()})
        few = (slice(None), slice(None), slice(0, 2))
        emul = fa.reference_fp8_attention(q[few], k[few], v[few])
        ref32 = float32_reference(q, k, v)
        outs = {}
        for n in names:
            o = torch.full_like(q, float("nan"))
            mods[n].attend(nat if n == "a" else ops, o)
            outs[n] = o
            res[f"{shape}_{n}_errors"] = {"vs_fp32": errors(o, ref32), "vs_emulation_2heads": errors(o[few], emul), "nan": bool(o.isnan().any())}
            print(shape, n, json.dumps(res[f"{shape}_{n}_errors"]), flush=True)
        port = torch.empty_like(q); fa.attend_quantized(ops, port, kernel="portable")
        for n in names:
            res[f"{shape}_{n}_equal_portable"] = bool(torch.equal(outs[n], port))
        print(shape, {n: res[f"{shape}_{n}_equal_portable"] for n in names}, flush=True)
        del ref32
        times = {n: [] for n in names}
        out = torch.empty_like(q)
        for turn in range(3):
            for n in names:
                o2 = nat if n == "a" else ops
                times[n].append(triton.testing.do_bench(lambda: mods[n].attend(o2, out), warmup=30, rep=250, return_mode="median"))
        for n in names:
            ms = sorted(times[n])[1]
            res[f"{shape}_{n}_ms"] = ms
            print(f"{shape} {n}: {times[n]} -> {ms:.3f} ms {flops/ms/1e9:.0f} TFLOP/s", flush=True)
print(json.dumps(res))
