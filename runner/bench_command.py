"""`wan-enhanced bench`: the scenario workflows on real-size random weights, measured.

For each scenario the command makes sure its model set exists (cached: the official layout, or
ComfyUI's repackaged files for the distill scenarios), runs the scenario's workflow in-process
with a fresh memory event log and the GPU activity monitor, and appends a row to the results
table: case, resolution, frames, steps, offload, total time, s/step, peak memory (allocated and
reserved), mean SM activity and compute load, and the run's time by phase (runner/
bench_phases.py: load, text encode, first step, steady steps, decode, video write; peak host
memory). With --warm each scenario runs a second time in the same process with the next seed,
the runner keeping the outputs of unchanged nodes as a ComfyUI server does (the models stay
loaded, the prompt's encoding is reused): the first row is the cold run, the second the warm
one. Each run's event log is saved beside the table, so `wan-enhanced report` can draw it.

Ctrl-C, `kill` (SIGTERM) or a hangup (SIGHUP) stops the command at the running workflow's next
check (runner/stop_signals.py): that scenario's row says "interrupted", no further scenario
runs, the table of the rows so far is written and the command exits 1. A model set whose
writing was cut short is written again by the next run.
"""

from __future__ import annotations

import gc
import math
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import host
from ..bench.harness import device_name, gib
from ..profiling.events import start_run
from ..profiling.report_ranks import device_peak
from ..profiling.report_data import step_number
from .bench_models import ComfySet, ensure_model_set
from .bench_phases import PHASES, NodeTime, run_phases
from .stop_signals import FirstStopRaises

WORKFLOWS = Path(__file__).resolve().parent.parent / "api_workflows"
GIB = 2 ** 30


@dataclass(frozen=True)
class Scenario:
    workflow: str
    model_set: str
    offload: bool
    # node ids of the workflow's loaders, latent and sampler
    nodes: dict


_NODES = {"dit": "1", "text_encoder": "2", "vae": "3", "latent": "5", "sampler": "6"}
SCENARIOS = {
    "ti2v_speed_preview": Scenario("wan22_ti2v_5b_speed_preview", "wan2.2-ti2v-5b", True, _NODES),
    "ti2v_efficiency": Scenario("wan22_ti2v_5b_efficiency", "wan2.2-ti2v-5b", True, _NODES),
    "ti2v_max_quality": Scenario("wan22_ti2v_5b_max_quality", "wan2.2-ti2v-5b", False, _NODES),
    "ti2v_long_duration": Scenario("wan22_ti2v_5b_long_duration", "wan2.2-ti2v-5b", True, _NODES),
    "t2v_1_3b_baseline": Scenario("wan21_t2v_1_3b_memory_baseline", "wan2.1-t2v-1.3b", True,
                                  _NODES),
    # 4-step distill runs, as most people run Wan now: ComfyUI's repackaged files, fp8 weights,
    # a LightX2V-layout LoRA merged, cfg 1
    "ti2v_5b_distill": Scenario("wan22_ti2v_5b_distill", "comfy-ti2v-5b-distill", True, _NODES),
    "t2v_14b_distill": Scenario("wan21_t2v_14b_distill", "comfy-t2v-14b-distill", True, _NODES),
    "a14b_distill": Scenario("wan22_t2v_a14b_4step_lora", "comfy-t2v-a14b-distill", True,
                             {"text_encoder": "5", "vae": "6", "latent": "8", "sampler": "9"}),
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="run the benchmark scenarios on real-size random weights",
        description="Creates real-size random-weight checkpoints in the official layout (cached in "
                    "--models), runs the scenario workflows and writes a results table.")
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                   help="a scenario to run (repeatable; default: all)")
    p.add_argument("--models", default=str(Path.home() / ".cache" / "wan-enhanced" / "bench"),
                   help="cache folder for the random model sets")
    p.add_argument("--out", default="bench-results", help="folder for the table and the logs")
    p.add_argument("--max-steps", type=int, default=None,
                   help="run at most this many sampling steps (s/step and peaks stay valid; "
                        "the table says when a scenario was shortened)")
    p.add_argument("--set", dest="assignments", action="append", default=[],
                   metavar="NODE.INPUT=VALUE", help="override an input in every scenario")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random models under the same names (a CPU smoke test)")
    p.add_argument("--gpus", type=_gpu_counts, default=[1], metavar="N[,N...]",
                   help="run every scenario on each of these GPU counts (e.g. 1,2,4: the "
                        "sampler's gpus input); the table gets the speed-up over 1 GPU and "
                        "each run's communication time and largest per-GPU peak")
    p.add_argument("--fsdp", action="store_true",
                   help="the runs on several GPUs shard the model (the sampler's fsdp input)")
    p.add_argument("--warm", action="store_true",
                   help="run each scenario a second time in the same process with the next "
                        "seed, unchanged nodes' outputs kept as a ComfyUI server keeps them "
                        "(models loaded, prompts encoded): a cold and a warm row")
    p.add_argument("--accuracy", action="store_true",
                   help="run each scenario first in full (the sampler's cache off), then as "
                        "set: the row of the accelerated run gets the distance of its latent "
                        "and its video to the full run's (on random weights a mechanical "
                        "check; how the output looks on real weights is the user's to judge)")
    p.add_argument("--memory-cap", type=float, metavar="GIB",
                   help="let this process allocate at most GIB GiB of the GPU "
                        "(torch.cuda.set_per_process_memory_fraction), as a card of that size "
                        "would: block_swap -1 and the decode's budget 0 choose from the cap; "
                        "the rows record it")
    p.set_defaults(func=run)


