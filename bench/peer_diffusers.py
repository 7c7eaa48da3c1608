"""Our DiT forward and VAE decode against diffusers' on the same shapes and the same weights.

One process, one GPU. For every case one set of seeded random bf16 weights is drawn on the device
and handed to our module and, under diffusers' names, to diffusers' module (WanTransformer3DModel,
AutoencoderKLWan): only one of the two models exists at a time, both use the very same tensors.
Each run is warmed up once and then timed `--repeats` times with CUDA events (median reported);
peak memory is max_memory_allocated / max_memory_reserved during the timed runs minus the memory
allocated before them (weights and inputs, reported separately). Outputs are compared on the CPU
in float32: max |ours - diffusers| and that divided by max |diffusers| (the relative measure of
the conformance checks).

    python bench/peer_diffusers.py --out results/peer [--case dit_5b ...] [--repeats 3] [--quick]

Cases (batch 1, bf16 weights):
  dit_5b        Wan2.2 TI2V-5B at 1280x704x121, latent [1,48,31,44,80]
  dit_1_3b      Wan2.1 T2V-1.3B at 832x480x81, latent [1,16,21,60,104]
  dit_14b       Wan2.1 T2V-14B at 1280x720x81, latent [1,16,21,90,160]
  vae21_decode  Wan2.1 VAE decode at 1280x720x81, latent [1,16,21,90,160]
  vae22_decode  Wan2.2 VAE decode at 1280x704x121, latent [1,48,31,44,80]

DiT inputs: the same bf16 noise, 512 rows of bf16 text context (both models attend to all 512;
ours would zero-pad a shorter context), t = 500. The TI2V-5B timestep is given as diffusers'
pipeline gives it (expand_timesteps): one value per patch token, [1, F*H/2*W/2]; ours takes the
same tensor and reduces it to one value per latent frame. Ours runs with attention "sdpa" (on
torch 2.11 and an H100 it picks cuDNN's attention kernel, as diffusers' default processor does),
eager and with its blocks compiled (the model loader's `compile`); diffusers eager and after its
compile_repeated_blocks(). Rows: eager/eager, our compiled/their eager, compiled/compiled; every
output is compared with diffusers' eager output.

VAE: ours through decode_to_images (IMAGE frames in 0..1, streamed to a CPU buffer) untiled,
tiled with its defaults (272x272 px tiles, stride 144x128), tiled with diffusers' geometry
(256 px tiles, stride 192) and on grids planned from a memory budget of 1.5, 2 and 3 GiB (the
decode node's "auto" mode; rows give the grid and the estimate it was planned with); diffusers' decode untiled and with enable_tiling() (256 px tiles,
stride 192), its output left on the GPU as its pipeline has it. Diffusers clamps
the decoded video to [-1, 1]; it is mapped to 0..1 as (x + 1) / 2 for the comparison. Every row
is compared with diffusers' untiled decode.

--quick shrinks the models (width 256, 2 heads, 2 layers; VAE widths 8/12) and the latents, for
a smoke test on the CPU (there everything runs in float32, times are wall-clock and no memory is
measured). Rows are saved after every case into OUT/peer_diffusers.json and .md; a later run
into the same folder replaces the rows of the cases it runs and keeps the others, so the cases
can be split over several calls (each command is recorded).
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

from wan_enhanced.atomic_files import write_atomically
from wan_enhanced.bench.harness import (CASES, GIB, QUICK_DIT, QUICK_LATENT, TIMESTEP,  # noqa: F401
                                        VAE_CLASSES, DiTCase, Run, VAECase, device_bytes,
                                        difference, dit_config, float32_forward, fmt,
                                        free_memory, images_from_video, ours_dit, ours_vae,
                                        random_state, ratio, run_dtype, timed, vae_arguments,
                                        vae_config)
from wan_enhanced.checkpoints.keymaps import dit_ours_to_diffusers
from wan_enhanced.checkpoints.tiny import _diffusers_config_json, vae_ours_to_diffusers
from wan_enhanced.vae_tiling.budget import estimate_decode_bytes, plan_budget_tiles
from wan_enhanced.vae_tiling.decode import decode_to_images
from wan_enhanced.wan.configs import DiTConfig
from wan_enhanced.wan.dit import WanDiT
from wan_enhanced.wan.latent_format import WAN21_LATENT, WAN22_LATENT



# -- weights, and the mapping onto diffusers' modules (the one place it lives) -----------------

def diffusers_dit_kwargs(config: DiTConfig) -> dict:
    kwargs = _diffusers_config_json(config)
    del kwargs["_class_name"]
    return kwargs


def diffusers_dit(config: DiTConfig, state: dict[str, torch.Tensor]):
    """diffusers' WanTransformer3DModel on the tensors of `state` (our key names mapped to
    theirs). The modules diffusers keeps in float32 when it loads a checkpoint in another dtype
    (its _keep_in_fp32_modules: time embedder, norms, modulation tables) get float32 copies."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**diffusers_dit_kwargs(config))
    # The RoPE tables are buffers outside the state dict: build them for real on the device.
    rope = model.rope
    device = next(iter(state.values())).device
    model.rope = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len).to(device)
    keep = model._keep_in_fp32_modules or []
    mapped = {}
    for key, value in state.items():
        name = dit_ours_to_diffusers(key)
        mapped[name] = value.float() if any(m in name.split(".") for m in keep) else value
    model.load_state_dict(mapped, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def diffusers_vae_kwargs(kind: str, config: dict) -> dict:
    """AutoencoderKLWan's config for our VAE of `kind` built with `config`."""
    a = vae_arguments(kind, config)
    kwargs = dict(base_dim=a["dim"], z_dim=a["z_dim"], dim_mult=list(a["dim_mult"]),
                  num_res_blocks=a["num_res_blocks"], attn_scales=list(a["attn_scales"]),
                  temperal_downsample=list(a["temperal_downsample"]), dropout=a["dropout"])
    latent = WAN21_LATENT if kind == "vae21" else WAN22_LATENT
    if latent.channels == a["z_dim"]:
        kwargs.update(latents_mean=list(latent.mean), latents_std=list(latent.std))
    if kind == "vae22":
        patch = a["patch_size"]
        kwargs.update(decoder_base_dim=a["dec_dim"], is_residual=True, patch_size=patch,
                      in_channels=3 * patch ** 2, out_channels=3 * patch ** 2,
                      scale_factor_spatial=patch * 2 ** (len(a["dim_mult"]) - 1))
    return kwargs


def diffusers_vae(kind: str, config: dict, state: dict[str, torch.Tensor]):
    """diffusers' AutoencoderKLWan on the tensors of `state` (our key names mapped to theirs)."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        model = AutoencoderKLWan(**diffusers_vae_kwargs(kind, config))
    names = vae_ours_to_diffusers(list(state), nested=kind == "vae22")
    model.load_state_dict({names[k]: v for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# -- the case families -------------------------------------------------------------------------

def run_dit(name: str, case: DiTCase, args, device: torch.device) -> list[dict]:
    config = dit_config(case, args.quick)
    latent = QUICK_LATENT[name] if args.quick else case.latent
    dtype = run_dtype(device)
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = random_state(skeleton, args.seed, device, dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    noise = torch.randn(latent, generator=gen, device=device).to(dtype)
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen,
                          device=device).to(dtype)
    b, _, f, h, w = latent
    pt, ph, pw = config.patch_size
    tokens = (f // pt) * (h // ph) * (w // pw)
    # diffusers' TI2V pipeline (expand_timesteps) passes one timestep per patch token
    timestep = (torch.full((b, tokens), TIMESTEP, device=device) if case.per_token_timestep
                else torch.full((b,), TIMESTEP, device=device))

    outputs, runs = {}, {}
    model = ours_dit(config, state, dtype)
    weights = {"ours": device_bytes(model)}
    for mode in ("eager", "compiled"):
        outputs[mode], runs[mode] = timed(
            lambda: model(noise, timestep, context, attention="sdpa",
                          compiled=mode == "compiled"),
            args.repeats, device, lambda out: out.float().cpu())
        print(f"  ours {mode}: {runs[mode].median_ms} ms", flush=True)
    del model
    free_memory()
    model = diffusers_dit(config, state)
    weights["diffusers"] = device_bytes(model)
    theirs, their_runs = {}, {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":  # diffusers' own regional compilation of its transformer blocks
            model.compile_repeated_blocks(dynamic=False)
        theirs[mode], their_runs[mode] = timed(
            lambda: model(hidden_states=noise, timestep=timestep, encoder_hidden_states=context,
                          return_dict=False)[0], args.repeats, device,
            lambda out: out.float().cpu())
        print(f"  diffusers {mode}: {their_runs[mode].median_ms} ms", flush=True)
    del model
    free_memory()
    reference = None
    if args.reference:
        print("  float32 reference ...", flush=True)
        reference = float32_forward(config, state, noise, timestep, context)
    del state
    free_memory()

    # compiled ours against diffusers as it runs by default, too: what switching packs gives
    pairs = [("eager", "eager"), ("compiled", "eager"), ("compiled", "compiled")]
    rows = []
    for o, t in pairs:
        row = result_row(name, case.video, latent, f"ours {o}", f"diffusers {t}", runs[o],
                         their_runs[t], weights, difference(outputs[o], theirs["eager"]))
        if reference is not None:
            row["ours_vs_float32_rel"] = difference(outputs[o], reference)[1]
            row["diffusers_vs_float32_rel"] = difference(theirs[t], reference)[1]
        rows.append(row)
    return rows


# our decoder untiled, tiled with its defaults (272 px tiles, stride 144x128: every pixel is
# decoded about four times, for seam-free blending at the least memory), tiled with diffusers'
# geometry (256 px tiles, stride 192), so the tiled rows also compare like with like, and tiled
# on a grid planned from a memory budget (the decode node's "auto" mode, 64 px overlap)
OUR_VAE_MODES = {"untiled": dict(tiled=False), "tiled": dict(tiled=True),
                 "tiled 256/192": dict(tiled=True, tile=(256, 256), stride=(192, 192)),
                 "budget 1.5 GiB": dict(budget_bytes=3 << 29),
                 "budget 2 GiB": dict(budget_bytes=2 << 30),
                 "budget 3 GiB": dict(budget_bytes=3 << 30)}


def run_vae(name: str, case: VAECase, args, device: torch.device) -> list[dict]:
    config = vae_arguments(case.kind, vae_config(case, args.quick))
    latent_shape = QUICK_LATENT[name] if args.quick else case.latent
    dtype = run_dtype(device)
    with torch.device("meta"):
        skeleton = VAE_CLASSES[case.kind](**config)
    state = random_state(skeleton, args.seed, device, dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    latent = torch.randn(latent_shape, generator=gen, device=device).to(dtype)

    outputs, runs = {}, {}
    model = ours_vae(case.kind, config, state)
    weights = {"ours": device_bytes(model)}
    for mode, tiling in OUR_VAE_MODES.items():
        outputs[mode], runs[mode] = timed(
            lambda: decode_to_images(model, latent, dtype=dtype, **tiling),
            args.repeats, device, lambda out: out)
        print(f"  ours {mode}: {runs[mode].median_ms} ms", flush=True)
    del model
    free_memory()
    model = diffusers_vae(case.kind, config, state)
    weights["diffusers"] = device_bytes(model)
    theirs, their_runs = {}, {}
    for mode in ("untiled", "tiled"):
        if mode == "tiled":
            model.enable_tiling()
        theirs[mode], their_runs[mode] = timed(
            lambda: model.decode(latent, return_dict=False)[0], args.repeats, device,
            images_from_video)
        print(f"  diffusers {mode}: {their_runs[mode].median_ms} ms", flush=True)
    del model, state
    free_memory()

    rows = []
    for mode, tiling in OUR_VAE_MODES.items():
        their_mode = "untiled" if mode == "untiled" else "tiled"
        row = result_row(name, case.video, latent_shape, f"ours {mode}", f"diffusers {their_mode}",
                         runs[mode], their_runs[their_mode], weights,
                         difference(outputs[mode], theirs["untiled"]))
        row["time_vs_diffusers_untiled"] = ratio(runs[mode].median_ms,
                                                  their_runs["untiled"].median_ms)
        if "budget_bytes" in tiling:  # the planned grid and the estimate it was planned with
            grid = plan_budget_tiles(skeleton, latent_shape, tiling["budget_bytes"], dtype)
            tile = grid.tiles[0]
            row["grid"] = [len(grid.rows), len(grid.cols), tile.rows.size, tile.cols.size]
            row["estimated_peak_bytes"] = estimate_decode_bytes(
                skeleton, (tile.rows.size, tile.cols.size), latent_shape[0], dtype)
        if their_mode == "tiled":  # diffusers' own tiling error, for scale
            row["diffusers_tiled_vs_untiled_max_abs"] = difference(theirs["tiled"],
                                                                   theirs["untiled"])[0]
        rows.append(row)
    return rows


# -- results -----------------------------------------------------------------------------------

def result_row(case: str, video: str, latent, ours_label: str, theirs_label: str, ours: Run,
               theirs: Run, weights: dict, diff: tuple[float, float]) -> dict:
    return {"case": case, "video": video, "latent": list(latent), "ours": ours_label,
            "diffusers": theirs_label, "ours_run": ours.to_dict(), "diffusers_run": theirs.to_dict(),
            "time_ratio": ratio(ours.median_ms, theirs.median_ms),
            "peak_ratio": ratio(ours.peak_allocated, theirs.peak_allocated),
            "weights_bytes": weights, "max_abs_diff": diff[0], "max_rel_diff": diff[1],
            "repeats": len(ours.times_ms)}


def markdown(data: dict) -> str:
    commands = "\n".join(f"    {c}" for c in data["commands"])
    lines = [f"# Peer benchmark: ours against diffusers {data['diffusers']}", "",
             f"device: {data['device']}; torch {data['torch']}; date {data['date']}; "
             f"{data['dtype']} weights and activations; median of each row's repeats", "",
             "Commands:", "", commands, "",
             "Peaks are the memory allocated during the timed runs above what was allocated before "
             "them (weights and inputs); weights are listed separately. Differences compare "
             "outputs on the CPU in float32, relative to max |diffusers|; VAE rows are compared "
             "with diffusers' untiled decode.", "",
             "| case | shape | ours | diffusers | repeats | ours ms | diffusers ms | ratio "
             "| our peak GiB | their peak GiB | ratio | max abs diff | max rel diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        o, t = r["ours_run"], r["diffusers_run"]
        shape = f"{r['video']} {'x'.join(map(str, r['latent'][1:]))}"
        ours_ms = o["error"] or fmt(o["median_ms"], ".0f")
        their_ms = t["error"] or fmt(t["median_ms"], ".0f")
        lines.append(
            f"| {r['case']} | {shape} | {r['ours']} | {r['diffusers']} | {r['repeats']} | "
            f"{ours_ms} | {their_ms} | "
            f"{fmt(r['time_ratio'], '.2f')} | {fmt(o['peak_allocated_bytes'], '.2f', GIB)} | "
            f"{fmt(t['peak_allocated_bytes'], '.2f', GIB)} | {fmt(r['peak_ratio'], '.2f')} | "
            f"{fmt(r['max_abs_diff'], '.3e')} | {fmt(r['max_rel_diff'], '.3e')} |")
    with_reference = [r for r in data["rows"] if "ours_vs_float32_rel" in r]
    if with_reference:
        lines += ["", "Distance of each bf16 output from the float32 computation of the same "
                  "network on the same weights and inputs (max |x - ref| / max |ref|):", "",
                  "| case | ours | diffusers | ours vs float32 | diffusers vs float32 |",
                  "|---|---|---|---|---|"]
        for r in with_reference:
            lines.append(f"| {r['case']} | {r['ours']} | {r['diffusers']} | "
                         f"{fmt(r['ours_vs_float32_rel'], '.3e')} | "
                         f"{fmt(r['diffusers_vs_float32_rel'], '.3e')} |")
    vae_rows = [r for r in data["rows"] if "time_vs_diffusers_untiled" in r]
    if vae_rows:
        lines += ["", "VAE rows against diffusers' untiled decode (the design target's yardstick), "
                  "with the planned grid (rows x cols of tiles, tile size in latent pixels) and "
                  "the peak estimated when planning it:", "",
                  "| case | ours | ms | time / diffusers untiled | peak GiB | grid "
                  "| estimated peak GiB |", "|---|---|---|---|---|---|---|"]
        for r in vae_rows:
            grid = r.get("grid")
            grid_text = f"{grid[0]}x{grid[1]} of {grid[2]}x{grid[3]}" if grid else ""
            lines.append(f"| {r['case']} | {r['ours']} | {fmt(r['ours_run']['median_ms'], '.0f')} "
                         f"| {fmt(r['time_vs_diffusers_untiled'], '.2f')} "
                         f"| {fmt(r['ours_run']['peak_allocated_bytes'], '.2f', GIB)} "
                         f"| {grid_text} | {fmt(r.get('estimated_peak_bytes'), '.2f', GIB)} |")
    lines += ["", "| case | ours weights GiB | diffusers weights GiB | ours peak reserved GiB "
              "| their peak reserved GiB |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['case']} ({r['ours']} / {r['diffusers']}) | "
                     f"{fmt(r['weights_bytes']['ours'], '.2f', GIB)} | "
                     f"{fmt(r['weights_bytes']['diffusers'], '.2f', GIB)} | "
                     f"{fmt(r['ours_run']['peak_reserved_bytes'], '.2f', GIB)} | "
                     f"{fmt(r['diffusers_run']['peak_reserved_bytes'], '.2f', GIB)} |")
    return "\n".join(lines) + "\n"


def load_earlier(path: Path, data: dict) -> dict:
    """The rows and commands of an earlier run into the same folder, when it measured on the same
    device, software and settings (otherwise they are not comparable and are not kept)."""
    empty = {"commands": [], "rows": []}
    if not path.exists():
        return empty
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{path}: not a readable peer benchmark result ({error}); move it away")
    same = ("diffusers", "torch", "device", "dtype", "quick")
    if any(earlier.get(k) != data[k] for k in same):
        print(f"{path}: measured on another setup; its rows are replaced", flush=True)
        return empty
    return {"commands": earlier.get("commands", []), "rows": earlier.get("rows", [])}


def save(data: dict, out: Path) -> str:
    order = list(CASES)
    data["rows"].sort(key=lambda r: order.index(r["case"]))  # stable: a case's rows keep theirs
    write_atomically(out / "peer_diffusers.json", json.dumps(data, indent=1).encode())
    text = markdown(data)
    write_atomically(out / "peer_diffusers.md", text.encode())
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for peer_diffusers.json / .md")
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true",
                        help="DiT cases: also compare both bf16 outputs with a float32 run")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and latents: a smoke test that runs on the CPU")
    args = parser.parse_args(argv)
    import diffusers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = {"diffusers": diffusers.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda"
            else platform.processor() or "cpu",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "dtype": str(run_dtype(device)).removeprefix("torch."), "quick": args.quick,
            "commands": [], "rows": []}
    earlier = load_earlier(out / "peer_diffusers.json", data)
    data["commands"] = earlier["commands"] + ["python " + " ".join(sys.argv)]
    data["rows"] = [r for r in earlier["rows"] if r["case"] not in args.case]
    text = ""
    for name in args.case:
        case = CASES[name]
        print(f"{name}:", flush=True)
        t0 = time.perf_counter()
        family = run_dit if isinstance(case, DiTCase) else run_vae
        data["rows"] += family(name, case, args, device)
        print(f"  {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        text = save(data, out)  # after every case, so a cut-off run keeps what it measured
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
