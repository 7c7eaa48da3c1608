"""Run the component a golden file describes and score every output against it."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from .golden_file import GoldenFileError, Report, read_golden

# golden `kind` -> module of this package with a `run(golden) -> list[OutputScore]`
RUNNERS = {
    "dit_wan21": "run_dit",
    "dit_wan22_ti2v": "run_dit",
    "vae21": "run_vae",
    "vae22": "run_vae",
    "umt5": "run_t5",
    "scheduler": "run_scheduler",
}


def check_file(path: str | Path) -> Report:
    """Read, run on the CPU in float32, and score; raises GoldenFileError for unusable files."""
    golden = read_golden(path)
    if golden.kind not in RUNNERS:
        raise GoldenFileError(f"{path}: unknown kind {golden.kind!r}; expected one of "
                              f"{sorted(RUNNERS)}")
    runner = importlib.import_module(f".{RUNNERS[golden.kind]}", __package__)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        scores = runner.run(golden)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise GoldenFileError(f"{path}: cannot run the {golden.kind} cases: {exc}") from exc
    return Report(Path(path), golden.kind, scores)
