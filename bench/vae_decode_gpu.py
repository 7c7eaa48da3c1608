"""Our VAE decode before and after the channels-last decoder, on the same weights and latent.

    python bench/vae_decode_gpu.py --out DIR [--case vae21_decode vae22_decode] [--repeats 3]
                                   [--variants before after ...] [--profile] [--quick]

One process, one GPU. For each case one set of seeded random bf16 weights with the released
VAE's shapes is drawn on the device (as bench/peer_comfy_vae.py draws them) and one raw latent.
decode_to_images decodes it untiled and on the decode node's `auto` grid for a 3 GiB budget, in
each variant:
- before: the decoder in NCDHW (decode_memory_format = contiguous_format), as it ran before;
- after: the default, channels_last_3d on CUDA with the fused norm kernel;
- after_benchmark: after, with torch.backends.cudnn.benchmark on for the decode.
The variants are warmed up once and timed in turns (median of --repeats, CUDA events); peak =
the most allocated during a call over what was allocated before it. Each variant's images are
compared with before's (max |diff|, images in 0..1). `counted` is the budget model's count for
the tile (estimate_decode_bytes without its calibration and safety factors), so peak / counted
is what budget.MEASURED_OVER_COUNTED states. --profile adds the device kernels of one `after`
decode on the 3 GiB grid (profiling/kernels.py). --quick runs the tiny VAEs on the CPU in float32
(after = channels_last_3d there too, without the kernel). Rows go to DIR/vae_decode_gpu.json and
DIR/vae_decode_gpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer
from wan_enhanced.profiling.kernels import profiled
from wan_enhanced.vae_tiling import budget
from wan_enhanced.vae_tiling.decode import decode_to_images, plan_grid

CASES = ("vae21_decode", "vae22_decode")
MODES = {"untiled": dict(tiled=False), "budget 3 GiB": dict(budget_bytes=3 << 30)}
VARIANTS = ("before", "after", "after_benchmark")


def decode_call(vae, latent, dtype, tiling: dict, variant: str, device: torch.device):
    """A call that decodes in `variant` (any failure recorded as a RuntimeError)."""
    if variant == "before":
        layout = torch.contiguous_format
    else:
        layout = None if device.type == "cuda" else torch.channels_last_3d

    def call():
        vae.decode_memory_format = layout
        benchmark = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = variant == "after_benchmark"
        try:
            return decode_to_images(vae, latent, dtype=dtype, **tiling)
        except RuntimeError:
            raise
        except Exception as error:  # a kernel that does not build: recorded like an OOM
            raise RuntimeError(f"{type(error).__name__}: {error}") from error
        finally:
            torch.backends.cudnn.benchmark = benchmark
            vae.decode_memory_format = None
    return call


def counted_bytes(vae, shape, dtype, grid) -> int:
    """The budget model's count for one tile of `grid`, without its two factors."""
    tile = next(iter(grid))
    cost = budget.DecodeCost(vae, shape[0], dtype)
    estimate = cost.bytes(tile.rows.size, tile.cols.size)
    return int(estimate / (budget.SAFETY_FACTOR * cost.calibration))


def run_case(name: str, args, device: torch.device) -> tuple[list[dict], list[dict]]:
    setup = peer.vae_setup(name, args.quick, args.seed, device)
    case, shape, dtype, latent = setup.case, setup.latent_shape, setup.dtype, setup.latent
    vae = peer.ours_vae(case.kind, setup.config, setup.state)
    variants = [v for v in args.variants if device.type == "cuda" or v != "after_benchmark"]
    rows = []
    for mode, tiling in MODES.items():
        grid = plan_grid(vae, shape, **tiling)
        fns = {v: decode_call(vae, latent, dtype, tiling, v, device) for v in variants}
        results = peer.timed_in_turns(fns, args.repeats, device, lambda out: out)
        before = results.get("before", (None, None))[0]
        counted = counted_bytes(vae, shape, dtype, grid)
        for variant, (out, run) in results.items():
            diff = peer.difference(out, before)
            rows.append({"case": name, "video": case.video, "latent": list(shape), "mode": mode,
                         "tiles": len(grid), "variant": variant, "run": run.to_dict(),
                         "counted_bytes": counted,
                         "peak_over_counted": peer.ratio(run.peak_allocated, counted),
                         "max_abs_diff_to_before": diff[0], "repeats": args.repeats})
            print(f"  {mode} {variant}: {run.median_ms} ms, peak "
                  f"{peer.fmt(peer.gib(run.peak_allocated), '.2f')} GiB, diff {diff[0]:.3g}"
                  + (f" ({run.error})" if run.error else ""), flush=True)
        del results, before
        peer.free_memory()
    profiles = []
    if args.profile:
        call = decode_call(vae, latent, dtype, MODES["budget 3 GiB"], "after", device)
        with torch.inference_mode():
            _, totals = profiled(call, device.type)
        profiles.append({"case": name, "variant": "after", "mode": "budget 3 GiB",
                         "kernels": [t.to_dict() for t in totals[:40]],
                         "total_ms": sum(t.ms for t in totals)})
        for t in totals[:25]:
            print(f"    {t.ms:9.1f} ms {t.calls:6d}  {t.name[:110]}", flush=True)
    return rows, profiles


def markdown(data: dict) -> str:
    lines = [f"# Our VAE decode before and after the channels-last decoder", "",
             f"device: {data['device']}; torch {data['torch']}; date {data['date']}; "
             f"median of {data['repeats']}; command: `{data['command']}`", "",
             "| case | video | mode | tiles | variant | ms | peak GiB | peak / counted | "
             "max abs. diff. to before |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        run = r["run"]
        lines.append(f"| {r['case']} | {r['video']} | {r['mode']} | {r['tiles']} | "
                     f"{r['variant']} | {peer.fmt(run['median_ms'], '.0f')} | "
                     f"{peer.fmt(peer.gib(run['peak_allocated_bytes']), '.2f')} | "
                     f"{peer.fmt(r['peak_over_counted'], '.2f')} | "
                     f"{peer.fmt(r['max_abs_diff_to_before'], '.2e')} |")
    errors = [f"- {r['case']} {r['mode']} {r['variant']}: {r['run']['error']}"
              for r in data["rows"] if r["run"]["error"]]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.quick else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("vae_decode_gpu: no CUDA device (use --quick on a CPU)", file=sys.stderr)
        return 2
    data = {"device": peer.device_name(device), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "repeats": args.repeats,
            "command": " ".join(["python3", "bench/vae_decode_gpu.py", *(argv or sys.argv[1:])]),
            "rows": [], "profiles": []}
    for name in args.case:
        print(name, flush=True)
        rows, profiles = run_case(name, args, device)
        data["rows"] += rows
        data["profiles"] += profiles
        peer.save_result(args.out, "vae_decode_gpu", data, markdown(data))  # after each case
    print(markdown(data))
    return 1 if any(r["run"]["error"] for r in data["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
