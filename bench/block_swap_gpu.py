"""Block swap against the fully resident model: one DiT forward, same weights, same inputs.

For each case one set of seeded random bf16 weights is drawn on the GPU (as in
peer_diffusers.py) and the forward is timed with the model
  resident            every weight on the GPU
  swap N, prefetch P  the first N blocks packed in pinned CPU memory and streamed through P+1
                      slot buffers on a side stream (offload/block_swap.py), the rest resident
eager and with the blocks compiled. Reported per row: median ms and its ratio to the resident
row of the same mode, the device memory the forward needs in all (peak allocated, weights and
slots included: what decides whether it fits) and how much of it are weights, and how the
output compares with the resident output (eager: bit for bit, the same kernels on the same
bytes; compiled: to rounding, the blocks may be compiled again for the slot views).
Also the host-to-device copy speed of one block against one block's compute time, which says
how much of a swap can hide behind the compute.

    python bench/block_swap_gpu.py --out DIR [--case dit_1_3b dit_14b] [--repeats 3] [--quick]

--quick: tiny model and latent, on the CPU when there is no GPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer

from wan_enhanced.atomic_files import write_atomically
from wan_enhanced.offload.block_swap import BlockSwap

GIB = peer.GIB
CASES = ("dit_1_3b", "dit_14b", "dit_5b")


def swap_settings(num_layers: int) -> list[tuple[int, int]]:
    """(blocks swapped, prefetch) per row after the resident one."""
    return [(num_layers, 1), (num_layers, 2), (num_layers // 2, 1)]


def block_copy_speed(swap: BlockSwap, device: torch.device) -> tuple[float, float] | None:
    """(ms to copy one packed block from pinned memory to the device, GB/s), alone on the bus."""
    if device.type != "cuda" or not swap.packs:
        return None
    pack = swap.packs[0]
    target = torch.empty(pack.layout.total, dtype=torch.uint8, device=device)
    target.copy_(pack.buffer, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        target.copy_(pack.buffer, non_blocking=True)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / 5
    del target
    return ms, pack.layout.total / ms / 1e6


def run_case(name: str, args, device: torch.device, modes: list[str]) -> list[dict]:
    case = peer.CASES[name]
    dtype = peer.run_dtype(device)
    config, latent, state, noise, context, timestep = peer.dit_setup(
        name, args.quick, args.seed, device, dtype, per_token_timestep=False).parts()
    model = peer.ours_dit(config, state, dtype)
    del state
    weights = peer.device_bytes(model)
    blocks = list(model.blocks)

    def forward(mode: str, swap: BlockSwap | None):
        return lambda: model(noise, timestep, context, attention="sdpa",
                             compiled=mode == "compiled",
                             blocks=None if swap is None else swap.blocks())

    rows, resident = [], {}
    for mode in modes:
        out, run = peer.timed(forward(mode, None), args.repeats, device,
                              lambda o: o.float().cpu())
        resident[mode] = (out, run)
        rows.append(row(name, case.video, mode, 0, 0, run, run, weights, True, None))
        print(f"  resident {mode}: {run.median_ms} ms", flush=True)

    # the blocks move to the CPU once; each swap row packs (first time) or finds its blocks
    for block in blocks:
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.data = tensor.data.cpu()
    peer.free_memory()
    for count, prefetch in swap_settings(len(blocks)):
        resident_blocks = place(blocks[count:], device)
        with BlockSwap(blocks, range(count), device, slots=prefetch + 1) as swap:
            copy = block_copy_speed(swap, device)
            on_device = peer.device_bytes(model) - sum(p.buffer.numel() for p in swap.packs) \
                if device.type == "cpu" else torch.cuda.memory_allocated() - noise.nbytes \
                - context.nbytes - timestep.nbytes
            for mode in modes:
                out, run = peer.timed(forward(mode, swap), args.repeats, device,
                                      lambda o: o.float().cpu())
                reference, base = resident[mode]
                same = out is not None and reference is not None and torch.equal(out, reference)
                diff = peer.difference(out, reference)[1]
                rows.append(row(name, case.video, mode, count, prefetch, run, base, on_device,
                                same, copy, diff))
                print(f"  swap {count} prefetch {prefetch} {mode}: {run.median_ms} ms, "
                      f"equal: {same}, max rel diff {diff:.2e}", flush=True)
        unplace(resident_blocks)
    del model
    peer.free_memory()
    return rows


def place(blocks, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The blocks that are not swapped go to the device; returns (tensor, CPU master) pairs."""
    masters = []
    for block in blocks:
        for tensor in [*block.parameters(), *block.buffers()]:
            masters.append((tensor, tensor.data))
            tensor.data = tensor.data.to(device)
    return masters


