"""Batch sweeps: one workflow, many settings, results in a resumable JSONL file.

A sweep file is a JSON object mapping a setting to the values it takes:

    {"prompt": ["a cat", "a dog"], "seed": [1, 2, 3], "sampler.steps": [5, 10]}

Keys are NODE.INPUT paths (as --set) or one of three shorthands, each the unique input of a
given type and name in the workflow, trying the names in order until one exists:

    prompt    STRING input "positive", else "prompt", "positive_prompt", "text"
    negative  STRING input "negative", else "negative_prompt"
    seed      INT input "seed", else "noise_seed"

A name found on several nodes (two CLIPTextEncode "text" inputs) is an error: use NODE.INPUT.
A value that is not a list is a single value. The jobs are the Cartesian product in a stable
order: keys in file order, the last key varying fastest; a Sweep builds each job when it is
read (sweep_checks.py checks them all without building them all).

Every finished job appends one JSON line to the results file. A job's key is a hash of the
workflow it runs (class types and inputs after the settings are applied) and of where its files
go (the output folder; with --server also the server, or "a pool" for several), so re-running
the same sweep skips the jobs that already have a "success" line and a crashed batch resumes
where it stopped; changing the workflow, a value or the output folder gives new keys.

Just before a job's video is written a "writing" line names the file and the token the file
will carry in its metadata. A job stopped between its video and its "success" line (kill -9)
thus left a "writing" line whose file exists: the rerun records that job as succeeded from its
file (status "success", "recovered": true) instead of running it again and writing a second
copy, when the file carries that line's token (a file another run wrote under that name since,
or one without a token, does not count: the job runs again).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from .overrides import (OverrideError, Target, parse_value, resolve_input, resolve_path,
                        set_input)
from .workflow import Registry, input_spec

SHORTHANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "prompt": ("STRING", ("positive", "prompt", "positive_prompt", "text")),
    "negative": ("STRING", ("negative", "negative_prompt")),
    "seed": ("INT", ("seed", "noise_seed")),
}


class SweepError(ValueError):
    """A sweep file or key that does not fit; names the file/key and what was expected."""


@dataclass
class SweepJob:
    index: int  # 1-based
    settings: dict[str, Any]  # sweep key -> value, in file order
    workflow: dict
    job_key: str


# -- the sweep file ----------------------------------------------------------------------------

def load_sweep(path: str | Path) -> dict[str, list]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SweepError(f"sweep file {path}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SweepError(f"sweep file {path}: not valid JSON: {exc.msg} at line {exc.lineno}") \
            from None
    if not isinstance(data, dict) or not data:
        raise SweepError(f"sweep file {path}: expected a JSON object such as "
                         '{"seed": [1, 2, 3], "3.steps": [10, 20]}')
    sweep = {}
    for key, values in data.items():
        values = values if isinstance(values, list) else [values]
        if not values:
            raise SweepError(f"sweep file {path}: {key!r} has an empty list of values")
        sweep[key] = values
    return sweep


def expand_sweep(workflow: Mapping, sweep: Mapping[str, list], registry: Registry,
                 scope: str = "") -> "Sweep":
    """The jobs, one per combination of values: a sequence built as it is read, so a sweep of
    10^5 jobs holds one job's workflow at a time."""
    targets = {key: resolve_key(workflow, key, registry) for key in sweep}
    seen: dict[tuple, str] = {}
    for key, target in targets.items():
        where = (target.node_id, target.input_name)
        if where in seen:
            raise SweepError(f"sweep keys {seen[where]!r} and {key!r} both set input "
                             f"{target.input_name!r} of node {target.node_id}")
        seen[where] = key
    typed = {key: [_typed(key, targets[key], v) for v in values] for key, values in sweep.items()}
    return Sweep(dict(workflow), targets, typed, scope)


class Sweep(Sequence):
    """The Cartesian product of a sweep's values, job by job (the last key varies fastest).
    A job copies only the nodes its settings change; the rest of its workflow is shared and
    never written to."""

    def __init__(self, workflow: dict, targets: dict[str, Target], values: dict[str, list],
                 scope: str = ""):
        self.workflow, self.targets, self.values, self.scope = workflow, targets, values, scope
        self._count = math.prod(len(v) for v in values.values())

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"job {index + 1} of a sweep of {self._count}")
        return self._job(self.positions(index), index + 1)

    def __iter__(self) -> Iterator[SweepJob]:
        for index in range(self._count):
            yield self[index]

    def positions(self, index: int) -> dict[str, int]:
        """Where each key's value of job `index` (0-based) is in its list."""
        at = {}
        for key in reversed(list(self.values)):
            index, at[key] = divmod(index, len(self.values[key]))
        return at

    def job_index(self, positions: dict[str, int]) -> int:
        """The 0-based job whose values are at `positions` (the inverse of `positions`)."""
        index = 0
        for key, values in self.values.items():
            index = index * len(values) + positions[key]
        return index

    def _job(self, positions: dict[str, int], number: int) -> SweepJob:
        settings = {key: values[positions[key]] for key, values in self.values.items()}
        job_workflow = dict(self.workflow)
        for node_id in {target.node_id for target in self.targets.values()}:
            job_workflow[node_id] = copy.deepcopy(self.workflow[node_id])
        for key, value in settings.items():
            set_input(job_workflow, self.targets[key], value)
        return SweepJob(number, settings, job_workflow, job_key(job_workflow, self.scope))


