"""`wan-enhanced demo`: the speed-preview workflow end to end on tiny random-weight models.

It builds a temporary models folder holding tiny checkpoints under the file names the workflow
names (a Wan2.2 TI2V-layout DiT, the Wan2.2 VAE layout, a ComfyUI-layout umT5 with its tokenizer
embedded), runs the workflow in-process at a size the CPU handles in seconds, and writes the MP4,
the run's memory event log and its report to the output folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..checkpoints.tiny import write_models_folder
from ..safe_paths import folder_problem
from . import run_command
from .run_command import FAILED, INVALID
from ..profiling.events import current_log, start_run
from ..profiling.report import build_report

WORKFLOW = Path(__file__).resolve().parent.parent / "api_workflows" / "wan22_ti2v_5b_speed_preview.json"

# The speed preview at 1280x704x121 in fp32 on a CPU, shrunk to fit a demo: a small frame and
# clip, CPU-friendly dtypes, the encoder on the CPU.
DEMO_SETTINGS = (
    "5.width=320", "5.height=192", "5.frames=17",
    "1.weight_dtype=fp32", "2.dtype=fp32", "2.device=cpu", "3.dtype=fp32",
    "8.filename_prefix=demo", "8.fps=24",
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="run the speed-preview workflow on tiny random models (CPU, ~1 minute)",
        description="Builds tiny random-weight checkpoints in a temporary models folder and runs "
                    "the Wan2.2 TI2V-5B speed-preview workflow end to end, writing DIR/*.mp4 and "
                    "DIR/memory_events.json.")
    p.add_argument("--out", default="output", metavar="DIR", help="output folder (./output)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)


def _run_parser() -> argparse.ArgumentParser:
    """A parser of the `run` command alone (the demo runs the workflow through it)."""
    parser = argparse.ArgumentParser(prog="wan-enhanced")
    run_command.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def run(args) -> int:
    out = Path(args.out)
    problem = folder_problem(out)
    if problem is not None:  # said before minutes of model building, not as a traceback after
        print(f"error: --out {out}: {problem}", file=sys.stderr)
        return INVALID
    with tempfile.TemporaryDirectory(prefix="wan-enhanced-demo-") as models:
        print(f"building tiny random-weight models in {models}", file=sys.stderr)
        write_models_folder(models, dit_name="wan2.2_ti2v_5B_fp16.safetensors",
                            vae_name="wan2.2_vae.safetensors",
                            text_encoder_name="umt5_xxl_fp16.safetensors", kind="ti2v")
        argv = ["run", str(WORKFLOW), "--models", models, "--out", str(out)]
        for setting in DEMO_SETTINGS:
            argv += ["--set", setting]
        if args.quiet:
            argv.append("--quiet")
        start_run()
        run_args = _run_parser().parse_args(argv)
        code = run_args.func(run_args)
    try:
        log_path = current_log().save(out / "memory_events.json")
        print(f"memory events: {log_path}", file=sys.stderr)
        print(f"memory report: {build_report(log_path)}", file=sys.stderr)
    except OSError as error:
        print(f"error: {error.strerror or error}", file=sys.stderr)
        return code or FAILED
    return code