def apply_memory_cap(gib: float | None) -> str | None:
    """Caps this process's allocations on the compute GPU at `gib` GiB; the problem in words
    if it cannot (no CUDA device, a cap not above 0 or above the device's memory)."""
    if gib is None:
        return None
    device = host.compute_device()
    if device.type != "cuda":
        return f"--memory-cap {gib:g}: it caps a CUDA device's memory and this run has none"
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < gib * 2 ** 30 <= total:
        return (f"--memory-cap {gib:g}: expected more than 0 and at most the device's "
                f"{total / 2 ** 30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2 ** 30 / total, device)
    return None


def _gpu_counts(text: str) -> list[int]:
    import argparse
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts like 1,2,4, got {text!r}") \
            from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"GPU counts must be 1 or more, got {text!r}")
    return counts


def run(args) -> int:
    from ..distributed.devices import gpus_problem

    names = args.scenario or list(SCENARIOS)
    problem = gpus_problem(max(args.gpus))
    if problem:  # before a model set is written or a scenario runs
        print(f"error: --{problem}", file=sys.stderr)
        return 2
    problem = apply_memory_cap(args.memory_cap)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    interrupted = False
    with FirstStopRaises():  # the first stop signal raises KeyboardInterrupt; later ones wait
        try:
            for name, gpus in [(name, gpus) for name in names for gpus in args.gpus]:
                for row in run_scenario(name, Path(args.models), out, args.max_steps,
                                        args.assignments, args.tiny, gpus=gpus,
                                        fsdp=args.fsdp and gpus > 1, warm=args.warm,
                                        accuracy=args.accuracy):
                    add_speedup(row, rows)
                    if args.memory_cap is not None:
                        row["memory_cap_gib"] = args.memory_cap
                    rows.append(row)
                    print(format_row(row), flush=True)
                    if row["status"] == "interrupted":
                        interrupted = True
                        break
                if interrupted:
                    break
        except KeyboardInterrupt:  # outside a workflow: writing a model set, saving a log
            interrupted = True
        if interrupted:
            print("interrupted: no further scenario runs", file=sys.stderr, flush=True)
        _write_table(out, rows)
    return 1 if interrupted or any(r["status"] != "ok" for r in rows) else 0


def _write_table(out: Path, rows: list[dict]) -> None:
    table = results_markdown(rows)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    (out / f"bench-{stamp}.md").write_text(table)
    (out / f"bench-{stamp}.json").write_text(json.dumps(rows, indent=1))
    print(table)


def _overrides(scenario: Scenario, model_set, workflow: dict, max_steps: int | None,
               extra: list[str]) -> tuple[list[str], int, int]:
    n = scenario.nodes
    steps = int(workflow[n["sampler"]]["inputs"]["steps"])
    ran = min(steps, max_steps) if max_steps else steps
    settings = [f"{n['sampler']}.steps={ran}"]
    if not isinstance(model_set, ComfySet):  # a ComfySet's files carry the workflow's names
        settings += [f"{n['dit']}.model_name={model_set.dit_folder}",
                     f"{n['vae']}.vae_name={model_set.vae_file}",
                     f"{n['text_encoder']}.text_encoder_name={model_set.text_encoder_file}"]
    return settings + list(extra), steps, ran


def run_scenario(name: str, models: Path, out: Path, max_steps: int | None,
                 extra: list[str], tiny: bool = False, gpus: int = 1,
                 fsdp: bool = False, warm: bool = False, accuracy: bool = False) -> list[dict]:
    """The scenario's rows: its run, and with `warm` a second run in the same process with the
    next seed and the first run's unchanged node outputs (stops after a run that did not
    finish). With `accuracy` a full run (the sampler's cache off) comes first, its own row,
    and the first run's row gets its distance to it (accuracy_against)."""
    from .. import NODE_CLASS_MAPPINGS
    from .node_cache import NodeCache
    from .overrides import apply_overrides
    from .workflow import load_workflow

    scenario = SCENARIOS[name]
    model_set = ensure_model_set(models, scenario.model_set, tiny=tiny)
    host.set_headless_folders(models=models, output=out / "videos")
    workflow = load_workflow(WORKFLOWS / f"{scenario.workflow}.json", NODE_CLASS_MAPPINGS)
    settings, steps, ran = _overrides(scenario, model_set, workflow, max_steps, extra)
    sampler = scenario.nodes["sampler"]
    if gpus > 1:
        settings += [f"{sampler}.gpus={gpus}", f"{sampler}.fsdp={str(fsdp).lower()}"]
    workflow = apply_overrides(workflow, settings, NODE_CLASS_MAPPINGS)
    rows = []
    reference = None
    if accuracy:
        full = apply_overrides(workflow, [f"{sampler}.cache=off"], NODE_CLASS_MAPPINGS)
        full_cache = NodeCache()
        row = _run_once(name, scenario, full, out, steps, ran, gpus, fsdp, full_cache, "full")
        rows.append(row)
        if row["status"] != "ok":
            return rows
        reference = (_sampled(full_cache, sampler), row["videos"])
        del full_cache
    cache = NodeCache() if warm or accuracy else None
    for run in ("cold", "warm") if warm else ("cold",):
        if run == "warm":
            seed = int(workflow[sampler]["inputs"]["seed"]) + 1
            workflow = apply_overrides(workflow, [f"{sampler}.seed={seed}"], NODE_CLASS_MAPPINGS)
        row = _run_once(name, scenario, workflow, out, steps, ran, gpus, fsdp, cache,
                        run if warm else None)
        if reference is not None and run == "cold" and row["status"] == "ok":
            row["accuracy"] = accuracy_against(reference, _sampled(cache, sampler),
                                               row["videos"])
        rows.append(row)
        if row["status"] != "ok":
            break
    return rows


def _sampled(cache, sampler: str) -> torch.Tensor | None:
    """The sampler's latent of the run that filled `cache` (NodeCache), or None."""
    entry = cache.lookup(sampler)
    if entry is None or not entry.outputs:
        return None
    return entry.outputs[0]["samples"]


def accuracy_against(reference: tuple, latent: torch.Tensor | None, videos: list[str]) -> dict:
    """The accelerated run's distance to the full run: the latent's max |difference| over the
    full latent's max |value|, and the PSNR (dB) of the first video's frames against the full
    run's (8-bit, as written)."""
    from ..pipeline.video_io import read_mp4

    full_latent, full_videos = reference
    out = {"latent_max_rel": None, "video_psnr_db": None}
    if full_latent is not None and latent is not None:
        diff = (latent.double() - full_latent.double()).abs().max()
        out["latent_max_rel"] = float(diff / full_latent.double().abs().max())
    if full_videos and videos:
        mine, _ = read_mp4(videos[0])
        theirs, _ = read_mp4(full_videos[0])
        if mine.shape == theirs.shape:
            mse = float(((mine.double() - theirs.double()) ** 2).mean())
            out["video_psnr_db"] = math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)
    return out


