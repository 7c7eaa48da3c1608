"""Scratch: Hopper fp8 kernel variants (.device/var2/NAME/wan/fp8_attention_hopper.py) timed
alone in turns at Wan's shapes, with bitwise equality to the portable kernel and errors."""
import importlib, json, shutil, sys, time, torch
sys.path.insert(0, "bench")
from wan_enhanced.wan import fp8_attention as fa
from fp8_attention_gpu import draw, errors, float32_reference, SHAPES
import triton.testing

names = sys.argv[1].split(",")
shapes = sys.argv[2].split(",")
turns = int(sys.argv[3])
mods = {}
for n in names:
    shutil.copy(f".device/var2/{n}/wan/fp8_attention_hopper.py", f"wan/_var_{n}.py")
    mods[n] = importlib.import_module(f"wan_enhanced.wan._var_{n}")
res = {}
for shape in shapes:
    length, heads = SHAPES[shape]
    q, k, v = draw(length, heads, 0, torch.device("cuda"))
    flops = 4 * length ** 2 * 128 * heads
    with torch.inference_mode():
        ops = fa.quantize_only(q, k, v)
        port = torch.empty_like(q); fa.attend_quantized(ops, port, kernel="portable")
        ref32 = float32_reference(q, k, v) if shape != "14b" else None
        for n in names:
            o = torch.full_like(q, float("nan"))
            mods[n].attend(ops, o)
            r = {"equal_portable": bool(torch.equal(o, port)),
                 "vs_portable": errors(o, port.float())}
            if ref32 is not None:
                r["vs_fp32"] = errors(o, ref32)
            res[f"{shape}_{n}"] = r
            print(shape, n, json.dumps(r), flush=True)
        del ref32
        times = {n: [] for n in names}
        out = torch.empty_like(q)
        for turn in range(turns):
            for n in names:
                times[n].append(triton.testing.do_bench(lambda: mods[n].attend(ops, out),
                                                        warmup=25, rep=200, return_mode="median"))
        for n in names:
            ms = sorted(times[n])[len(times[n]) // 2]
            res[f"{shape}_{n}"]["ms"] = times[n]
            print(f"{shape} {n}: {[round(t, 3) for t in times[n]]} -> median {ms:.3f} ms "
                  f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    del q, k, v, ops, port
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[4], "w"), indent=1)