def unplace(masters) -> None:
    for tensor, master in masters:
        tensor.data = master
    peer.free_memory()


def row(case, video, mode, count, prefetch, run, resident, weights_on_device, equal, copy,
        diff=0.0):
    absolute = None if run.peak_allocated is None else run.peak_allocated + run.allocated_before
    return {"case": case, "video": video, "mode": mode, "blocks_swapped": count,
            "prefetch": prefetch, "run": run.to_dict(),
            "time_ratio": peer.ratio(run.median_ms, resident.median_ms),
            "peak_total_bytes": absolute, "weights_on_device_bytes": weights_on_device,
            "equal_to_resident": equal, "max_rel_diff_to_resident": diff,
            "block_copy_ms": None if copy is None else copy[0],
            "copy_gb_per_s": None if copy is None else copy[1]}


def markdown(data: dict) -> str:
    f = peer.fmt
    lines = ["# Block swap against the resident model", "",
             f"device: {data['device']}; torch {data['torch']}; date {data['date']}; "
             f"{data['dtype']}; median of {data['repeats']} timed forwards after a warm-up", "",
             "Command:", "", f"    {data['command']}", "",
             "Peak is the device memory allocated at the forward's peak, weights, slots and "
             "inputs included; \"weights\" is what stays on the device for the run (resident "
             "weights and the slot buffers).", "",
             "| case | video | mode | swapped | prefetch | ms | / resident | peak GiB "
             "| weights GiB | bit-equal | max rel diff | block copy ms | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        run = r["run"]
        lines.append(
            f"| {r['case']} | {r['video']} | {r['mode']} | {r['blocks_swapped']} | "
            f"{r['prefetch']} | {run['error'] or f(run['median_ms'], '.0f')} | "
            f"{f(r['time_ratio'], '.3f')} | {f(r['peak_total_bytes'], '.2f', GIB)} | "
            f"{f(r['weights_on_device_bytes'], '.2f', GIB)} | "
            f"{'yes' if r['equal_to_resident'] else 'no'} | "
            f"{f(r.get('max_rel_diff_to_resident'), '.1e')} | {f(r['block_copy_ms'], '.1f')} | "
            f"{f(r['copy_gb_per_s'], '.1f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", nargs="+", choices=CASES, default=["dit_1_3b", "dit_14b"])
    parser.add_argument("--mode", nargs="+", choices=("eager", "compiled"),
                        default=["eager", "compiled"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda"
            else platform.processor() or "cpu",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "dtype": str(peer.run_dtype(device)).removeprefix("torch."),
            "repeats": args.repeats, "quick": args.quick,
            "command": "python " + " ".join(sys.argv), "rows": []}
    for name in args.case:
        print(f"{name}:", flush=True)
        t0 = time.perf_counter()
        data["rows"] += run_case(name, args, device, args.mode)
        print(f"  {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        write_atomically(out / "block_swap.json", json.dumps(data, indent=1).encode())
        write_atomically(out / "block_swap.md", markdown(data).encode())
    print(markdown(data))
    # eager blocks must match bit for bit; compiled ones may be compiled again for the slot
    # views' addresses and round differently
    exact = all(r["equal_to_resident"] for r in data["rows"] if r["mode"] == "eager")
    close = all(r["max_rel_diff_to_resident"] <= 1e-2 for r in data["rows"])
    return 0 if exact and close else 1


if __name__ == "__main__":
    sys.exit(main())
