"""Kernel sequence of one middle block of our 5B forward (fp8 + fp8 attention, compiled)."""
import sys, torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, "bench")
from wan_enhanced.bench import harness as peer
import peer_comfy as pc

case = sys.argv[1] if len(sys.argv) > 1 else "dit_5b"
attention = sys.argv[2] if len(sys.argv) > 2 else "fp8_triton"
config, latent, state, noise, context, timestep = peer.dit_setup(
    case, False, 0, torch.device("cuda"), torch.bfloat16, per_token_timestep=False).parts()
model = pc.ours_model(config, state, "fp8_e4m3fn_fast")
fn = lambda: model(noise, timestep, context, attention=attention, compiled=True)
with torch.inference_mode():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
ev.sort(key=lambda e: e.time_range.start)
marks = [i for i, e in enumerate(ev) if e.name.startswith(("hopper_attention_kernel", "hopper_bf16_attention_kernel"))]
a, b = marks[10], marks[11]
tot = 0
for e in ev[a:b]:
    d = (e.time_range.end - e.time_range.start) / 1000
    tot += d
    print(f"{d:8.3f} ms  {e.name[:110]}")
print(f"block total {tot:.3f} ms; forward kernels {sum((e.time_range.end-e.time_range.start) for e in ev)/1000:.1f} ms")
