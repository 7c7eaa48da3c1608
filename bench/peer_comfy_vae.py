"""Our VAE decode against ComfyUI's own Wan VAE, on the same latents and the same weights.

    python bench/peer_comfy_vae.py --comfyui PATH --out DIR [--case vae21_decode vae22_decode]
                                   [--repeats 3] [--quick]

One process, one GPU. For each case one set of seeded random bf16 weights with the released
VAE's shapes is drawn on the device. The same tensors are loaded, under the same names, into
ours (wan/vae21.py, wan/vae22.py) and into ComfyUI's module (comfy.ldm.wan.vae or vae2_2
WanVAE, built with the configuration comfy.sd.VAE gives the released file). Both decode the same
raw latent:
- ComfyUI as its VAE Decode node does when the latent fits the GPU: the module's decode, the
  frames moved to the CPU in float32, mapped to (x + 1) / 2 and clamped to 0..1. This is
  comfy.sd.VAE.decode without its batching and its out-of-memory fallback.
- Ours through decode_to_images: untiled, and on the decode node's `auto` grid for a 3 GiB
  budget.
Each decode is warmed up once and timed --repeats times (CUDA events, median). Peak memory is
counted above what was allocated before (weights and latent). Outputs are compared on the CPU
with ComfyUI's: max |diff|, and max |diff| / max |ComfyUI|.

The checkout must have comfy/ldm/wan/vae.py and vae2_2.py with WanVAE; anything else is refused
before any timing. --quick runs the tiny VAEs and latents on the CPU in float32: a smoke run
with no memory figures. Rows go to DIR/peer_comfy_vae.json and DIR/peer_comfy_vae.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer
from wan_enhanced.bench.peer_comfy import ComfyCheckoutError, import_comfy, start_peer
from wan_enhanced.vae_tiling.decode import decode_to_images

CASES = ("vae21_decode", "vae22_decode")
THEIRS = {"vae21": "vae", "vae22": "vae2_2"}  # the module under comfy/ldm/wan/
OUR_MODES = {"untiled": dict(tiled=False), "budget 3 GiB": dict(budget_bytes=3 << 30)}
# what ComfyUI's constructor takes; the Wan2.2 VAE also takes its decoder's width
COMFY_ARGS = ("dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales",
              "temperal_downsample", "dropout")


def import_comfy_vaes(path: Path, cpu: bool) -> dict:
    """ComfyUI's two Wan VAE modules by our kind, or ComfyCheckoutError naming what is missing."""
    import_comfy(path, cpu)  # refuses a folder that is no ComfyUI checkout, or too old a one
    import importlib

    modules = {}
    for kind, name in THEIRS.items():
        try:
            module = importlib.import_module(f"comfy.ldm.wan.{name}")
        except ImportError as error:
            raise ComfyCheckoutError(f"--comfyui {path}: comfy/ldm/wan/{name}.py cannot be "
                                     f"imported ({error}); the Wan VAE peer needs it") from error
        if not hasattr(module, "WanVAE"):
            raise ComfyCheckoutError(f"--comfyui {path}: comfy/ldm/wan/{name}.py has no "
                                     f"WanVAE; use a ComfyUI from 2025-08 or later")
        modules[kind] = module
    return modules


def comfy_kwargs(kind: str, config: dict) -> dict:
    """ComfyUI's WanVAE arguments for our VAE of `kind` built with `config` (our constructor's
    defaults, the released model, updated by it), as lists where ComfyUI indexes or reverses."""
    ours = peer.vae_arguments(kind, config)
    names = COMFY_ARGS + (("dec_dim",) if kind == "vae22" else ())
    return {name: list(ours[name]) if isinstance(ours[name], tuple) else ours[name]
            for name in names}


