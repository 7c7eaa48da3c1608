"""Solver names, the schedule grid each one uses, and the factory."""

from __future__ import annotations

from .dpmpp import DPMPlusPlus2MSolver
from .euler import EulerSolver
from .schedules import FlowSchedule, dpm_schedule, unipc_schedule
from .solver_base import FlowSolver
from .unipc import UniPCSolver

_SOLVERS: dict[str, type[FlowSolver]] = {
    "unipc": UniPCSolver,
    "euler": EulerSolver,
    "dpm++": DPMPlusPlus2MSolver,
}

# The official DPM++ runs on linspace(1, 0); UniPC and Euler on linspace(float32(0.999), 0).
_GRIDS = {
    "unipc": unipc_schedule,
    "euler": unipc_schedule,
    "dpm++": dpm_schedule,
}

SOLVER_NAMES: tuple[str, ...] = tuple(_SOLVERS)


def _check_name(name: str) -> None:
    if name not in _SOLVERS:
        raise ValueError(f"unknown solver {name!r}; valid names: {', '.join(SOLVER_NAMES)}")


def make_schedule(name: str, steps: int, shift: float, denoise: float = 1.0) -> FlowSchedule:
    """The schedule the official pipeline builds for this solver."""
    _check_name(name)
    return _GRIDS[name](steps, shift, denoise)


def make_solver(name: str, schedule: FlowSchedule) -> FlowSolver:
    """A fresh solver for one run over `schedule`."""
    _check_name(name)
    return _SOLVERS[name](schedule)
