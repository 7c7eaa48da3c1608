"""Our DiT forward against ComfyUI's own Wan model, in one process, on the same weights and inputs.

    python bench/peer_comfy.py --comfyui PATH --out DIR [--case dit_5b dit_1_3b dit_14b]
                               [--mode bf16_eager ...] [--repeats 3] [--profile] [--quick]

PATH is a ComfyUI checkout (its `comfy` package is imported from there; nothing of it is kept
here). For every case one set of seeded random bf16 weights is drawn on the GPU and given to
both models: ours (WanDiT) and ComfyUI's `comfy.ldm.wan.model.WanModel`, built with the
operations ComfyUI itself picks:
  bf16_eager / bf16_compiled   bf16 weights (comfy.ops.disable_weight_init; SDPA with ComfyUI's
                               own cuDNN-first priority). Ours: attention "auto" (our exact
                               bf16_hopper kernel on Hopper, cuDNN SDPA elsewhere).
  fp8_compiled                 ComfyUI: comfy.ops.fp8_ops with the weights cast to fp8, as its
                               UNET loader's `fp8_e4m3fn_fast` loads a bf16 file (activations
                               clamped to +-448 and cast, per-tensor scales of 1). Ours:
                               fp8_e4m3fn_fast (per-channel weight scales, per-token activations),
                               exact attention: bf16_hopper (cuDNN SDPA off Hopper).
  fp8_fp8attn_compiled         ours only: fp8_e4m3fn_fast with our fp8 attention; its ratio is
                               against ComfyUI's fp8_compiled.
  fp8_eager, fp8_fp8attn_eager the same two without torch.compile (what ComfyUI runs unless a
                               workflow compiles the model).
"compiled": each transformer block through torch.compile (one compiled block function shared
by all blocks on both sides). Inputs: bf16 noise, 512 rows of bf16 text context, t = 500 (one
timestep per sample, as ComfyUI gives a text-to-video model). Both models of a weight format are
on the GPU together; per mode each side is warmed up, then the two are timed in turns (ours,
ComfyUI's, ours, ...) `--repeats` times each with CUDA events (median), so that the GPU's drift
over a run weighs on both alike; peak activation memory = max allocated during a side's timed
calls minus what was allocated at their start.

Accuracy: a float32 forward of the same weights (our model in float32; for dit_14b with TF32
matmuls, which are some hundred times finer than bf16 and keep it to minutes) is the reference;
each side's output is compared with it: max |out - ref| / max |ref| and ||out - ref|| / ||ref||.

--profile: a kernel table of one forward per side and mode (torch.profiler), per block, and where
the GPU stood idle in another (bench/gpu_timeline.py: the longest gaps and what caused them).
--quick: tiny models on the CPU (or GPU) to check the script; times mean nothing there.
Rows go to DIR/peer_comfy.json and DIR/peer_comfy.md after every case; a later run into the same
folder replaces the rows of the cases and modes it runs and keeps the others.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from wan_enhanced.bench import gpu_timeline as timeline
from wan_enhanced.bench import harness as peer

from wan_enhanced.atomic_files import write_atomically
from wan_enhanced.gpu_support import triton_version
from wan_enhanced.profiling.kernels import profiled as kernels_of
from wan_enhanced.quant import quantize_block_linears
from wan_enhanced.wan.dit import WanDiT

MODES = ("bf16_eager", "bf16_compiled", "fp8_eager", "fp8_fp8attn_eager", "fp8_compiled",
         "fp8_fp8attn_compiled")
CASES = ("dit_5b", "dit_1_3b", "dit_14b")
OURS = {  # mode -> (weights, attention, compiled)
    "bf16_eager": ("bf16", "auto", False),
    "bf16_compiled": ("bf16", "auto", True),
    "fp8_eager": ("fp8_e4m3fn_fast", "bf16_hopper", False),
    "fp8_fp8attn_eager": ("fp8_e4m3fn_fast", "fp8_triton", False),
    "fp8_compiled": ("fp8_e4m3fn_fast", "bf16_hopper", True),
    "fp8_fp8attn_compiled": ("fp8_e4m3fn_fast", "fp8_triton", True),
}
THEIRS = {  # mode -> (weights, compiled)
    "bf16_eager": ("bf16", False),
    "bf16_compiled": ("bf16", True),
    "fp8_eager": ("fp8", False),
    "fp8_compiled": ("fp8", True),
}
COMPARED_WITH = {"fp8_fp8attn_eager": "fp8_eager", "fp8_fp8attn_compiled": "fp8_compiled"}


class ComfyCheckoutError(RuntimeError):
    pass


# -- ComfyUI -----------------------------------------------------------------------------------

def import_comfy(path: Path, cpu: bool):
    """ComfyUI's Wan model module and ops from the checkout at `path`, checked before any
    timing: a missing or too old checkout is refused with what was expected."""
    path = path.resolve()
    model_file = path / "comfy" / "ldm" / "wan" / "model.py"
    if not model_file.is_file():
        raise ComfyCheckoutError(f"--comfyui {path}: not a ComfyUI checkout (no "
                                 f"comfy/ldm/wan/model.py)")
    sys.path.insert(0, str(path))
    from comfy.cli_args import args as comfy_args
    comfy_args.cpu = cpu
    import comfy.ldm.wan.model as wan_model
    import comfy.ops as ops
    missing = [name for name, holder in (("WanModel", wan_model), ("fp8_ops", ops),
                                         ("disable_weight_init", ops))
               if not hasattr(holder, name)]
    if missing or not hasattr(wan_model.WanModel, "rope_encode"):
        raise ComfyCheckoutError(f"--comfyui {path}: this ComfyUI is too old for the peer "
                                 f"benchmark (missing {missing or ['WanModel.rope_encode']}); "
                                 f"use one from 2025-08 or later")
    return wan_model, ops


def comfy_dit(wan_model, ops, config, state: dict[str, torch.Tensor], weights: str):
    """ComfyUI's WanModel on the tensors of `state` (same key names as ours). fp8: every weight
    stored in fp8 but the patch embedding (float32 in ComfyUI), fp8_ops' layers."""
    dtype = torch.float8_e4m3fn if weights == "fp8" else torch.bfloat16
    operations = ops.fp8_ops if weights == "fp8" else ops.disable_weight_init
    model = wan_model.WanModel(
        model_type="i2v" if config.image_embedding else "t2v", patch_size=config.patch_size,
        text_len=config.text_len, in_dim=config.in_dim, dim=config.dim, ffn_dim=config.ffn_dim,
        freq_dim=config.freq_dim, text_dim=config.text_dim, out_dim=config.out_dim,
        num_heads=config.num_heads, num_layers=config.num_layers, qk_norm=config.qk_norm,
        cross_attn_norm=config.cross_attn_norm, eps=config.eps, device="meta", dtype=dtype,
        operations=operations)
    params = dict(model.state_dict())
    loaded = {k: v.to(params[k].dtype) for k, v in state.items()}
    model.load_state_dict(loaded, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def set_comfy_compiled(model, compiled: bool) -> None:
    """Each block's forward through one shared torch.compile'd function (as ours), or the
    blocks' own forward again."""
    if compiled:
        function = torch.compile(type(model.blocks[0]).forward, dynamic=False)
        for block in model.blocks:
            block.forward = functools.partial(function, block)
    else:
        for block in model.blocks:
            block.__dict__.pop("forward", None)


# -- ours --------------------------------------------------------------------------------------

def ours_model(config, state, weights: str) -> WanDiT:
    model = peer.ours_dit(config, state, torch.bfloat16)
    return model if weights == "bf16" else quantize_block_linears(model, weights)


# -- profiling ---------------------------------------------------------------------------------

KERNEL_KINDS = (("attention", ("fmha", "flash", "attention_kernel", "attn", "cudnn")),
                ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "scaled_mm", "sm90")),)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def kernel_table(fn, layers: int, top: int = 14) -> str:
    with torch.inference_mode():
        _, rows = kernels_of(fn, "cuda")
    kinds = defaultdict(float)
    for r in rows:
        kinds[kernel_kind(r.name)] += r.ms
    total = sum(kinds.values())
    lines = [f"forward kernel time {total:.1f} ms; per block: " + ", ".join(
        f"{k} {v / layers:.2f} ms" for k, v in sorted(kinds.items()))]
    lines.append("| ms per block | calls per block | kind | kernel |\n|---:|---:|---|---|")
    for r in rows[:top]:
        lines.append(f"| {r.ms / layers:.3f} | {r.calls / layers:.1f} | "
                     f"{kernel_kind(r.name)} | `{r.name[:100]}` |")
    return "\n".join(lines)


