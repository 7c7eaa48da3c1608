"""Eager fp8 + fp8 attention forwards with the self-attention's row chunks in whole waves of the
attention kernel (as committed) and without (wave_rows -> None), alternating, one process."""
import json, sys, time
import torch
from wan_enhanced.bench import harness as peer
from wan_enhanced.quant import quantize_block_linears
from wan_enhanced.wan import dit

device = torch.device("cuda")
aligned = dit.wave_rows
res = {}
for case, rounds in (("dit_5b", 4), ("dit_14b", 2)):
    config, latent, state, noise, context, timestep = peer.dit_setup(
        case, False, 0, device, torch.bfloat16, per_token_timestep=False).parts()
    model = quantize_block_linears(peer.ours_dit(config, state, torch.bfloat16), "fp8_e4m3fn_fast")
    del state

    def fwd():
        with torch.inference_mode():
            return model(noise, timestep, context, attention="fp8_triton", compiled=False)
    outs = {}
    for name, fn in (("waves", aligned), ("plain", lambda *a: None)):
        dit.wave_rows = fn
        outs[name] = fwd().float()  # warm-up and output
    diff = float((outs["waves"] - outs["plain"]).abs().max() / outs["plain"].abs().max())
    del outs
    times = {"waves": [], "plain": []}
    peaks = {}
    for r in range(rounds):
        for name, fn in (("plain", lambda *a: None), ("waves", aligned)) if r % 2 else (("waves", aligned), ("plain", lambda *a: None)):
            dit.wave_rows = fn
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t = time.perf_counter(); out = fwd(); torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) * 1e3)
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
            del out
    dit.wave_rows = aligned
    res[case] = {"times_ms": times, "peak_gib": peaks, "max_rel_waves_vs_plain": diff}
    print(case, {k: [round(v, 1) for v in t] for k, t in times.items()},
          {k: round(v, 3) for k, v in peaks.items()}, "max rel", diff, flush=True)
    del model, noise, context, timestep
    peer.free_memory()
json.dump(res, open(sys.argv[1], "w"), indent=1)