def resolve_key(workflow: Mapping, key: str, registry: Registry) -> Target:
    try:
        if key in SHORTHANDS:
            return resolve_shorthand(workflow, key, registry)
        return resolve_path(workflow, key, registry)
    except OverrideError as exc:
        raise SweepError(f"sweep key {key!r}: {exc}") from None


def resolve_shorthand(workflow: Mapping, key: str, registry: Registry) -> Target:
    wanted_type, names = SHORTHANDS[key]
    for name in names:
        found = [node_id for node_id, node in workflow.items()
                 if _declares(registry, node, name, wanted_type)]
        if len(found) == 1:
            return resolve_input(workflow, found[0], name, registry)
        if len(found) > 1:
            listing = ", ".join(f"{n}.{name}" for n in found)
            raise OverrideError(f"ambiguous: several nodes have a {wanted_type} input {name!r} "
                                f"({listing}); use NODE.INPUT instead")
    raise OverrideError(f"no {wanted_type} input named {' / '.join(names)} in the workflow; use "
                        "NODE.INPUT instead")


def _declares(registry: Registry, node: Any, name: str, wanted_type: str) -> bool:
    cls = registry.get(node.get("class_type")) if isinstance(node, Mapping) and \
        isinstance(node.get("class_type"), str) else None
    if cls is None:
        return False
    declared = cls.INPUT_TYPES()
    spec = (declared.get("required") or {}).get(name) or (declared.get("optional") or {}).get(name)
    return spec is not None and input_spec(spec)[0] == wanted_type


def _typed(key: str, target: Target, value: Any) -> Any:
    try:
        return parse_value(target.input_type, value, target.node_checks)
    except OverrideError as exc:
        raise SweepError(f"sweep key {key!r}, value {value!r}: {exc}") from None


def job_key(workflow: Mapping, scope: str = "") -> str:
    """A stable hash of what a job runs: class types and inputs (titles and layout excluded),
    and `scope`: where it runs and writes (see job_scope)."""
    essence = {node_id: {"class_type": node.get("class_type"), "inputs": node.get("inputs")}
               for node_id, node in workflow.items() if isinstance(node, Mapping)}
    if scope:
        essence = {"workflow": essence, "scope": scope}
    text = json.dumps(essence, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      default=repr)
    # a lone surrogate (a JSON escape of half a character) has no UTF-8: kept as its code unit
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# -- the results file --------------------------------------------------------------------------

class ResultsLog:
    """An append-only JSONL file of finished jobs. Each line is written with flush + fsync, so a
    crash leaves at most a torn last line, which reading skips with a warning."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict] = []
        self.warnings: list[str] = []
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_bytes().split(b"\n")
        last = len(lines) - 1
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
            except ValueError:
                where = "its last line is incomplete (an interrupted write)" if number - 1 == last \
                    else f"line {number} is not a JSON object"
                self.warnings.append(f"results file {self.path}: {where}; ignored")
                continue
            self.records.append(record)

    def succeeded(self) -> set[str]:
        return {r.get("job_key") for r in self.records if r.get("status") == "success"}

    def orphans(self, key: str) -> dict[str, tuple[str, str | None]]:
        """{node id: (file, token)} of the "writing" lines of `key`'s last attempt, when that
        attempt ended without a line of its own (the process was killed); empty otherwise."""
        written: dict[str, tuple[str, str | None]] = {}
        for record in self.records:
            if record.get("job_key") != key:
                continue
            if record.get("status") == "writing":
                token = record.get("token")
                written[str(record.get("node"))] = (str(record.get("file")),
                                                    None if token is None else str(token))
            else:
                written = {}  # a finished attempt: its files are accounted for
        return written

    def writing(self, key: str, node: str, path: str | Path, run_id: str,
                token: str | None = None) -> None:
        """Record, before a file is written, that this job writes it (with the token the file
        will carry)."""
        self.append({"job_key": key, "status": "writing", "node": str(node), "file": str(path),
                     "token": token, "run_id": run_id})

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: escaped, as JSON allows
            line = json.dumps(record, ensure_ascii=True, default=str) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            if f.tell() > 0 and not self._ends_with_newline():
                f.write(b"\n")  # close a torn line so this record stands on its own
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"


def job_scope(out: str | Path, server: str | None = None) -> str:
    """Where a job's files go: the resolved output folder, and the server when there is one
    (several servers, "URL1,URL2": a pool whose members are interchangeable, not named)."""
    folder = f"out={Path(out).resolve()}"
    if server and "," in server:
        return f"server-pool;{folder}"
    return f"server={server.rstrip('/')};{folder}" if server else folder


def result_record(job_key_value: str, settings: Mapping, *, status: str, seconds: float,
                  files: list[str], run_id: str | None = None, prompt_id: str | None = None,
                  peak: Mapping | None = None, error: str | None = None) -> dict:
    """One results line: what ran, where its files are, how long and how much memory."""
    record = {"job_key": job_key_value, "settings": dict(settings)}
    if prompt_id is not None:
        record["prompt_id"] = prompt_id
    else:
        record["run_id"] = run_id
    record.update({
        "status": status,
        "outputs": list(files),
        "seconds": round(seconds, 3),
        "peak_memory": dict(peak) if peak else {"allocated": None, "reserved": None, "rss": None},
        "error": error,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    return record
