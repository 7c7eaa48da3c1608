"""Conformance of the samplers against a golden file of kind "scheduler".

Each case gives steps, shift and a start sample x0. The schedules are built from steps and
shift alone, and every solver runs through the production denoise loop with the file's toy
model v(x, t) = a * x + b * (float32(t) / 1000) as the model callable (no guidance).
"""

from __future__ import annotations

import math

import torch

from ..sampling.loop import denoise
from ..sampling.solvers import make_schedule, make_solver
from .golden_file import GoldenCase, GoldenFile, GoldenFileError, OutputScore, score

# Output-name prefix in the golden file -> solver name.
SOLVER_PREFIXES = {"": "unipc", "euler_": "euler", "dpm_": "dpm++"}


def toy_model(a: float, b: float):
    def model(x: torch.Tensor, t: torch.Tensor, cond) -> torch.Tensor:
        t = t.to(torch.float32).reshape(t.shape[0], *([1] * (x.dim() - 1)))
        return a * x + b * (t / 1000)
    return model


def _sample(model, x0: torch.Tensor, solver_name: str, steps: int, shift: float) -> dict:
    schedule = make_schedule(solver_name, steps, shift)
    trajectory: list[torch.Tensor] = []
    final = denoise(model, x0, make_solver(solver_name, schedule),
                    callback=lambda index, total, x: trajectory.append(x.clone()))
    return {"timesteps": schedule.timesteps, "sigmas": schedule.sigmas,
            "trajectory": torch.stack(trajectory), "final": final}


def run_case(golden: GoldenFile, case: GoldenCase) -> list[OutputScore]:
    model = toy_model(float(golden.config["a"]), float(golden.config["b"]))
    steps, shift = int(case.meta["steps"]), float(case.meta["shift"])
    x0 = case.inputs["x0"]
    produced: dict[str, torch.Tensor] = {}
    for prefix, solver_name in SOLVER_PREFIXES.items():
        for output, value in _sample(model, x0, solver_name, steps, shift).items():
            produced[prefix + output] = value

    scores = []
    for output, expected in case.expected.items():
        if output not in produced:
            scores.append(OutputScore(case.name, output, math.inf, math.inf,
                                      golden.tolerance(output), False, "not produced"))
            continue
        scores.append(score(case.name, output, produced[output], expected,
                            golden.tolerance(output)))
    return scores


def run(golden: GoldenFile) -> list[OutputScore]:
    if golden.kind != "scheduler":
        raise GoldenFileError(f"{golden.path}: kind {golden.kind!r}, expected 'scheduler'")
    scores: list[OutputScore] = []
    for case in golden.cases():
        scores.extend(run_case(golden, case))
    return scores
