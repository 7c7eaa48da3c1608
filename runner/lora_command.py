"""`wan-enhanced lora merge MODEL LORA[:STRENGTH]... --out FILE`: a DiT checkpoint with LoRAs
merged in, in the checkpoint's own key layout and dtypes."""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path

OK, FAILED, INVALID = 0, 1, 2


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lora", help="LoRA tools: merge LoRAs into a model file",
        description="LoRA files for the Wan DiT: low-rank pairs under kohya/musubi, LyCORIS, "
                    "generic/PEFT and diffusers names; full differences (.diff, .diff_b, "
                    "LightX2V's .diff_m); LyCORIS LoHa and LoKr; DoRA.")
    commands = p.add_subparsers(dest="lora_command", required=True, metavar="COMMAND")
    merge = commands.add_parser(
        "merge", help="write a model file with LoRAs merged in",
        description="Reads MODEL (a Wan DiT checkpoint in any layout the model loader reads) "
                    "and writes it to --out with each LORA merged at its STRENGTH (default 1; "
                    "0 skips it), in order, in float32 before the weights are converted back: "
                    "every tensor keeps its key, dtype and shape, and the file its metadata. "
                    "Tensors stream one at a time; the output appears complete or not at all. "
                    "Exit codes: 0 written, 1 the output could not be written, 2 a file is "
                    "missing, unreadable or does not fit the model.")
    merge.add_argument("model", metavar="MODEL")
    merge.add_argument("loras", nargs="+", metavar="LORA[:STRENGTH]")
    merge.add_argument("--out", required=True, metavar="FILE.safetensors")
    merge.set_defaults(func=run_merge)


def parse_lora(text: str) -> tuple[Path, float]:
    """'path' or 'path:strength' (a path may itself hold colons: only a number after the last
    one is a strength)."""
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            strength = float(tail)
        except ValueError:
            return Path(text), 1.0
        if not math.isfinite(strength):
            raise ValueError(f"{text}: the strength {tail} is not a finite number")
        return Path(head), strength
    return Path(text), 1.0


def run_merge(args) -> int:
    from ..checkpoints.reader import CheckpointError
    from ..lora.merge_file import merge_file

    err = sys.stderr
    try:
        loras = [parse_lora(text) for text in args.loras]
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return INVALID
    for path, strength in loras:
        if strength == 0:
            print(f"{path.name}: strength 0, skipped", file=err)
    loras = [(p, s) for p, s in loras if s != 0]
    if not loras:
        print("error: every LoRA has strength 0: nothing to merge", file=err)
        return INVALID
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            report = merge_file(args.model, loras, args.out)
    except CheckpointError as exc:
        print(f"error: {exc}", file=err)
        return INVALID
    except OSError as exc:
        print(f"error: {exc}", file=err)
        return FAILED
    for warning in caught:
        print(f"warning: {warning.message}", file=err)
    for line in report.loras:
        print(line)
    rescaled = f"; {len(report.rescaled)} fp8 scales raised" if report.rescaled else ""
    print(f"{report.out}: {report.tensors} tensors, {len(report.changed)} merged{rescaled} "
          f"({time.perf_counter() - start:.1f} s)")
    return OK
