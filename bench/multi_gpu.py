"""Several GPUs against one: DiT forwards of the same model on the same inputs, split over 1, 2
and 4 GPUs by the package's worker group (sequence parallel: Ulysses where the heads divide,
ring otherwise), with and without the blocks sharded (`fsdp`, distributed/sharded_blocks.py).

Default case: Wan2.1 T2V 14B (40 heads) at 1280x720x81 (latent 21x90x160: 75,600 tokens) with
seeded random bf16 weights of the real size, drawn on each GPU (the same on every GPU and in the
one-GPU run). Every count runs in a fresh group; its first forwards warm up (cuDNN plans, NCCL
communicators), the rest are timed (each synchronized). Per row: seconds per forward (median),
speed-up over the one-GPU row, the FSDP overhead over the same count without it, the output's
largest difference to the one-GPU output relative to its largest value, and each rank's
metrics (all-to-all time and bytes, compute time, reserved peak, weights held). JSON and
Markdown are written into --out.

    python bench/multi_gpu.py --out DIR [--gpus 1,2,4] [--fsdp both|on|off] [--repeats 3]
                              [--warmup 1] [--compile] [--size 1280x720x81] [--profile]
                              [--quick]
    (or python -m wan_enhanced.bench.multi_gpu ...)

--profile: one more forward per row under torch.profiler on every rank, after the timed ones;
kernels.md gets rank 0's longest kernels of each row, side by side (the JSON: every rank's).
--quick: a tiny model and latent on gloo CPU processes (a test of the script; CI runs it).
Targets (DESIGN.md section 8): >= 1.85x on 2 GPUs, >= 3.5x on 4, FSDP overhead <= 1%, outputs
equal to the one-GPU output to bf16 rounding.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

# NVLink SHARP multicast off in this process and every rank it starts (the hosts lack its
# fabric manager); set before torch initialises anything
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402

from wan_enhanced.atomic_files import write_atomically  # noqa: E402
from wan_enhanced.bench.harness import device_name, save_result  # noqa: E402
from wan_enhanced.distributed.contracts import ForwardCase, ForwardRequest, ModelSpec  # noqa: E402
from wan_enhanced.distributed.devices import available  # noqa: E402
from wan_enhanced.distributed.errors import WorkerFailed  # noqa: E402
from wan_enhanced.distributed.group import WorkerGroup  # noqa: E402
from wan_enhanced.profiling.report_ranks import device_peak  # noqa: E402
from wan_enhanced.wan.configs import KNOWN_DITS, DiTConfig  # noqa: E402

SEED = 20261124
GIB = float(1 << 30)
QUICK = DiTConfig(name="quick", dim=128, ffn_dim=256, num_heads=4, num_layers=2)
TIMEOUT_S = 3600
TARGETS = {2: 1.85, 4: 3.5}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="wan2.1-t2v-14b", choices=sorted(KNOWN_DITS))
    p.add_argument("--size", default="1280x720x81", help="WIDTHxHEIGHTxFRAMES")
    p.add_argument("--gpus", default="1,2,4", help="GPU counts, comma-separated")
    p.add_argument("--fsdp", default="both", choices=("both", "on", "off"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    p.add_argument("--profile", action="store_true", help="a kernel table per row (kernels.md)")
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


def inputs(config: DiTConfig, size: str, quick: bool) -> ForwardCase:
    """A seeded noisy latent, timestep 700 and 512 text rows, float32 on the CPU."""
    if quick:
        frames, height, width = 3, 8, 12
    else:
        w, h, f = (int(v) for v in size.lower().split("x"))
        frames, height, width = (f - 1) // 4 + 1, h // 8, w // 8
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, config.in_dim, frames, height, width, generator=gen)
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen)
    return ForwardCase(x, torch.tensor([700.0]), context)


def plan(counts: list[int], fsdp: str) -> list[tuple[int, bool]]:
    """(gpus, fsdp) per row, the one-GPU row first (the reference)."""
    rows = [(1, False)]  # always: the reference of every other row
    for n in sorted(set(counts) - {1}):
        if fsdp in ("off", "both"):
            rows.append((n, False))
        if fsdp in ("on", "both"):
            rows.append((n, True))
    return rows


def run_row(config: DiTConfig, case: ForwardCase, gpus: int, fsdp: bool, args,
            device_type: str) -> dict:
    spec = ModelSpec(config=config.to_dict(), seed=SEED,
                     dtype="float32" if args.quick else "bfloat16",
                     attention="sdpa" if args.quick else "sdpa_cudnn", compile=args.compile,
                     fsdp=fsdp)
    request = ForwardRequest(spec, (case,), repeats=args.warmup + args.repeats, keep_model=False,
                             profile=args.profile)
    group = WorkerGroup(gpus, device_type)
    try:
        group.start()
        result = group.run(".distributed.tasks:forward", request, timeout_s=TIMEOUT_S)
    except WorkerFailed as exc:
        return {"gpus": gpus, "fsdp": fsdp, "status": f"failed: {exc}".split("\n")[0]}
    finally:
        group.shutdown()
    timed = result.seconds[args.warmup:]
    forwards = args.warmup + args.repeats
    ranks = [{**m, "all_to_all_seconds_per_forward": m["all_to_all_seconds"] / forwards,
              "all_to_all_bytes_per_forward": m["all_to_all_bytes"] // forwards,
              "ring_seconds_per_forward": m["ring_seconds"] / forwards}
             for m in result.metrics]
    return {"gpus": gpus, "fsdp": fsdp, "status": "ok",
            "mode": "ulysses" if any(m["all_to_all_calls"] for m in result.metrics) else
            ("ring" if gpus > 1 else "single"),
            "seconds_per_forward": statistics.median(timed), "seconds": timed,
            "ranks": ranks, "output": result.outputs[0]}


def compare(rows: list[dict]) -> None:
    """Speed-up, FSDP overhead and output difference against the one-GPU row, in place."""
    single = next((r for r in rows if r["gpus"] == 1 and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok":
            continue
        if single is not None:
            row["speedup"] = round(single["seconds_per_forward"] / row["seconds_per_forward"], 3)
            ref = single["output"].double()
            row["relative_difference"] = float((row["output"].double() - ref).abs().max()
                                               / ref.abs().max())
        if row["fsdp"]:
            plain = next((r for r in rows if r["gpus"] == row["gpus"] and not r["fsdp"]
                          and r["status"] == "ok"), None)
            if plain is not None:
                row["fsdp_overhead"] = round(row["seconds_per_forward"]
                                             / plain["seconds_per_forward"] - 1, 4)


def without_outputs(rows: list[dict]) -> list[dict]:
    """The rows as written: every field but the output tensor."""
    return [{k: v for k, v in row.items() if k != "output"} for row in rows]


def kernel_tables(rows: list[dict], top: int = 20) -> str:
    """Rank 0's longest kernels of each row's profiled forward."""
    parts = ["# Kernels of one profiled forward, rank 0", ""]
    for r in rows:
        kernels = r["ranks"][0].get("kernels") if r["status"] == "ok" else None
        if not kernels:
            continue
        parts += [f"## {r['gpus']} GPU(s), fsdp {_yes(r['fsdp'])}",
                  f"every kernel's time summed (streams overlap): "
                  f"{r['ranks'][0]['kernels_summed_ms']:.1f} ms", "",
                  "| ms | calls | kernel |", "|---:|---:|---|"]
        parts += [f"| {k['ms']:.2f} | {k['calls']} | `{k['name'][:110]}` |"
                  for k in kernels[:top]]
        parts.append("")
    return "\n".join(parts)


def markdown(report: dict) -> str:
    title = ("quick check (a tiny model on gloo CPU processes)" if report["model"] == "quick"
             else f"{report['model']} at {report['size']}")
    lines = [f"# Several GPUs: {title}", "",
             f"device: {report['device']}, torch {report['torch']}, {report['dtype']}, "
             f"attention {report['attention']}{', compiled' if report['compile'] else ''}; "
             f"median of {report['repeats']} forwards after {report['warmup']} warm-up.", "",
             "| GPUs | fsdp | attention | s / forward | speed-up | target | FSDP overhead | "
             "rel. diff. to 1 GPU | all-to-all s / fwd (rank 0) | all-to-all GiB / fwd | "
             "largest device peak GiB | weights GiB per rank | status |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['gpus']} | {_yes(r['fsdp'])} | | | | | | | | | | | "
                         f"{r['status']} |")
            continue
        rank0 = r["ranks"][0]
        peaks = [device_peak(m) or m["rss_peak_bytes"] for m in r["ranks"]]
        lines.append(
            f"| {r['gpus']} | {_fsdp(r)} | {r['mode']} | {r['seconds_per_forward']:.3f} | "
            f"{_num(r.get('speedup'), 2)} | {_target(r['gpus'])} | "
            f"{_pct(r.get('fsdp_overhead'))} | {_num(r.get('relative_difference'), 2, 'e')} | "
            f"{rank0['all_to_all_seconds_per_forward']:.3f} | "
            f"{rank0['all_to_all_bytes_per_forward'] / GIB:.2f} | {max(peaks) / GIB:.2f} | "
            f"{rank0['weight_bytes'] / GIB:.2f} | ok |")
    lines += ["", "Device peak: the torch allocator's reserved peak plus what the rank holds "
              "outside it (with fsdp on GPUs: its chunks of the blocks, in symmetric memory); the "
              "process's peak RSS on the CPU. Per-rank metrics of every row are in the JSON."]
    return "\n".join(lines) + "\n"


def _fsdp(row: dict) -> str:
    """on / off, and with fsdp how the blocks came together (rank 0's metric)."""
    fill = row["ranks"][0].get("fsdp_fill") if row.get("ranks") else None
    return f"{_yes(row['fsdp'])} ({fill})" if fill else _yes(row["fsdp"])


def _yes(flag) -> str:
    return "on" if flag else "off"


def _num(value, digits, kind="f") -> str:
    return "" if value is None else f"{value:.{digits}{kind}}"


def _pct(value) -> str:
    return "" if value is None else f"{100 * value:+.1f}%"


def _target(gpus: int) -> str:
    return f">= {TARGETS[gpus]}" if gpus in TARGETS else ""


def main(argv=None) -> int:
    args = parse(argv)
    device_type = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if device_type == "cpu" and not args.quick:
        print("error: no CUDA GPU here; run with --quick for the CPU check", file=sys.stderr)
        return 2
    counts = [int(v) for v in args.gpus.split(",")]
    have, what = available(device_type) if device_type == "cuda" else (64, "CPU processes")
    if max(counts) > have:
        print(f"error: --gpus {max(counts)} asked for; this machine has {what}", file=sys.stderr)
        return 2
    config = QUICK if args.quick else KNOWN_DITS[args.model].config
    case = inputs(config, args.size, args.quick)
    rows = []
    for gpus, fsdp in plan(counts, args.fsdp):
        row = run_row(config, case, gpus, fsdp, args, device_type)
        rows.append(row)
        print(f"{gpus} GPU(s), fsdp {_yes(fsdp)}: {row['status']}"
              + (f", {row['seconds_per_forward']:.3f} s per forward" if row["status"] == "ok"
                 else ""), flush=True)
        # written after every row, so a run cut short keeps the rows it measured
        compare(rows)
        save_result(args.out, "multi_gpu", *report_of(args, device_type, rows))
        if args.profile:
            write_atomically(args.out / "kernels.md", kernel_tables(rows).encode())
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def report_of(args, device_type: str, rows: list[dict]) -> tuple[dict, str]:
    """The JSON report and its Markdown table for the rows measured so far."""
    report = {"model": "quick" if args.quick else args.model,
              "size": "quick" if args.quick else args.size,
              "device": device_name() if device_type == "cuda" else "cpu (gloo)",
              "torch": torch.__version__, "python": platform.python_version(),
              "dtype": "float32" if args.quick else "bfloat16",
              "attention": "sdpa" if args.quick else "sdpa_cudnn", "compile": args.compile,
              "repeats": args.repeats, "warmup": args.warmup,
              "environment": {k: os.environ.get(k) for k in
                              ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
              "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "rows": without_outputs(rows)}
    return report, markdown(report)


if __name__ == "__main__":
    sys.exit(main())
