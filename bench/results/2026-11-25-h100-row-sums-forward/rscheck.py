"""Scratch: the tensor-core row-sum variants of the Hopper kernel: their sums against float sums
(rsdbg), their errors against float32 SDPA, and their time alone, in turns."""
import importlib, json, shutil, sys, torch
sys.path.insert(0, "bench")
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import fp8_attention_hopper as base
from fp8_attention_gpu import draw, errors, float32_reference, SHAPES
import triton.testing

mods = {"base": base}
for n in ("rs8", "rs16", "rsdbg"):
    shutil.copy(f".device/var/{n}/wan/fp8_attention_hopper.py", f"wan/_var_{n}.py")
    mods[n] = importlib.import_module(f"wan_enhanced.wan._var_{n}")
for shape in ("small", "5b", "14b"):
    length, heads = (1000, 2) if shape == "small" else SHAPES[shape]
    q, k, v = draw(length, heads, 0, torch.device("cuda"))
    flops = 4 * length ** 2 * 128 * heads
    with torch.inference_mode():
        ops = fa.quantize_only(q, k, v)
        dbg = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        mods["rsdbg"].attend(ops, dbg)
        lf, lt = dbg[..., 0].double(), dbg[..., 1].double()
        rel = ((lt - lf) / lf).abs()
        print(shape, "sums: float", lf.flatten()[:4].tolist(), "tensor", lt.flatten()[:4].tolist(),
              "max rel", rel.max().item(), "median rel", rel.median().item(), flush=True)
        ref32 = float32_reference(q, k, v)
        port = torch.empty_like(q); fa.attend_quantized(ops, port, kernel="portable")
        for n in ("base", "rs8", "rs16"):
            o = torch.full_like(q, float("nan"))
            mods[n].attend(ops, o)
            print(shape, n, json.dumps(errors(o, ref32)), "equal portable", torch.equal(o, port),
                  "vs portable", json.dumps(errors(o, port)), flush=True)
        del ref32
        if shape == "small":
            continue
        times = {n: [] for n in ("base", "rs8", "rs16")}
        out = torch.empty_like(q)
        for turn in range(3):
            for n in times:
                times[n].append(triton.testing.do_bench(lambda: mods[n].attend(ops, out), warmup=30, rep=250, return_mode="median"))
        for n in times:
            ms = sorted(times[n])[1]
            print(f"{shape} {n}: {[round(t, 3) for t in times[n]]} -> {ms:.3f} ms {flops/ms/1e9:.0f} TFLOP/s", flush=True)
