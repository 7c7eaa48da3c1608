"""`wan-enhanced golden FILE...`: check our components against reference files; with
`--sequence-parallel N` the DiT files run with the model split over N CPU processes (gloo), and
with `--fsdp` also their blocks sharded over those processes.

Ctrl-C, `kill` (SIGTERM) or a hangup (SIGHUP) stops the command after the files checked so far
(runner/stop_signals.py): the file being checked is not counted, the worker processes are shut
down, and the command says so and exits 1."""

from __future__ import annotations

import argparse
import time

from ..conformance.check import check_file
from ..conformance.golden_file import GoldenFileError
from .stop_signals import FirstStopRaises


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "golden", help="run the component a reference file describes and compare every output",
        description="Reads files of the wan-golden/1 schema, runs the component each one "
                    "describes on the CPU in float32, prints the max absolute and max relative "
                    "error of every output, and exits non-zero when a tolerance is exceeded.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--sequence-parallel", type=_processes, default=1, metavar="N",
                   help="run the DiT files with the token sequence split over N CPU processes "
                        "(torch.distributed, gloo): Ulysses attention where the heads divide by "
                        "N, ring attention otherwise; other files run in this process")
    p.add_argument("--fsdp", action="store_true",
                   help="with --sequence-parallel: shard the DiT's blocks over the processes too "
                        "(each block gathered just before it computes), as the sampler's fsdp")
    p.set_defaults(func=run)


def _processes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") \
            from None
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{value} processes: expected 1 to 64")
    return value


def run(args) -> int:
    if args.fsdp and args.sequence_parallel < 2:
        print("ERROR --fsdp shards the blocks over the processes of --sequence-parallel N: "
              "expected N >= 2")
        return 2
    workers = _Workers(args.sequence_parallel)
    failed = checked = 0
    interrupted = False
    with FirstStopRaises():  # the first stop signal raises KeyboardInterrupt; later ones wait
        try:
            for path in args.files:
                failed += _check(path, args, workers)
                checked += 1
        except KeyboardInterrupt:
            interrupted = True
        finally:
            workers.shutdown()
    if interrupted:
        print(f"interrupted: {checked} of {len(args.files)} files checked, "
              f"{checked - failed} passed")
        return 1
    total = len(args.files)
    print(f"{total - failed}/{total} files passed")
    return 1 if failed else 0


class _Workers:
    """The worker group of the split checks: started by the first DiT file that runs split,
    shut down once all files are checked."""

    def __init__(self, world: int):
        self.world = world
        self.group = None

    def get(self):
        if self.group is None:
            self.group = _start_group(self.world)
        return self.group

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


def _check(path: str, args, workers: _Workers) -> int:
    """Check one file and print its scores: 1 where it failed (or could not be read), else 0."""
    start = time.perf_counter()
    note = ""
    try:
        if args.sequence_parallel > 1 and _is_dit(path):
            report, used = _split(path, workers.get(), args.fsdp)
            note = (f", split over {args.sequence_parallel} processes, {used} attention"
                    f"{', blocks sharded' if args.fsdp else ''}")
        else:
            report = check_file(path)
            if args.sequence_parallel > 1:
                note = ", in this process: only DiT files run split"
    except GoldenFileError as exc:
        print(f"ERROR {exc}")
        return 1
    print(f"{path} ({report.kind}{note}, {time.perf_counter() - start:.1f} s)")
    for s in report.scores:
        print("  " + s.line())
    return 0 if report.passed else 1


def _is_dit(path: str) -> bool:
    from ..conformance.golden_file import read_golden
    from ..distributed.golden import DIT_KINDS
    try:
        return read_golden(path).kind in DIT_KINDS
    except GoldenFileError:
        return False  # check_file says what is wrong with it


def _start_group(world: int):
    from ..distributed.group import WorkerGroup
    return WorkerGroup(world, "cpu").start()


def _split(path: str, group, fsdp: bool):
    from ..distributed.golden import check_file_split
    return check_file_split(path, group, fsdp=fsdp)
