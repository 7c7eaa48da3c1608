"""Where a process's first compiled 5B fp8 + fp8 attention forward spends its time."""
import cProfile, io, pstats, sys, time
import torch
from wan_enhanced.bench import harness as peer
from wan_enhanced.quant import quantize_block_linears

device = torch.device("cuda")
t0 = time.perf_counter()
config, latent, state, noise, context, timestep = peer.dit_setup(
    "dit_5b", False, 0, device, torch.bfloat16).parts()
model = quantize_block_linears(peer.ours_dit(config, state, torch.bfloat16), "fp8_e4m3fn_fast")
torch.cuda.synchronize()
print(f"setup {time.perf_counter() - t0:.1f} s", flush=True)


def fwd():
    with torch.inference_mode():
        out = model(noise, timestep, context, attention="fp8_triton", compiled=sys.argv[2] == "compiled")
    torch.cuda.synchronize()
    return out


pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
fwd()
pr.disable()
print(f"first forward {time.perf_counter() - t:.2f} s", flush=True)
for i in range(2):
    t = time.perf_counter()
    fwd()
    print(f"next forward {time.perf_counter() - t:.3f} s", flush=True)
from torch._dynamo.utils import compile_times, counters
print(compile_times(repr="str"))
print({k: dict(v) for k, v in counters.items() if k in ("stats", "inductor", "aot_autograd", "frames")})
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
open(sys.argv[1] + "_cumulative.txt", "w").write(s.getvalue())
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
open(sys.argv[1] + "_tottime.txt", "w").write(s.getvalue())
print(s.getvalue()[:5000])
