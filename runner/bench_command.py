"""`wan-enhanced bench`: the scenario workflows on real-size random weights, measured.

For each scenario the command makes sure its model set exists (official layout, cached), runs
the scenario's workflow in-process with a fresh memory event log and the GPU activity monitor,
and appends a row to the results table: case, resolution, frames, steps, offload, total time,
s/step, peak memory (allocated and reserved), mean SM activity and compute load. Each run's event
log is saved beside the table, so `wan-enhanced report` can draw it.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import host
from ..bench.harness import device_name, gib
from ..profiling.events import start_run
from ..profiling.report_data import step_number
from .bench_models import ensure_model_set

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
    p.set_defaults(func=run)


def run(args) -> int:
    names = args.scenario or list(SCENARIOS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        row = run_scenario(name, Path(args.models), out, args.max_steps, args.assignments,
                           args.tiny)
        rows.append(row)
        print(format_row(row), flush=True)
    table = results_markdown(rows)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    (out / f"bench-{stamp}.md").write_text(table)
    (out / f"bench-{stamp}.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _overrides(scenario: Scenario, model_set, workflow: dict, max_steps: int | None,
               extra: list[str]) -> tuple[list[str], int, int]:
    n = scenario.nodes
    steps = int(workflow[n["sampler"]]["inputs"]["steps"])
    ran = min(steps, max_steps) if max_steps else steps
    settings = [f"{n['dit']}.model_name={model_set.dit_folder}",
                f"{n['vae']}.vae_name={model_set.vae_file}",
                f"{n['text_encoder']}.text_encoder_name={model_set.text_encoder_file}",
                f"{n['sampler']}.steps={ran}"]
    return settings + list(extra), steps, ran


def run_scenario(name: str, models: Path, out: Path, max_steps: int | None,
                 extra: list[str], tiny: bool = False) -> dict:
    from .. import NODE_CLASS_MAPPINGS
    from ..profiling.activity import ActivityMonitor
    from .executor import RunError, run_workflow
    from .overrides import apply_overrides
    from .workflow import load_workflow

    scenario = SCENARIOS[name]
    model_set = ensure_model_set(models, scenario.model_set, tiny=tiny)
    host.set_headless_folders(models=models, output=out / "videos")
    workflow = load_workflow(WORKFLOWS / f"{scenario.workflow}.json", NODE_CLASS_MAPPINGS)
    settings, steps, ran = _overrides(scenario, model_set, workflow, max_steps, extra)
    workflow = apply_overrides(workflow, settings, NODE_CLASS_MAPPINGS)
    latent = workflow[scenario.nodes["latent"]]["inputs"]

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log = start_run()
    status, error = "ok", None
    start = time.perf_counter()
    with ActivityMonitor() as monitor:
        try:
            result = run_workflow(workflow, NODE_CLASS_MAPPINGS)
            peak = result.peak
            del result
        except RunError as exc:
            status, error, peak = "failed", str(exc), None
    seconds = time.perf_counter() - start
    activity = monitor.result()
    log.attach_activity(activity)
    log_path = log.save(out / f"{name}-events.json")
    return {
        "case": name, "status": status, "error": error,
        "resolution": f"{latent['width']}x{latent['height']}", "frames": latent["frames"],
        "steps": ran, "steps_in_workflow": steps, "offload": scenario.offload,
        "total_seconds": round(seconds, 2), "seconds_per_step": seconds_per_step(log.events),
        "peak_allocated_gib": _gib(peak.allocated if peak else None),
        "peak_reserved_gib": _gib(peak.reserved if peak else None),
        "mean_sm_activity": activity["summary"].get("mean_sm_activity"),
        "compute_load_gpu_s": activity["summary"].get("compute_load"),
        "events": str(log_path),
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


def _gib(value) -> float | None:
    return None if value is None else round(gib(value), 2)


COLUMNS = ("case", "resolution", "frames", "steps", "offload", "total_seconds",
           "seconds_per_step", "peak_allocated_gib", "peak_reserved_gib", "mean_sm_activity",
           "compute_load_gpu_s", "status")


def _cell(value) -> str:
    """Floats to one decimal beyond what the column needs: the table is read, the JSON keeps
    every digit."""
    return f"{value:.1f}" if isinstance(value, float) and abs(value) >= 10 else str(value)


def format_row(row: dict) -> str:
    return " | ".join(_cell(row.get(c)) for c in COLUMNS)


def results_markdown(rows: list[dict]) -> str:
    header = ("| case | resolution | frames | steps | offload | total s | s/step | "
              "peak alloc GiB | peak reserved GiB | mean SM % | compute load GPU·s | status |")
    lines = [header, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [_cell(row.get(c)) for c in COLUMNS]
        if row["steps"] != row["steps_in_workflow"]:
            cells[3] = f"{row['steps']} of {row['steps_in_workflow']}"
        lines.append("| " + " | ".join(cells) + " |")
    device = rows[0]["device"] if rows else "?"
    return f"device: {device}\n\n" + "\n".join(lines) + "\n"