def comfy_decode(model: torch.nn.Module, latent: torch.Tensor) -> torch.Tensor:
    """The VAE Decode node's path for a latent that fits: decode, to the CPU in float32, to 0..1
    (clamped); in our IMAGE layout [B*F, H, W, 3]."""
    return peer.images_from_video(model.decode(latent).to("cpu")).clamp_(0.0, 1.0)


def run_case(name: str, args, device: torch.device, comfy: dict) -> list[dict]:
    setup = peer.vae_setup(name, args.quick, args.seed, device)
    case, config, shape, dtype = setup.case, setup.config, setup.latent_shape, setup.dtype
    state, latent = setup.state, setup.latent
    with torch.device("meta"):
        theirs = comfy[case.kind].WanVAE(**comfy_kwargs(case.kind, config))
    ours = peer.ours_vae(case.kind, config, state)
    theirs.load_state_dict(state, strict=True, assign=True)
    theirs.eval().requires_grad_(False)
    identity = lambda out: out  # noqa: E731 (both decodes hand back CPU frames already)

    reference, their_run = peer.timed(lambda: comfy_decode(theirs, latent), args.repeats,
                                      device, identity)
    print(f"  ComfyUI: {their_run.median_ms} ms", flush=True)
    theirs = None  # the module (its weights are the tensors ours holds too)
    peer.free_memory()
    rows = []
    for mode, tiling in OUR_MODES.items():
        out, run = peer.timed(lambda: decode_to_images(ours, latent, dtype=dtype, **tiling),
                              args.repeats, device, identity)
        print(f"  ours {mode}: {run.median_ms} ms", flush=True)
        diff = peer.difference(out, reference)
        rows.append({"case": name, "video": case.video, "latent": list(shape), "ours": mode,
                     "ours_run": run.to_dict(), "comfy_run": their_run.to_dict(),
                     "time_ratio": peer.ratio(run.median_ms, their_run.median_ms),
                     "peak_ratio": peer.ratio(run.peak_allocated, their_run.peak_allocated),
                     "weights_bytes": peer.device_bytes(ours), "max_abs_diff": diff[0],
                     "max_rel_diff": diff[1], "repeats": args.repeats})
    return rows


def markdown(data: dict) -> str:
    lines = [f"# Our VAE decode against ComfyUI's ({data['comfyui']})", "",
             f"device: {data['device']}; torch {data['torch']}; date {data['date']}; "
             f"median of {data['repeats']}; command: `{data['command']}`", "",
             "| case | video | ours | ours ms | ComfyUI ms | ours / ComfyUI | peak GiB ours / "
             "ComfyUI | max rel. diff. to ComfyUI |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    for r in data["rows"]:
        ours, theirs = r["ours_run"], r["comfy_run"]
        lines.append(
            f"| {r['case']} | {r['video']} | {r['ours']} | {peer.fmt(ours['median_ms'], '.0f')} "
            f"| {peer.fmt(theirs['median_ms'], '.0f')} | {peer.fmt(r['time_ratio'], '.3f')} | "
            f"{peer.fmt(peer.gib(ours['peak_allocated_bytes']), '.2f')} / "
            f"{peer.fmt(peer.gib(theirs['peak_allocated_bytes']), '.2f')} | "
            f"{peer.fmt(r['max_rel_diff'], '.2e')} |")
    errors = [f"- {r['case']} {r['ours']}: ours {r['ours_run']['error']}, ComfyUI "
              f"{r['comfy_run']['error']}" for r in data["rows"]
              if r["ours_run"]["error"] or r["comfy_run"]["error"]]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI checkout")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = start_peer("peer_comfy_vae", args, import_comfy_vaes)
    if started is None:
        return 2
    device, comfy, meta = started
    rows = []
    for name in args.case:
        print(name, flush=True)
        rows += run_case(name, args, device, comfy)
    data = {**meta, "rows": rows}
    text = markdown(data)
    peer.save_result(args.out, "peer_comfy_vae", data, text)
    print(text)
    return 1 if any(r["ours_run"]["error"] or r["comfy_run"]["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
