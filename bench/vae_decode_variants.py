"""How the decoder's execution order changes decode time and memory, on the same weights.

Three ways of running the decoder's upsampled layers, each decoding the same latent untiled, on
the grid planned from a 2 GiB budget and with 256 px tiles at stride 192 (diffusers' geometry):

  whole chunks       every layer sees the four frames a latent frame makes at once
  frame by frame     one frame at a time (run_frame_by_frame), 3D convolutions
  frame by frame, 2D one frame at a time, each causal convolution as a 2D convolution over the
                     frames folded into channels (CausalConv3d.fold_single_frame): the default

All three compute the same values up to rounding; rows give the max difference to the first.

    python bench/vae_decode_variants.py --out DIR [--case vae21_decode vae22_decode]
                                        [--repeats 1] [--quick]

Cases and weights are peer_diffusers.py's (seeded random weights in bf16 on the GPU). Writes
DIR/vae_decode_variants.json and .md. --quick: tiny VAEs on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_diffusers as peer  # noqa: E402

from wan_enhanced.atomic_files import write_atomically  # noqa: E402
from wan_enhanced.vae_tiling.decode import decode_to_images, plan_budget_tiles  # noqa: E402
from wan_enhanced.wan import vae21, vae22  # noqa: E402
from wan_enhanced.wan.vae_blocks import CausalConv3d  # noqa: E402

GIB = 2 ** 30
MODES = {"untiled": dict(tiled=False), "budget 2 GiB": dict(budget_bytes=2 << 30),
         "tiled 256/192": dict(tiled=True, tile=(256, 256), stride=(192, 192))}
VARIANTS = ("whole chunks", "frame by frame", "frame by frame, 2D")


def whole_chunks(layers, x, cache):
    """run_frame_by_frame's stand-in that never splits: the layers see whole chunks."""
    for layer in layers:
        x = layer(x, cache)
    yield x


@contextlib.contextmanager
def variant(name: str):
    saved = (vae21.run_frame_by_frame, vae22.run_frame_by_frame,
             CausalConv3d.fold_single_frame)
    if name == "whole chunks":
        vae21.run_frame_by_frame = vae22.run_frame_by_frame = whole_chunks
    CausalConv3d.fold_single_frame = name == "frame by frame, 2D"
    try:
        yield
    finally:
        (vae21.run_frame_by_frame, vae22.run_frame_by_frame,
         CausalConv3d.fold_single_frame) = saved


def run_case(name: str, args, device: torch.device) -> list[dict]:
    case = peer.CASES[name]
    config = peer.vae_arguments(case.kind, peer.vae_config(case, args.quick))
    latent_shape = peer.QUICK_LATENT[name] if args.quick else case.latent
    dtype = peer.run_dtype(device)
    with torch.device("meta"):
        skeleton = peer.VAE_CLASSES[case.kind](**config)
    state = peer.random_state(skeleton, args.seed, device, dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    latent = torch.randn(latent_shape, generator=gen, device=device).to(dtype)
    model = peer.ours_vae(case.kind, config, state)
    rows, first = [], {}
    for mode, tiling in MODES.items():
        if "budget_bytes" in tiling:
            grid = plan_budget_tiles(skeleton, latent_shape, tiling["budget_bytes"], dtype)
            print(f"  {mode}: {len(grid.rows)}x{len(grid.cols)} tiles", flush=True)
        for label in VARIANTS:
            with variant(label):
                out, run = peer.timed(lambda: decode_to_images(model, latent, **tiling),
                                      args.repeats, device, lambda images: images)
            first.setdefault(mode, out)
            diff = peer.difference(out, first[mode])
            print(f"  {mode} / {label}: {run.median_ms} ms, peak "
                  f"{(run.peak_allocated or 0) / GIB:.2f} GiB", flush=True)
            rows.append({"case": name, "video": case.video, "mode": mode, "variant": label,
                         "run": run.to_dict(), "max_abs_diff_to_first": diff[0]})
    del model, state
    peer.free_memory()
    return rows


def markdown(data: dict) -> str:
    lines = [f"# VAE decode: execution order variants, {data['device']}, {data['date']}", "",
             f"torch {data['torch']}; {data['dtype']}; median of {data['repeats']} after a "
             f"warm-up; peak = allocated above weights and latent.", "",
             "    " + data["command"], "",
             "| case | mode | variant | ms | peak GiB | max abs diff to whole chunks |",
             "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        run = r["run"]
        ms = run["error"] or peer._fmt(run["median_ms"], ".0f")
        lines.append(f"| {r['case']} {r['video']} | {r['mode']} | {r['variant']} | {ms} | "
                     f"{peer._fmt(run['peak_allocated_bytes'], '.2f', GIB)} | "
                     f"{peer._fmt(r['max_abs_diff_to_first'], '.2e')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", nargs="+", choices=["vae21_decode", "vae22_decode"],
                        default=["vae21_decode", "vae22_decode"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = {"device": torch.cuda.get_device_name() if device.type == "cuda"
            else platform.processor() or "cpu", "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "dtype": str(peer.run_dtype(device)).removeprefix("torch."),
            "repeats": args.repeats, "command": "python " + " ".join(sys.argv), "rows": []}
    for name in args.case:
        print(f"{name}:", flush=True)
        t0 = time.perf_counter()
        data["rows"] += run_case(name, args, device)
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
        write_atomically(out / "vae_decode_variants.json", json.dumps(data, indent=1).encode())
        write_atomically(out / "vae_decode_variants.md", markdown(data).encode())
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