def idle_table(fn) -> str:
    """Where the GPU stood idle during one call of fn (bench/gpu_timeline.py), from a profile of
    host and device activity (its own call: recording host operations slows the host a little)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    marker = "peer_comfy_call"
    with torch.inference_mode(), profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(marker):
            fn()
        torch.cuda.synchronize()
    return timeline.describe(timeline.idle_of_profile(prof, marker))


def profiled(fn, layers: int) -> str:
    return kernel_table(fn, layers) + "\n\n" + idle_table(fn)


# -- one case ----------------------------------------------------------------------------------

def run_case(name: str, args, device, comfy) -> tuple[list[dict], str]:
    """Every mode of case `name`: ours and ComfyUI's forward (COMPARED_WITH's mode for our fp8
    attention) timed in turns, with both models of a weight format on the GPU at once (they
    share the bf16 tensors of `state`)."""
    case = peer.CASES[name]
    config, latent, state, noise, context, timestep = peer.dit_setup(
        name, args.quick, args.seed, device, torch.bfloat16, per_token_timestep=False).parts()
    print(f"{name}: latent {latent}", flush=True)
    reference = peer.float32_forward(config, state, noise, timestep, context,
                                     tf32=name == "dit_14b" and not args.quick)
    cpu = functools.partial(lambda t: t.float().cpu())
    results, profiles = {}, [f"## {name}"]
    modes = [m for m in MODES if m in args.mode]
    wan_model, ops = comfy

    for ours_weights, their_weights in (("bf16", "bf16"), ("fp8_e4m3fn_fast", "fp8")):
        wanted = [m for m in modes if OURS[m][0] == ours_weights]
        if not wanted:
            continue
        ours = ours_model(config, state, ours_weights)
        theirs = comfy_dit(wan_model, ops, config, state, their_weights)
        for mode in wanted:
            _, attention, compiled = OURS[mode]
            their_mode = COMPARED_WITH.get(mode, mode)
            set_comfy_compiled(theirs, THEIRS[their_mode][1])

            def ours_fn(model=ours, attention=attention, compiled=compiled):
                return model(noise, timestep, context, attention=attention, compiled=compiled)

            def theirs_fn(model=theirs):
                return model(noise, timestep, context)
            timed = peer.timed_in_turns({"ours": ours_fn, "comfy": theirs_fn}, args.repeats,
                                        device, cpu)
            for side, (out, run) in timed.items():
                results[(side, mode)] = (run, peer.distance(out, reference))
            print(f"  {mode}: ours {timed['ours'][1].median_ms} ms, ComfyUI {their_mode} "
                  f"{timed['comfy'][1].median_ms} ms", flush=True)
            if args.profile and device.type == "cuda":
                profiles.append(f"### ours {mode}\n" + profiled(ours_fn, config.num_layers))
                if mode == their_mode:
                    profiles.append(f"### ComfyUI {mode}\n"
                                    + profiled(theirs_fn, config.num_layers))
        del ours, theirs
        torch._dynamo.reset()
        peer.free_memory()
    del state
    peer.free_memory()
    return rows_of(name, case, modes, results), "\n\n".join(profiles)


def rows_of(name, case, modes, results) -> list[dict]:
    rows = []
    for mode in modes:
        ours_run, ours_dist = results[("ours", mode)]
        theirs_mode = COMPARED_WITH.get(mode, mode)
        theirs_run, theirs_dist = results.get(("comfy", mode), (None, None))
        ours_ms = ours_run.median_ms
        comfy_ms = theirs_run.median_ms if theirs_run else None
        rows.append({
            "case": name, "video": case.video, "mode": mode, "comfy_mode": theirs_mode,
            "ours_ms": ours_ms, "comfy_ms": comfy_ms,
            "ratio": ours_ms / comfy_ms if ours_ms and comfy_ms else None,
            "ours_vs_fp32": ours_dist, "comfy_vs_fp32": theirs_dist,
            "ours_peak_activation_gib": peer.gib(ours_run.peak_allocated),
            "comfy_peak_activation_gib": (peer.gib(theirs_run.peak_allocated) if theirs_run
                                          else None),
            "ours_error": ours_run.error, "comfy_error": theirs_run.error if theirs_run else None,
            "repeats": len(ours_run.times_ms)})
    return rows


# -- output ------------------------------------------------------------------------------------

def markdown(data: dict) -> str:
    def f(value, spec):
        return peer.fmt(value, spec, missing="—")

    repeats = {}
    for r in data["rows"]:
        repeats.setdefault(r["case"], r.get("repeats", data["meta"]["repeats"]))
    triton = data["meta"].get("triton")  # results saved before it was recorded lack it
    lines = [f"Device: {data['meta']['device']}, torch {data['meta']['torch']}"
             + (f", Triton {triton}" if triton else "") + ", ComfyUI "
             f"{data['meta']['comfyui']}; one DiT forward, ours and ComfyUI's timed in turns, "
             f"median of " + ", ".join(f"{n} ({case})" for case, n in repeats.items()) + ".",
             "", "| case | mode | ours ms | ComfyUI ms | ours / ComfyUI | ours vs fp32 (max rel / "
             "rel L2) | ComfyUI vs fp32 (max rel / rel L2) | peak act. GiB ours / ComfyUI |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for r in data["rows"]:
        o, c = r["ours_vs_fp32"], r["comfy_vs_fp32"] or {}
        mode = r["mode"] + (f" (vs ComfyUI {r['comfy_mode']})" if r["comfy_mode"] != r["mode"]
                            else "")
        lines.append(
            f"| {r['case']} {r['video']} | {mode} | {f(r['ours_ms'], '.0f')} | "
            f"{f(r['comfy_ms'], '.0f')} | **{f(r['ratio'], '.3f')}** | "
            f"{f(o['max_rel'], '.4f')} / {f(o['rel_l2'], '.4f')} | "
            f"{f(c.get('max_rel'), '.4f')} / {f(c.get('rel_l2'), '.4f')} | "
            f"{f(r['ours_peak_activation_gib'], '.2f')} / "
            f"{f(r['comfy_peak_activation_gib'], '.2f')} |")
    return "\n".join(lines) + "\n"


def save(out_dir: Path, rows: list[dict], meta: dict, profiles: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "peer_comfy.json"
    old = json.loads(path.read_text()) if path.is_file() else {"rows": [], "commands": []}
    done = {(r["case"], r["mode"]) for r in rows}
    kept = [r for r in old["rows"] if (r["case"], r["mode"]) not in done]
    order = {c: i for i, c in enumerate(CASES)}
    all_rows = sorted(kept + rows, key=lambda r: (order.get(r["case"], 9),
                                                  MODES.index(r["mode"])))
    commands = old.get("commands", [])
    if commands[-1:] != [meta["command"]]:  # one run saves once per case
        commands = commands + [meta["command"]]
    data = {"meta": meta, "commands": commands, "rows": all_rows}
    write_atomically(path, json.dumps(data, indent=1).encode())
    write_atomically(out_dir / "peer_comfy.md", markdown(data).encode())
    for case, text in profiles.items():
        write_atomically(out_dir / f"profile_{case}.md", text.encode())


def start_peer(tool: str, args: argparse.Namespace, importer) -> tuple | None:
    """What a peer bench's main needs before any timing: the device, the ComfyUI modules
    importer(args.comfyui, cpu=...) gives and the run's metadata (date, device, versions,
    command). None, the reason printed under `tool`'s name, without a CUDA device (unless
    --quick) or for a folder that is no usable ComfyUI checkout."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        print(f"{tool}: no CUDA device; use --quick for a CPU smoke run", file=sys.stderr)
        return None
    try:
        comfy = importer(args.comfyui, cpu=device.type == "cpu")
    except ComfyCheckoutError as error:
        print(f"{tool}: {error}", file=sys.stderr)
        return None
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": (torch.cuda.get_device_name() if device.type == "cuda"
                       else platform.processor()),
            "torch": torch.__version__, "triton": triton_version(),
            "comfyui": peer.comfy_version(args.comfyui.resolve()),
            "repeats": args.repeats, "command": " ".join(sys.argv), "quick": args.quick}
    return device, comfy, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI checkout")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = start_peer("peer_comfy", args, import_comfy)
    if started is None:
        return 2
    device, comfy, meta = started
    failed = False
    for name in args.case:
        rows, profile = run_case(name, args, device, comfy)
        failed |= any(r["ours_error"] or r["comfy_error"] for r in rows)
        save(args.out, rows, meta, {name: profile} if args.profile else {})
        gc.collect()
    print(markdown(json.loads((args.out / "peer_comfy.json").read_text())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