def _run_once(name, scenario: Scenario, workflow: dict, out: Path, steps: int, ran: int,
              gpus: int, fsdp: bool, cache, run: str | None) -> dict:
    from .. import NODE_CLASS_MAPPINGS
    from ..profiling.activity import ActivityMonitor
    from .executor import RunError, RunInterrupted, run_workflow

    latent = workflow[scenario.nodes["latent"]]["inputs"]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log = start_run()
    status, error, peak_rss, videos = "ok", None, None, []
    timings, started = [], {}

    def on_event(event) -> None:
        now = time.time()
        if event.kind == "start":
            started[event.node_id] = now
        elif event.kind in ("finish", "cached"):
            begun = started.get(event.node_id, now)
            timings.append(NodeTime(event.node_id, event.class_type, begun, now - begun,
                                    event.kind == "cached"))

    start = time.perf_counter()
    with ActivityMonitor() as monitor:
        try:
            result = run_workflow(workflow, NODE_CLASS_MAPPINGS, on_event=on_event,
                                  cache=cache)
            peak = result.peak
            peak_rss = peak.rss if peak else None
            videos = [f for f in result.files if f.endswith(".mp4")]
            del result
        except RunInterrupted as exc:
            status, error, peak = "interrupted", str(exc), None
        except RunError as exc:
            status, error, peak = "failed", str(exc), None
    seconds = time.perf_counter() - start
    activity = monitor.result()
    log.attach_activity(activity)
    suffix = "" if gpus == 1 else f"-{gpus}gpus{'-fsdp' if fsdp else ''}"
    suffix += f"-{run}" if run else ""
    log_path = log.save(out / f"{name}{suffix}-events.json")
    ranks = rank_summary(log.events)
    if ranks:  # the work ran in the GPUs' processes: their peaks, not this process's
        peak = None
    return {
        "case": name, "run": run, "status": status, "error": error,
        "resolution": f"{latent['width']}x{latent['height']}", "frames": latent["frames"],
        "steps": ran, "steps_in_workflow": steps, "offload": scenario.offload,
        "total_seconds": round(seconds, 2), "seconds_per_step": seconds_per_step(log.events),
        "peak_allocated_gib": _gib(peak.allocated if peak else ranks.get("allocated_peak")),
        # one process: the allocator's reserved peak; several GPUs: the largest device peak
        "peak_reserved_gib": _gib(peak.reserved if peak else ranks.get("device_peak")),
        "peak_host_gib": _gib(peak_rss),
        "phases": run_phases(timings, log.events, round(seconds, 3)),
        "gpus": gpus, "fsdp": fsdp, "comm_seconds": ranks.get("comm_seconds"),
        "mean_sm_activity": activity["summary"].get("mean_sm_activity"),
        "compute_load_gpu_s": activity["summary"].get("compute_load"),
        "events": str(log_path),
        "videos": videos,
        "device": device_name(),
    }


