"""Checks the nodes' VALIDATE_INPUTS share: what can be decided from a node's own constants
before anything runs, so that ComfyUI's POST /prompt and our runner refuse a bad workflow up front
instead of after minutes of sampling.

ComfyUI skips its own min/max and choice checks for every input VALIDATE_INPUTS names, and its
min/max checks let NaN through (every comparison with NaN is false): `constant_problems` checks
both again for the inputs a node names. A linked input arrives as None (its value does not exist
yet) and is checked when the node runs.

A verdict is True or one line per problem, each starting with the input's name, the form the
runner's validation reads back (runner/workflow.py) and ComfyUI shows as the error's details.
"""

from __future__ import annotations

import math
from typing import Iterable

from .. import host
from ..wan.configs import KNOWN_DITS, TEMPORAL_STRIDE, pixel_stride
from ..safe_paths import UnsafePathError, folder_problem, path_inside

# What a video's width and height divide by, over the released models: every model takes a
# multiple of the largest (a size suggested before the model is known), and a side off the
# smallest fits none; a model's own stride is checked once it is known (the latent node, when
# it runs).
SMALLEST_PIXEL_STRIDE = min(pixel_stride(known.config) for known in KNOWN_DITS.values())
LARGEST_PIXEL_STRIDE = max(pixel_stride(known.config) for known in KNOWN_DITS.values())


def verdict(problems: Iterable[str | None]) -> bool | str:
    found = [p for p in problems if p]
    return True if not found else "\n".join(found)


def constant_problems(cls, **values) -> list[str]:
    """ComfyUI's checks of declared ranges and choices, for the named inputs, and no NaN or
    infinity in a number."""
    declared = cls.INPUT_TYPES()
    specs = {**(declared.get("required") or {}), **(declared.get("optional") or {})}
    problems = []
    for name, value in values.items():
        if value is None or name not in specs:
            continue
        kind, options = specs[name][0], (specs[name][1] if len(specs[name]) > 1 else {})
        problem = _number_problem(kind, options, value) if kind in ("INT", "FLOAT") else (
            _choice_problem(kind, value) if isinstance(kind, (list, tuple)) else None)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _number_problem(kind: str, options: dict, value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number, got {value!r}"
    if kind == "FLOAT" and not math.isfinite(value):
        return f"{value} is not a finite number"
    if kind == "INT" and not float(value).is_integer():
        return f"expected a whole number, got {value}"
    low, high = options.get("min"), options.get("max")
    if low is not None and value < low:
        return f"{value} is smaller than the minimum {low}"
    if high is not None and value > high:
        return f"{value} is bigger than the maximum {high}"
    return None


def _choice_problem(choices, value) -> str | None:
    if value in choices:
        return None
    shown = ", ".join(map(repr, list(choices)[:12]))
    return f"{value!r} is not one of the choices [{shown}{', ...' if len(choices) > 12 else ''}]"


def video_size_problems(width, height, frames) -> list[str]:
    """Frames 4n+1, width and height multiples of the smallest pixel stride (16)."""
    problems = []
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, int) and value % SMALLEST_PIXEL_STRIDE:
            low = max(SMALLEST_PIXEL_STRIDE, value // SMALLEST_PIXEL_STRIDE * SMALLEST_PIXEL_STRIDE)
            problems.append(f"{name}: {value} is not a multiple of {SMALLEST_PIXEL_STRIDE} "
                            f"(nearest valid: {low} or {low + SMALLEST_PIXEL_STRIDE})")
    if isinstance(frames, int) and frames >= 1 and (frames - 1) % TEMPORAL_STRIDE:
        below = (frames - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1
        problems.append(f"frames: {frames} is not of the form 4n+1 (nearest valid: {below} or "
                        f"{below + TEMPORAL_STRIDE})")
    return problems


def output_file_problem(field: str, name: str | None) -> str | None:
    """Why a file name in the output folder (a prefix, an event log) cannot be written: it
    leads outside the folder, or the folder it goes to is a file or not writable."""
    if name is None:
        return None
    try:
        target = path_inside(host.output_directory(), name, field)
    except UnsafePathError as error:
        return str(error)
    problem = folder_problem(target.parent)
    return f"{field}: {problem}" if problem else None


def video_memory_problem(width, height, frames, batch) -> str | None:
    """A video whose decoded frames and latent cannot fit this machine's memory at all (the
    frames of every decoder are float32 in CPU memory): refused before anything runs."""
    from ..pipeline import memory_guard as guard

    if not all(isinstance(v, int) and v > 0 for v in (width, height, frames, batch)):
        return None  # linked, or refused by the range checks
    size = guard.VideoSize(width, height, frames, batch)
    available, have = guard.machine_memory()
    problem = guard.refusal_or_none(
        "the decoded video (float32 frames in CPU memory) with its latent", size,
        LARGEST_PIXEL_STRIDE, lambda s: guard.frames_bytes(s) + guard.smallest_latent_bytes(s),
        available, have)
    return f"frames: {problem}" if problem else None
