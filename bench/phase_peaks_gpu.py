"""Where a compiled DiT forward's activation peak is: the peak of each block phase (its compiled
graph: self-attention, cross-attention, FFN) above the memory held before the forward.

    python bench/phase_peaks_gpu.py [--case dit_5b] [--weights fp8_e4m3fn_fast]
                                    [--attention fp8_triton] [--out DIR]

Random real-size weights (bench/harness.py). One warm-up forward compiles the graphs; the second
is measured. Prints one line per phase (the largest over the blocks) and the whole forward's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer
from wan_enhanced.quant import quantize_block_linears
from wan_enhanced.wan import compiled_blocks

GIB = 1 << 30


def measured_graphs(block_class: type, peaks: dict[str, int], base: list[int]):
    """The block class's compiled phase graphs, each wrapped to record its peak above base[0]
    under its name (compiled_blocks: the self-attention's, the cross-attention's that adds its
    update or the one that hands it to the FFN's, the FFN's)."""
    def wrap(name, graph):
        def call(*args, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = graph(*args, **kwargs)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base[0]
            peaks[name] = max(peaks.get(name, 0), peak)
            return out
        return call
    compiled_blocks.wrap_phase_graphs(block_class, wrap)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="dit_5b", choices=sorted(peer.CASES))
    parser.add_argument("--weights", default="fp8_e4m3fn_fast")
    parser.add_argument("--attention", default="fp8_triton")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("phase_peaks_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    config, _, state, noise, context, timestep = peer.dit_setup(
        args.case, False, 0, device, torch.bfloat16).parts()
    model = peer.ours_dit(config, state, torch.bfloat16)
    if args.weights != "bf16":
        model = quantize_block_linears(model, args.weights)

    def forward():
        return model(noise, timestep, context, attention=args.attention, compiled=True)

    peaks: dict[str, int] = {}
    with torch.inference_mode():
        forward()
        base = [torch.cuda.memory_allocated()]
        measured_graphs(type(model.blocks[0]), peaks, base)
        torch.cuda.reset_peak_memory_stats()
        forward()
        torch.cuda.synchronize()
        whole = torch.cuda.max_memory_allocated() - base[0]
    rows = {name: peak / GIB for name, peak in peaks.items()} | {"forward": whole / GIB}
    for name, gib in rows.items():
        print(f"{args.case} {args.weights} {args.attention}: {name} peak {gib:.3f} GiB")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"phase_peaks_{args.case}.json").write_text(json.dumps(
            {"case": args.case, "weights": args.weights, "attention": args.attention,
             "device": peer.device_name(device), "peaks_gib": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