def seconds_per_step(events: list[dict]) -> float | None:
    """Mean interval between consecutive sampling-step events (the first step, which includes
    placing the model, is measured from the sampler's start event only when it is the only one)."""
    steps = [e["time"] for e in events if step_number(e) is not None]
    if len(steps) >= 2:
        return round((steps[-1] - steps[0]) / (len(steps) - 1), 3)
    starts = [e["time"] for e in events if e["label"] == "sampling starts"]
    if steps and starts:
        return round(steps[0] - starts[0], 3)
    return None


def rank_summary(events: list[dict]) -> dict:
    """Of the last several-GPU run in `events`: the largest peaks over its ranks (device_peak:
    the allocator's reserved peak plus what a rank held outside it, profiling.report_ranks) and
    rank 0's communication seconds (all-to-all, ring, output gather, CFG swap); {} without one."""
    ranks = [e["extra"] for e in events if e.get("stage") == "ranks" and e.get("extra")]
    starts = [i for i, r in enumerate(ranks) if r.get("rank") == 0]
    if not starts:
        return {}
    last = ranks[starts[-1]:]

    def largest(key):
        values = [r[key] for r in last if r.get(key) is not None]
        return max(values) if values else None

    comm = sum(last[0].get(f"{kind}_seconds") or 0.0
               for kind in ("all_to_all", "ring", "gather", "cfg"))
    peaks = [p for p in map(device_peak, last) if p is not None]
    return {"device_peak": max(peaks) if peaks else None,
            "allocated_peak": largest("allocated_peak_bytes"), "comm_seconds": round(comm, 3)}


