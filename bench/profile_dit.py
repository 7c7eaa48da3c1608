"""Where one DiT forward spends its GPU time: ours (eager, each attention backend, and with the
blocks compiled by torch.compile) and diffusers', on the same random weights (peer_diffusers.py).

    python bench/profile_dit.py [--case dit_1_3b] [--top 12]

Prints per model the forward's median time and the CUDA kernels that take most of it, grouped by
name, so the gap between the two implementations can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from wan_enhanced.bench import peer_diffusers as peer

from wan_enhanced.wan.dit import WanBlock, WanDiT


def median_ms(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_table(fn, top: int) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows)
    lines = [f"    total kernel time {total / 1000:.1f} ms"]
    for e in rows[:top]:
        lines.append(f"    {e.device_time_total / 1000:8.1f} ms {e.count:5d}x  {e.key[:110]}")
    return "\n".join(lines)


class CompiledBlocks:
    """Our blocks run through one torch.compile'd WanBlock.forward (parameters are graph inputs,
    so every block shares the compiled code)."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.forward = torch.compile(WanBlock.forward, dynamic=False)

    def __iter__(self):
        for block in self.blocks:
            yield _Bound(block, self.forward)


class _Bound:
    def __init__(self, block, forward):
        self.block, self.forward = block, forward

    def __call__(self, *args):
        return self.forward(self.block, *args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="dit_1_3b", choices=[k for k in peer.CASES
                                                               if k.startswith("dit")])
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda")
    case = peer.CASES[args.case]
    config = peer.dit_config(case, False)
    dtype = torch.bfloat16
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = peer.random_state(skeleton, 0, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    noise = torch.randn(case.latent, generator=gen, device=device).to(dtype)
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen,
                          device=device).to(dtype)
    timestep = torch.full((1,), peer.TIMESTEP, device=device)
    print(f"{args.case}: latent {case.latent}", flush=True)

    with torch.inference_mode():
        model = peer.ours_dit(config, state, dtype)
        reference = None
        for backend in ("sdpa", "sdpa_cudnn"):
            def run(backend=backend):
                return model(noise, timestep, context, attention=backend)
            reference = run() if reference is None else reference
            print(f"  ours {backend}: {median_ms(run):.1f} ms", flush=True)
            print(kernel_table(run, args.top), flush=True)
        compiled = CompiledBlocks(model.blocks)

        def run_compiled():
            return model(noise, timestep, context, attention="sdpa", blocks=compiled)
        out = run_compiled()  # compiles
        diff = float((out - reference).abs().max() / reference.abs().max())
        print(f"  ours sdpa, compiled blocks: {median_ms(run_compiled):.1f} ms "
              f"(max rel diff to eager {diff:.2e})", flush=True)
        print(kernel_table(run_compiled, args.top), flush=True)
        del model, compiled
        peer.free_memory()

        theirs = peer.diffusers_dit(config, state)

        def run_theirs():
            return theirs(hidden_states=noise, timestep=timestep, encoder_hidden_states=context,
                          return_dict=False)[0]
        print(f"  diffusers: {median_ms(run_theirs):.1f} ms", flush=True)
        print(kernel_table(run_theirs, args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
