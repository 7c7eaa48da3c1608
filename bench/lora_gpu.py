"""LoRAs on the GPU: what an unmerged rank-64 LoRA adds to one DiT forward, that a LoRA at
strength 0 and a merged LoRA add nothing, and the host memory of merging at load.

Speed. For the case (default Wan2.2 TI2V-5B at 1280x704x121, latent [1,48,31,44,80], one
timestep per token as in the peer benchmark) seeded random real-size weights are drawn on the
GPU (bench/harness.py) and one forward is timed for each --config WEIGHTS:MODE (default bf16
eager and fp8_e4m3fn_fast compiled) with the model
  base           as loaded, no LoRA
  unmerged       a seeded random rank-64 LoRA (a file, every block matrix, generic names) at
                 strength 1 through the Wan LoRA Loader's path: pipeline/lora.with_lora, then
                 lora/apply.bring_to puts the low-rank wrappers in place (factors bf16, on the GPU)
  strength 0     the same LoRA at strength 0 (the loader returns the model as it came)
  merged         the LoRA merged into each block matrix in float32 before quantization
                 (lora/merge.py, the arithmetic of merging at load), then quantized as the base
Reported per row: median ms, its ratio to the base row (targets: unmerged <= 1.05; strength 0 and
merged 1.00, to timing noise), the weights' and factors' GiB, and the output's max relative
difference to the merged row (the two modes agree to rounding; fp8: to fp8 rounding).

Host memory. A seeded random bf16 checkpoint of the memory model (default TI2V-5B, ComfyUI
layout) and a rank-64 LoRA file are written into --cache (reused when present), then each of
these steps runs in a fresh process, RssAnon (anonymous memory) sampled every 5 ms:
  load           pipeline/loading.load_model, bf16 (what the model loader does)
  merge at load  checkpoints/loader.load_dit with the LoRA merged while loading
  merge after    load_model first (not measured), then the LoRA loader's merge (with_lora +
                 bring_to: the changed weights read again from the file, merged and copied
                 into the model's own tensors)
A bf16 model loaded from a bf16 file keeps its weights in the file's mapping (page cache, not
RssAnon); merged weights are the process's own memory. So each step reports RssAnon before,
at its peak and after (the model alive), and its transient: the peak over the larger of before
and after, what the step holds only while it runs. Target: merging holds at most one float32
matrix in transit (the largest block matrix's float32 bytes are reported beside) more than
loading alone.

    python bench/lora_gpu.py --out DIR [--case dit_5b] [--config bf16:eager ...] [--rank 64]
                             [--repeats 3] [--memory-model wan2.2-ti2v-5b] [--cache DIR]
                             [--skip-speed] [--skip-memory] [--quick]

--quick: tiny model, latent and checkpoint, on the CPU when there is no GPU (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer
from wan_enhanced.bench.quant_load_memory import PeakSampler, machine, proc_status

GIB = peer.GIB
CONFIGS = ("bf16:eager", "fp8_e4m3fn_fast:compiled")
DTYPE = torch.bfloat16
MEMORY_MODEL = "wan2.2-ti2v-5b"
TARGET_OVERHEAD = 1.05


# -- the LoRA ----------------------------------------------------------------------------------

def write_random_lora(path: Path, config, rank: int, seed: int) -> Path:
    from wan_enhanced.lora.tiny import random_lora, write_lora

    return write_lora(path, random_lora(config, seed, rank=rank, alpha=float(rank)), "generic",
                      dtype=DTYPE)


def handle_for(model, config):
    """A model handle around weights that were drawn, not loaded (no file behind them: only
    the unmerged mode of a LoRA of block matrices, which reads no weights, is used on it)."""
    from wan_enhanced.checkpoints.loader import CheckpointInfo
    from wan_enhanced.pipeline.handles import WanModelHandle

    info = CheckpointInfo(Path("random-weights.safetensors"), "dit", "random", config,
                          config.name)
    return WanModelHandle(model, info, "sdpa")


def merged_state(state: dict, lora_path: Path, config) -> dict:
    """`state` with the LoRA merged into each block matrix in float32 (then back to bf16)."""
    from wan_enhanced.lora.file import open_lora
    from wan_enhanced.lora.keymap import dit_shapes
    from wan_enhanced.lora.merge import add_patch_

    out = dict(state)
    with open_lora(lora_path, dit_shapes(config)) as lora:
        for key, patch in lora.patches.items():
            weight = state[key].to(torch.float32, copy=True)
            add_patch_(weight, lora, patch, 1.0)
            out[key] = weight.to(state[key].dtype)
            del weight
    return out


def build(config, state, weights: str):
    from wan_enhanced.quant import quantize_block_linears

    model = peer.ours_dit(config, state, DTYPE)
    return model if weights == "bf16" else quantize_block_linears(model, weights)


# -- speed -------------------------------------------------------------------------------------

def run_speed(args, device: torch.device, lora_path: Path) -> list[dict]:
    from wan_enhanced.lora.apply import bring_to
    from wan_enhanced.lora.layers import wrappers
    from wan_enhanced.pipeline.lora import with_lora

    config, latent, state, noise, context, timestep = peer.dit_setup(
        args.case, args.quick, args.seed, device, DTYPE).parts()
    write_random_lora(lora_path, config, args.rank, args.seed + 2)

    rows = []
    for spec in args.config:
        weights, mode = spec.split(":")
        compiled = mode == "compiled"
        if compiled:
            torch._dynamo.reset()

        def timed(model, label):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out, run = peer.timed(lambda: model(noise, timestep, context, attention="sdpa",
                                                    compiled=compiled),
                                      args.repeats, device, lambda o: o.float().cpu())
            notes = sorted({str(c.message) for c in caught
                            if issubclass(c.category, RuntimeWarning)})
            factor_bytes = sum(t.nbytes for wr in wrappers(model).values()
                               for _, ts in wr.terms() for t in ts)
            print(f"  {spec} {label}: {run.median_ms} ms" + (f" ({notes})" if notes else ""),
                  flush=True)
            return out, {"config": spec, "weights": weights, "mode": mode, "row": label,
                         "run": run.to_dict(), "weight_bytes": peer.device_bytes(model)
                         - factor_bytes, "factor_bytes": factor_bytes, "warnings": notes}

        base = handle_for(build(config, state, weights), config)
        outputs, found = {}, []
        for label, strength in (("base", None), ("unmerged", 1.0), ("strength 0", 0.0)):
            handle = base if strength is None else with_lora(base, lora_path, strength,
                                                             "unmerged")
            bring_to(handle.model, handle.info.path, handle.quantization, handle.loras)
            outputs[label], row = timed(handle.model, label)
            found.append(row)
        del base, handle
        peer.free_memory()
        merged = build(config, merged_state(state, lora_path, config), weights)
        outputs["merged"], row = timed(merged, "merged")
        found.append(row)
        del merged
        peer.free_memory()
        base_ms = found[0]["run"]["median_ms"]
        for row in found:
            row["ratio_to_base"] = peer.ratio(row["run"]["median_ms"], base_ms)
            row["max_rel_diff_to_merged"] = peer.difference(outputs[row["row"]],
                                                            outputs["merged"])[1]
        rows += found
    return rows


# -- host memory ---------------------------------------------------------------------------------

def memory_config(quick: bool, name: str = MEMORY_MODEL):
    from wan_enhanced.checkpoints.tiny import TINY_DIT
    from wan_enhanced.wan.configs import KNOWN_DITS

    return TINY_DIT["t2v"] if quick else KNOWN_DITS[name].config


def child_generate(path: Path, lora: Path, model: str, quick: bool, rank: int,
                   seed: int) -> None:
    from wan_enhanced.checkpoints.tiny import randomize, write_dit
    from wan_enhanced.wan.dit import WanDiT

    config = memory_config(quick, model)
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = randomize(skeleton, seed, dtype=DTYPE)
    write_dit(path, config, layout="comfy", dtype=DTYPE, state=state)
    del state
    write_random_lora(lora, config, rank, seed + 2)


def child_memory(kind: str, path: Path, lora: Path) -> dict:
    """One measured step in this fresh process: its peak RssAnon over the level before it."""
    from wan_enhanced.checkpoints.loader import load_dit
    from wan_enhanced.lora.apply import bring_to
    from wan_enhanced.lora.file import open_lora
    from wan_enhanced.lora.keymap import dit_shapes
    from wan_enhanced.lora.merge import Merge
    from wan_enhanced.pipeline import loading
    from wan_enhanced.pipeline.lora import with_lora

    kept = []
    if kind == "merge after":
        kept.append(loading.load_model(path, "bf16", "sdpa"))
    shapes = dit_shapes(memory_config_of(path))
    before = proc_status()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        if kind == "load":
            kept.append(loading.load_model(path, "bf16", "sdpa"))
        elif kind == "merge at load":
            with open_lora(lora, shapes) as opened:
                kept.append(load_dit(path, DTYPE, merge=Merge.of([(opened, 1.0)])))
        else:
            handle = with_lora(kept[0], lora, 1.0, "merge")
            bring_to(handle.model, handle.info.path, None, handle.loras)
        seconds = time.perf_counter() - start
    after = proc_status()
    return {"kind": kind, "seconds": seconds, "rss_anon_before": before["RssAnon"],
            "rss_anon_peak": sampler.peak_anon, "rss_anon_after": after["RssAnon"],
            "transient_bytes": sampler.peak_anon - max(before["RssAnon"], after["RssAnon"]),
            "samples": sampler.samples}


def memory_config_of(path: Path):
    from wan_enhanced.checkpoints.loader import inspect_checkpoint

    return inspect_checkpoint(path).config


def largest_matrix_float32(config) -> int:
    from wan_enhanced.lora.keymap import dit_shapes
    from wan_enhanced.wan.dit import is_block_linear

    return max(4 * shape[0] * shape[1] for key, shape in dit_shapes(config).items()
               if is_block_linear(key) and key.endswith(".weight"))


def run_memory(args, cache: Path) -> dict:
    config = memory_config(args.quick, args.memory_model)
    name = "tiny_t2v" if args.quick else args.memory_model.replace(".", "_").replace("-", "_")
    checkpoint = cache / f"{name}_random_bf16_seed{args.seed}.safetensors"
    lora = cache / f"{name}_lora_rank{args.rank}_seed{args.seed}.safetensors"
    script = str(Path(__file__).resolve())
    if not (checkpoint.is_file() and lora.is_file()):
        print(f"writing {checkpoint} and {lora.name}", flush=True)
        subprocess.run([sys.executable, script, "child-generate", str(checkpoint), str(lora),
                        args.memory_model, str(args.rank), str(args.seed)]
                       + (["--quick"] if args.quick else []), check=True)
    runs = []
    for kind in ("load", "merge at load", "merge after"):
        result = cache / ".lora_memory_result.json"
        subprocess.run([sys.executable, script, "child-memory", kind, str(checkpoint), str(lora),
                        str(result)], check=True)
        runs.append(json.loads(result.read_text()))
        result.unlink()
        print(f"  {kind}: transient {runs[-1]['transient_bytes'] / GIB:.3f} GiB, "
              f"{runs[-1]['seconds']:.1f} s", flush=True)
    load = runs[0]["transient_bytes"]
    return {"model": config.name, "checkpoint_bytes": checkpoint.stat().st_size,
            "lora_bytes": lora.stat().st_size,
            "largest_matrix_float32_bytes": largest_matrix_float32(config), "runs": runs,
            "merge_at_load_over_load_bytes": runs[1]["transient_bytes"] - load,
            "merge_after_over_load_bytes": runs[2]["transient_bytes"] - load}


# -- results -----------------------------------------------------------------------------------

def markdown(data: dict) -> str:
    f = peer.fmt
    lines = ["# LoRA: unmerged overhead, strength 0, merged fp8, merge memory", "",
             f"device: {data['device']}; torch {data['torch']}; date {data['date']}; rank "
             f"{data['rank']}; median of {data['repeats']} timed forwards after a warm-up", "",
             "Command:", "", f"    {data['command']}", ""]
    if data["rows"]:
        lines += [f"## One DiT forward, {data['case']} ({data['video']})", "",
                  "Ratio: to the base row of the same configuration (target unmerged <= "
                  f"{TARGET_OVERHEAD}). Difference: max |out - merged out| / max |merged out|.",
                  "", "| weights | mode | model | ms | / base | weights GiB | LoRA factors GiB "
                  "| max rel diff to merged | note |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in data["rows"]:
            run = r["run"]
            lines.append(
                f"| {r['weights']} | {r['mode']} | {r['row']} | "
                f"{run['error'] or f(run['median_ms'], '.0f')} | {f(r['ratio_to_base'], '.3f')} "
                f"| {f(r['weight_bytes'], '.2f', GIB)} | {f(r['factor_bytes'], '.3f', GIB)} | "
                f"{f(r['max_rel_diff_to_merged'], '.2e')} | {'; '.join(r['warnings'])} |")
    memory = data.get("memory")
    if memory:
        lines += ["", f"## Host memory of merging, {memory['model']} bf16 "
                  f"({memory['checkpoint_bytes'] / GIB:.2f} GiB checkpoint, LoRA "
                  f"{memory['lora_bytes'] / GIB:.3f} GiB)", "",
                  "RssAnon of each step, in a fresh process; transient: its peak over the larger "
                  "of before and after (the model alive). The largest block matrix in float32: "
                  f"{memory['largest_matrix_float32_bytes'] / GIB:.3f} GiB.", "",
                  "| step | RssAnon before GiB | peak GiB | after GiB | transient GiB | seconds |",
                  "|---|---:|---:|---:|---:|---:|"]
        for run in memory["runs"]:
            lines.append(f"| {run['kind']} | {run['rss_anon_before'] / GIB:.3f} | "
                         f"{run['rss_anon_peak'] / GIB:.3f} | {run['rss_anon_after'] / GIB:.3f} "
                         f"| {run['transient_bytes'] / GIB:.3f} | {run['seconds']:.1f} |")
        lines += ["", f"Transient over loading alone: merge at load "
                  f"{memory['merge_at_load_over_load_bytes'] / GIB:.3f} GiB, merge after the "
                  f"load {memory['merge_after_over_load_bytes'] / GIB:.3f} GiB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for lora_gpu.json / .md")
    parser.add_argument("--case", choices=("dit_5b", "dit_1_3b", "dit_14b"), default="dit_5b")
    parser.add_argument("--config", nargs="+", default=list(CONFIGS),
                        help="WEIGHTS:MODE, WEIGHTS bf16 or a quantization, MODE eager/compiled")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-model", default=MEMORY_MODEL,
                        help="the released size whose checkpoint the memory steps load")
    parser.add_argument("--cache", help="folder keeping the memory checkpoint between runs "
                                        "(default: a temporary folder)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, latent and checkpoint: a smoke test on the CPU")
    args = parser.parse_args(argv)
    for spec in args.config:
        weights, _, mode = spec.partition(":")
        if mode not in ("eager", "compiled") or weights not in ("bf16", "fp8_e4m3fn",
                                                                "fp8_e4m3fn_fast", "int8",
                                                                "int8_dynamic"):
            parser.error(f"--config {spec}: expected WEIGHTS:eager or WEIGHTS:compiled")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    case = peer.CASES[args.case]
    data = {"torch": torch.__version__, "device": peer.device_name(device),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "rank": args.rank,
            "repeats": args.repeats, "quick": args.quick, "case": case.model,
            "video": case.video, "machine": machine(), "rows": [], "memory": None,
            "command": "python " + " ".join(sys.argv if argv is None
                                            else ["bench/lora_gpu.py", *argv])}
    with tempfile.TemporaryDirectory(prefix="lora_gpu_") as temporary:
        cache = Path(args.cache or temporary)
        cache.mkdir(parents=True, exist_ok=True)
        if not args.skip_speed:
            print(f"{args.case}:", flush=True)
            data["rows"] = run_speed(args, device, cache / "speed_lora.safetensors")
            peer.save_result(out, "lora_gpu", data, markdown(data))
        if not args.skip_memory:
            print("host memory of merging:", flush=True)
            data["memory"] = run_memory(args, cache)
    peer.save_result(out, "lora_gpu", data, markdown(data))
    print(markdown(data))
    return 1 if any(r["run"]["error"] for r in data["rows"]) else 0


def child_main(argv: list[str]) -> int:
    if argv[0] == "child-generate":
        _, path, lora, model, rank, seed, *rest = argv
        child_generate(Path(path), Path(lora), model, "--quick" in rest, int(rank), int(seed))
        return 0
    _, kind, path, lora, result = argv
    Path(result).write_text(json.dumps(child_memory(kind, Path(path), Path(lora))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("child-generate", "child-memory"):
        sys.exit(child_main(sys.argv[1:]))
    sys.exit(main())