def add_speedup(row: dict, earlier: list[dict]) -> None:
    """The time per step of the same case on one GPU over this row's (None without one)."""
    single = [r for r in earlier if r["case"] == row["case"] and r.get("gpus", 1) == 1
              and r.get("seconds_per_step")]
    ratio = None
    if single and row.get("seconds_per_step"):
        ratio = round(single[-1]["seconds_per_step"] / row["seconds_per_step"], 2)
    row["speedup"] = ratio if row.get("gpus", 1) > 1 else None


def _gib(value) -> float | None:
    return None if value is None else round(gib(value), 2)


COLUMNS = ("case", "resolution", "frames", "steps", "offload", "total_seconds",
           "seconds_per_step", "peak_allocated_gib", "peak_reserved_gib", "mean_sm_activity",
           "compute_load_gpu_s", "gpus", "speedup", "comm_seconds", "status")


def _cell(value) -> str:
    """Floats to one decimal beyond what the column needs: the table is read, the JSON keeps
    every digit."""
    return f"{value:.1f}" if isinstance(value, float) and abs(value) >= 10 else str(value)


def format_row(row: dict) -> str:
    return " | ".join(_cell(row.get(c)) for c in COLUMNS)


def phases_markdown(rows: list[dict]) -> str:
    """Seconds by phase per run (PHASES; steady steps with their count), peaks beside."""
    header = ("| case | run | " + " | ".join(p.replace("_", " ") for p in PHASES)
              + " | peak reserved GiB | peak host GiB |")
    lines = [header, "|" + "---|" * (len(PHASES) + 4)]
    for row in rows:
        phases = row.get("phases")
        if not phases:
            continue
        cells = [str(phases[p]) for p in PHASES]
        cells[PHASES.index("steady_steps")] += f" ({phases['steady_step_count']})"
        lines.append(f"| {row['case']} | {row.get('run') or 'cold'} | " + " | ".join(cells)
                     + f" | {row.get('peak_reserved_gib')} | {row.get('peak_host_gib')} |")
    return "\n".join(lines) + "\n"


def results_markdown(rows: list[dict]) -> str:
    header = ("| case | resolution | frames | steps | offload | total s | s/step | "
              "peak alloc GiB | peak reserved GiB | mean SM % | compute load GPU·s | GPUs | "
              "speed-up | comm s | status |")
    lines = [header, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [_cell(row.get(c)) for c in COLUMNS]
        if row.get("run") in ("warm", "full"):
            cells[0] += f" ({row['run']})"
        if row["steps"] != row["steps_in_workflow"]:
            cells[3] = f"{row['steps']} of {row['steps_in_workflow']}"
        gpus = row.get("gpus", 1)
        cells[COLUMNS.index("gpus")] = f"{gpus}{' fsdp' if row.get('fsdp') else ''}"
        lines.append("| " + " | ".join(cells) + " |")
    device = rows[0]["device"] if rows else "?"
    cap = rows[0].get("memory_cap_gib") if rows else None
    if cap is not None:
        device += f", this process capped at {cap:g} GiB of it"
    return (f"device: {device}\n\n" + "\n".join(lines) + "\n\nSeconds by phase:\n\n"
            + phases_markdown(rows) + accuracy_markdown(rows))


def accuracy_markdown(rows: list[dict]) -> str:
    """Each accelerated run's distance to its full run (--accuracy), or nothing."""
    measured = [r for r in rows if r.get("accuracy")]
    if not measured:
        return ""
    lines = ["", "Against the full run (the sampler's cache off, same seed):", "",
             "| case | total s | full run total s | latent max rel | video PSNR dB |",
             "|---|---|---|---|---|"]
    for row in measured:
        full = next((r for r in rows if r["case"] == row["case"] and r.get("run") == "full"),
                    {})
        acc = row["accuracy"]
        psnr = acc["video_psnr_db"]
        lines.append(f"| {row['case']} | {row['total_seconds']} | {full.get('total_seconds')} "
                     f"| {_fmt(acc['latent_max_rel'], '.3e')} | {_fmt(psnr, '.2f')} |")
    lines += ["", "On random weights these are mechanical checks of the arithmetic; how the "
                  "output looks on real weights is for the user to judge."]
    return "\n".join(lines) + "\n"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
