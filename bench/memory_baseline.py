"""GPU memory baseline: the Wan2.1 T2V 1.3B 480p workflow, run several times in one process.

Real-size random-weight checkpoints (the 1.3B DiT in ComfyUI's layout, the Wan2.1 VAE, umT5-xxl
in ComfyUI's layout) are written once into a models folder and reused. Each run goes through the
in-process runner with the same node classes ComfyUI uses. After every run the script records
the CUDA memory still allocated (it must equal the baseline before the first run: no node may
leave a GPU tensor behind), the run's peak, process RSS and the time.

    python bench/memory_baseline.py --models /tmp/wan-models --out results/ [--steps 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil
import torch

from wan_enhanced import NODE_CLASS_MAPPINGS, host
from wan_enhanced.checkpoints.tiny import randomize, write_dit, write_text_encoder, write_vae
from wan_enhanced.profiling.events import current_log, start_run
from wan_enhanced.runner.executor import run_workflow
from wan_enhanced.runner.overrides import apply_overrides
from wan_enhanced.runner.workflow import load_workflow
from wan_enhanced.wan.configs import KNOWN_DITS
from wan_enhanced.wan.dit import WanDiT
from wan_enhanced.wan.t5 import UMT5Encoder
from wan_enhanced.wan.tiny_tokenizer import build_spiece_model
from wan_enhanced.wan.vae21 import WanVAE21

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "api_workflows" / "wan21_t2v_1_3b_memory_baseline.json"
GIB = 2 ** 30


def build_models(root: Path) -> None:
    """Real-size random checkpoints under the names the workflow uses (kept between runs)."""
    draw = "cuda" if torch.cuda.is_available() else "cpu"
    dit = root / "diffusion_models" / "wan2.1_t2v_1.3B_fp16.safetensors"
    if not dit.exists():
        config = KNOWN_DITS["wan2.1-t2v-1.3b"].config
        with torch.device("meta"):
            module = WanDiT(config)
        state = randomize(module, 1, draw, torch.bfloat16)
        dit.parent.mkdir(parents=True, exist_ok=True)
        write_dit(dit, config, "comfy", state=state, dtype=torch.bfloat16)
        del state
    vae = root / "vae" / "wan_2.1_vae.safetensors"
    if not vae.exists():
        with torch.device("meta"):
            module = WanVAE21()
        state = randomize(module, 2, draw)
        vae.parent.mkdir(parents=True, exist_ok=True)
        write_vae(vae, "vae21", state=state)
    te = root / "text_encoders" / "umt5_xxl_fp16.safetensors"
    if not te.exists():
        te.parent.mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):
            module = UMT5Encoder()
        write_text_encoder(te, "hf", config=None, dtype=torch.bfloat16,
                           spiece_model=build_spiece_model(),
                           state=randomize(module, 3, draw, torch.bfloat16))
    gc.collect()


def measure(args) -> dict:
    host.set_headless_folders(models=args.models, output=args.out)
    workflow = load_workflow(WORKFLOW, NODE_CLASS_MAPPINGS)
    workflow = apply_overrides(workflow, [f"6.steps={args.steps}", f"5.frames={args.frames}"],
                               NODE_CLASS_MAPPINGS)
    cuda = torch.cuda.is_available()
    if cuda:
        # The CUDA context and the cuBLAS / cuBLASLt workspaces (allocated on first use through
        # the caching allocator and kept for the life of the process: 32 MiB + 1 MiB on an
        # H100) exist before the baseline is read; a linear with bias takes the cuBLASLt path.
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.ones(64, 64, device="cuda", dtype=dtype)
            torch.nn.functional.linear(a, a, a[0]).sum().item()
            (a @ a).sum().item()
            del a
        torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    runs = []
    for index in range(args.runs):
        start_run()
        start = time.perf_counter()
        result = run_workflow(workflow, NODE_CLASS_MAPPINGS)
        seconds = time.perf_counter() - start
        del result.outputs
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
        events = current_log().events
        step_events = [e for e in events if e["label"].startswith("step ")]
        runs.append({
            "run": index + 1,
            "seconds": round(seconds, 2),
            "allocated_after_bytes": torch.cuda.memory_allocated() if cuda else None,
            "reserved_after_bytes": torch.cuda.memory_reserved() if cuda else None,
            "peak_allocated_bytes": result.peak.allocated,
            "peak_reserved_bytes": result.peak.reserved,
            "rss_after_bytes": psutil.Process().memory_info().rss,
            "seconds_per_step": round(
                (step_events[-1]["time"] - step_events[0]["time"]) / max(1, len(step_events) - 1),
                3) if len(step_events) > 1 else None,
            "stage_peaks_allocated": _stage_peaks(events),
        })
        current_log().save(Path(args.out) / f"memory_events_run{index + 1}.json")
    return {"baseline_allocated_bytes": baseline, "runs": runs}


def _stage_peaks(events) -> dict:
    peaks: dict[str, int] = {}
    for e in events:
        value = e.get("peak_allocated_bytes")
        if value is not None:
            peaks[e["stage"]] = max(peaks.get(e["stage"], 0), value)
    return peaks


def report(data: dict, args) -> str:
    lines = [f"# Memory baseline: Wan2.1 T2V 1.3B, 832x480x{args.frames}, {args.steps} steps",
             "", f"device: {data['device']}; torch {torch.__version__}; date {data['date']}",
             f"command: `{data['command']}`", "",
             f"baseline allocated before run 1: {data['baseline_allocated_bytes']} bytes", "",
             "| run | time s | s/step | allocated after (bytes) | = baseline | peak allocated GiB "
             "| peak reserved GiB | RSS after GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        same = r["allocated_after_bytes"] == data["baseline_allocated_bytes"]
        lines.append(f"| {r['run']} | {r['seconds']} | {r['seconds_per_step']} | "
                     f"{r['allocated_after_bytes']} | {'yes' if same else 'NO'} | "
                     f"{(r['peak_allocated_bytes'] or 0) / GIB:.2f} | "
                     f"{(r['peak_reserved_bytes'] or 0) / GIB:.2f} | "
                     f"{r['rss_after_bytes'] / GIB:.2f} |")
    lines += ["", "peak allocated per stage (GiB), run 1: " + ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in data["runs"][0]["stage_peaks_allocated"].items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    build_models(Path(args.models))
    print(f"models ready in {time.perf_counter() - t0:.0f} s", flush=True)
    data = measure(args)
    data.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else
                platform.processor() or "cpu",
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                command="python " + " ".join(sys.argv))
    (Path(args.out) / "memory_baseline.json").write_text(json.dumps(data, indent=1))
    text = report(data, args)
    (Path(args.out) / "memory_baseline.md").write_text(text)
    print(text)
    ok = all(r["allocated_after_bytes"] == data["baseline_allocated_bytes"] for r in data["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
