"""Scratch: the fp8 attention kernel inside the 5B forward against alone. Per call GPU time by
CUDA events around the kernel (no profiler) in eager and compiled forwards; then the kernel
alone on operands captured from that forward and on drawn ones of the same shape."""
import json, sys, torch
sys.path.insert(0, "bench")
import triton.testing
from wan_enhanced.bench import harness as peer
from wan_enhanced.quant import quantize_block_linears
from wan_enhanced.wan import fp8_attention as fa
from fp8_attention_gpu import draw

dev = torch.device("cuda")
case = sys.argv[1] if len(sys.argv) > 1 else "dit_5b"
config, latent, state, noise, context, timestep = peer.dit_setup(
    case, False, 0, dev, torch.bfloat16, per_token_timestep=False).parts()
model = quantize_block_linears(peer.ours_dit(config, state, torch.bfloat16), "fp8_e4m3fn_fast")
real_attend = fa.attend_quantized
record = {"on": False, "times": [], "ops": []}

def timed_attend(ops, out, config=None, kernel="auto"):
    if not record["on"]:
        return real_attend(ops, out, config, kernel)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); real_attend(ops, out, config, kernel); b.record()
    record["times"].append((a, b))
    if record.get("capture") and len(record["ops"]) < 2 and len(record["times"]) in (1, 16):
        record["ops"].append((ops, out.shape))

fa.attend_quantized = timed_attend
res = {}
with torch.inference_mode():
    for compiled in (False, True):
        for _ in range(2):
            model(noise, timestep, context, attention="fp8_triton", compiled=compiled)
        torch.cuda.synchronize()
        for rep in range(2):
            record.update(on=True, times=[], capture=compiled and rep == 0)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); model(noise, timestep, context, attention="fp8_triton", compiled=compiled); e.record()
            torch.cuda.synchronize()
            record["on"] = False
            ms = [a.elapsed_time(b) for a, b in record["times"]]
            key = f"{'compiled' if compiled else 'eager'}_{rep}"
            res[key] = {"forward_ms": s.elapsed_time(e), "calls": len(ms), "kernel_ms_sum": sum(ms),
                        "kernel_ms_median": sorted(ms)[len(ms) // 2], "kernel_ms_min": min(ms),
                        "kernel_ms_max": max(ms), "first5": [round(x, 3) for x in ms[:5]]}
            print(key, json.dumps(res[key]), flush=True)
    # alone: captured operands (blocks 1 and 16 of the last forward), then drawn ones
    out_shape = record["ops"][0][1]
    out = torch.empty(out_shape, dtype=torch.bfloat16, device=dev)
    for i, (ops, _) in enumerate(record["ops"]):
        ts = [triton.testing.do_bench(lambda: real_attend(ops, out), warmup=30, rep=250, return_mode="median") for _ in range(3)]
        print(f"alone captured #{i}:", [round(t, 3) for t in ts], flush=True)
        res[f"alone_captured_{i}"] = ts
    b, length, heads, dim = out_shape
    q, k, v = draw(length, heads, 0, dev)
    ops = fa.quantize_only(q, k, v)
    ts = [triton.testing.do_bench(lambda: real_attend(ops, out), warmup=30, rep=250, return_mode="median") for _ in range(3)]
    print("alone drawn:", [round(t, 3) for t in ts], flush=True)
    res["alone_drawn"] = ts
    # back to back without L2 flush or gaps: 30 calls in a row, as a forward's count
    for name, o in (("captured", record["ops"][0][0]), ("drawn", ops)):
        torch.cuda.synchronize()
        evs = []
        for _ in range(30):
            a, bb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); real_attend(o, out); bb.record(); evs.append((a, bb))
        torch.cuda.synchronize()
        ms = [a.elapsed_time(bb) for a, bb in evs]
        print(f"back to back {name}: median {sorted(ms)[15]:.3f} min {min(ms):.3f} max {max(ms):.3f}", flush=True)
        res[f"back_to_back_{name}"] = ms
print(json.dumps(res))
