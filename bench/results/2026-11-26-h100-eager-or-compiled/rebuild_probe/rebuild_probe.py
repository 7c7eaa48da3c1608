"""Which Triton kernels a process builds (ptxas) in its first compiled 5B fp8 + fp8 attention
forward, and which launchers it compiles: run twice in new processes on one machine."""
import sys, time
t00 = time.perf_counter()
import torch
import triton
from triton.backends.nvidia import compiler as nvc
from triton.runtime import build

built, launchers = [], []
make_cubin = nvc.CUDABackend.make_cubin


def traced_cubin(self, src, metadata, opt, capability):
    built.append(metadata.get("name"))
    return make_cubin(self, src, metadata, opt, capability)


nvc.CUDABackend.make_cubin = traced_cubin
compile_src = build.compile_module_from_src


def traced_src(src, name, *a, **k):
    t = time.perf_counter()
    out = compile_src(src, name, *a, **k)
    launchers.append((name, round(time.perf_counter() - t, 2)))
    return out


build.compile_module_from_src = traced_src
import triton.backends.nvidia.driver as drv
drv.compile_module_from_src = traced_src
from wan_enhanced.bench import harness as peer
from wan_enhanced.quant import quantize_block_linears

device = torch.device("cuda")
config, latent, state, noise, context, timestep = peer.dit_setup(
    "dit_5b", False, 0, device, torch.bfloat16).parts()
model = quantize_block_linears(peer.ours_dit(config, state, torch.bfloat16), "fp8_e4m3fn_fast")
torch.cuda.synchronize()
print(f"setup done at {time.perf_counter() - t00:.1f} s", flush=True)
mode = sys.argv[1]
t = time.perf_counter()
with torch.inference_mode():
    model(noise, timestep, context, attention="fp8_triton", compiled=mode == "compiled")
torch.cuda.synchronize()
print(f"first forward {time.perf_counter() - t:.2f} s", flush=True)
print("built", len(built), built, flush=True)
print("launchers", len(launchers), launchers, flush=True)
