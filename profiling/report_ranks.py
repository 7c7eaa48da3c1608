"""The report's per-rank table of a several-GPU run: what each rank of the worker group
recorded (distributed/metrics.py), one row per rank, one table per sampling run.

The sampler records one event per rank after a run (stage "ranks", the metrics in its extra).
"""

from __future__ import annotations

from dataclasses import dataclass

RANKS_STAGE = "ranks"
GIB = float(1 << 30)
MIB = float(1 << 20)


@dataclass
class RankRow:
    rank: int
    device: str
    request_total_s: float | None
    compute_s: float | None
    forwards: int | None
    all_to_all_s: float | None
    all_to_all_bytes: int | None
    ring_s: float | None
    ring_bytes: int | None
    gather_s: float | None
    cfg_s: float | None
    cfg_bytes: int | None
    device_peak: int | None  # the allocator's reserved peak and what the rank held outside it
    weights: int | None


@dataclass
class RankRun:
    gpus: int | None
    fsdp: bool | None
    cfg_parallel: bool | None
    rows: list[RankRow]


def rank_runs(data: dict) -> list[RankRun]:
    """The per-rank tables in the log, in run order (a new table starts at each rank 0)."""
    runs: list[RankRun] = []
    for event in data["events"]:
        extra = event.get("extra") or {}
        if event.get("stage") != RANKS_STAGE or not isinstance(extra.get("rank"), int):
            continue
        if extra["rank"] == 0 or not runs:
            runs.append(RankRun(extra.get("gpus"), extra.get("fsdp"), extra.get("cfg_parallel"),
                                []))
        runs[-1].rows.append(_row(extra))
    return runs


def _row(extra: dict) -> RankRow:
    get = extra.get
    return RankRow(get("rank"), str(get("device", "?")), get("request_total_seconds"),
                   get("compute_seconds"), get("forwards"), get("all_to_all_seconds"),
                   get("all_to_all_bytes"), get("ring_seconds"), get("ring_bytes"),
                   get("gather_seconds"), get("cfg_seconds"), get("cfg_bytes"),
                   device_peak(extra), get("weight_bytes"))


def device_peak(metrics: dict) -> int | None:
    """Of one rank's metrics (distributed/metrics.py): the allocator's reserved peak plus what
    the rank held outside the allocator (with fsdp on GPUs its chunks of the blocks, in
    symmetric memory); None without a GPU peak."""
    reserved = metrics.get("reserved_peak_bytes")
    return None if reserved is None else reserved + (metrics.get("outside_allocator_bytes") or 0)


def render_ranks(runs: list[RankRun]) -> list[str]:
    if not runs:
        return []
    lines = ["", "## Several GPUs: per rank", "",
             "Each rank of the worker group, per sampling run: its whole request, the compute "
             "inside its model forwards (forwards less the communication in them), the "
             "communication (Ulysses all-to-all, ring passes, the velocities swapped between "
             "CFG halves) with the bytes this rank sent, and its device peak (the allocator's "
             "reserved peak plus what it held outside the allocator: with fsdp on GPUs its chunks "
             "of the blocks)."]
    for number, run in enumerate(runs, 1):
        mode = ", ".join(part for part in (
            f"{run.gpus} ranks" if run.gpus else None, "fsdp" if run.fsdp else None,
            "CFG parallel" if run.cfg_parallel else None) if part)
        lines += ["", f"Run {number} ({mode}):", "",
                  "| rank | device | request s | compute s | forwards | all-to-all s | "
                  "all-to-all MiB | ring s | ring MiB | gather s | CFG swap s | CFG MiB | "
                  "device peak GiB | weights GiB |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in run.rows:
            lines.append(
                f"| {r.rank} | {r.device} | {_s(r.request_total_s)} | {_s(r.compute_s)} | "
                f"{r.forwards if r.forwards is not None else 'n/a'} | {_s(r.all_to_all_s)} | "
                f"{_mib(r.all_to_all_bytes)} | {_s(r.ring_s)} | {_mib(r.ring_bytes)} | "
                f"{_s(r.gather_s)} | {_s(r.cfg_s)} | {_mib(r.cfg_bytes)} | "
                f"{_gib(r.device_peak)} | {_gib(r.weights)} |")
    return lines


def _s(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _gib(value) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"
