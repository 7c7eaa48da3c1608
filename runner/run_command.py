"""`wan-enhanced run WORKFLOW.json`: run an API-format workflow in this process or on a server.

In this process (the default) the nodes come from this package's registry, models from --models
and files go to --out. With --server the workflow is queued on a running ComfyUI and its output
files are downloaded into --out. --set changes inputs; --sweep runs every combination of a sweep
file and appends one line per job to --results, skipping jobs that already succeeded there.

Exit codes: 0 every job succeeded, 1 a job failed or was interrupted (Ctrl-C, or SIGTERM: a run
stopped by `kill` is recorded and exits like one stopped by Ctrl-C, not with the shell's 143),
2 the workflow, a --set or the sweep is invalid (nothing ran).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable, Mapping, Sequence, TextIO

from .. import host
from .client import (Client, PromptRejected, RemoteInterrupted, RemoteRunError, ServerError)
from .stop_signals import FirstStopRaises, StopSignals, signal_name
from .executor import RunError, RunEvent, RunInterrupted, execute
from .server_pool import run_on_servers, server_urls
from .overrides import OverrideError, apply_overrides
from .sweep import (ResultsLog, Sweep, SweepError, SweepJob, expand_sweep, job_key, job_scope,
                    load_sweep, result_record)
from .sweep_checks import SweepVerdict, check_job, check_sweep
from .workflow import WorkflowError, load_workflow, validate

OK, FAILED, INVALID = 0, 1, 2


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="run an API-format workflow here, or queue it on a ComfyUI server",
        description="Runs an API-format workflow (ComfyUI: File > Export (API)) with this "
                    "package's nodes in this process, or on a running ComfyUI with --server. "
                    "Exit codes: 0 success, 1 a run failed or was interrupted, 2 invalid "
                    "workflow or arguments.")
    p.add_argument("workflow", metavar="WORKFLOW.json")
    p.add_argument("--set", dest="assignments", action="append", default=[],
                   metavar="NODE.INPUT=VALUE",
                   help="change an input; NODE is a node id, class_type or title "
                        "(e.g. --set 3.steps=20); repeatable")
    p.add_argument("--models", metavar="DIR",
                   help="models folder for in-process runs (holds diffusion_models/, "
                        "text_encoders/, vae/)")
    p.add_argument("--input", metavar="DIR",
                   help="input folder for in-process runs: where LoadImage finds its image "
                        "(default: ./input; an absolute path in the workflow also works)")
    p.add_argument("--out", metavar="DIR", default="output",
                   help="output folder (default: ./output); with --server, where the outputs "
                        "are downloaded")
    p.add_argument("--server", metavar="URL[,URL...]",
                   help="queue on this ComfyUI server (e.g. http://127.0.0.1:8188) instead of "
                        "running here; several URLs, comma-separated, share a sweep (one job "
                        "at a time each, their files under --out/HOST-PORT/)")
    p.add_argument("--sweep", metavar="FILE",
                   help='JSON object of values to vary, e.g. {"seed": [1, 2], "3.steps": '
                        '[10, 20]}; keys are NODE.INPUT or prompt / negative / seed')
    p.add_argument("--results", metavar="FILE",
                   help="JSONL file that gets one line per finished job; jobs that already "
                        "succeeded there are skipped (default with --sweep: "
                        "SWEEP.results.jsonl)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)


def run(args) -> int:
    err = sys.stderr
    client = None
    pool = None
    if args.server and "," in args.server:
        try:
            pool = [Client(url, log=lambda m: print(m, file=err))
                    for url in server_urls(args.server)]
            registry = pool[0].registry()
            for other in pool[1:]:
                other.object_info()  # every server answers before the first job goes out
        except ValueError as exc:
            print(f"error: {exc}", file=err)
            return INVALID
        except ServerError as exc:
            print(f"error: {exc}", file=err)
            return FAILED
    elif args.server:
        client = Client(args.server, log=lambda m: print(m, file=err))
        try:
            registry = client.registry()
        except ServerError as exc:
            print(f"error: {exc}", file=err)
            return FAILED
    else:
        host.set_headless_folders(args.models, args.out, args.input)
        registry = _local_registry()
    try:
        workflow = load_workflow(args.workflow, registry)
    except WorkflowError as exc:
        print(exc, file=err)
        return INVALID

    try:
        workflow = apply_overrides(workflow, args.assignments, registry)
        jobs = _jobs(workflow, args, registry)
    except (OverrideError, SweepError) as exc:
        print(f"error: {exc}", file=err)
        return INVALID

    try:
        results = _results_log(args)
    except OSError as exc:
        print(f"error: cannot read the results file {exc.filename}: {exc.strerror}", file=err)
        return INVALID
    if results is not None:
        for warning in results.warnings:
            print(f"warning: {warning}", file=err)
        done = results.succeeded()
        skipped = sum(1 for job in jobs if job.job_key in done) if done else 0
        if skipped:
            print(f"{skipped} of {len(jobs)} job(s) already succeeded in {results.path}; "
                  "skipping them", file=err)
    else:
        done, skipped = set(), 0
    # built one at a time as they run: a sweep of 10^5 jobs never holds them all
    pending = (job for job in jobs if job.job_key not in done)

    display = ProgressDisplay(err, enabled=not args.quiet)
    if pool is not None:
        return run_on_servers(pool, pending, len(jobs) - skipped, len(jobs), args.out, results)
    if client is None:
        return _run_here(jobs, pending, args, registry, results, display)
    try:
        return _run_on_server(client, pending, len(jobs), args, results, display)
    except KeyboardInterrupt:  # a signal the runner's handler did not take
        display.close()
        print("interrupted", file=err)
        return FAILED


# -- jobs --------------------------------------------------------------------------------------

def _local_registry() -> Mapping[str, type]:
    from .headless_nodes import local_registry
    return local_registry()


def _jobs(workflow: dict, args, registry) -> Sequence[SweepJob]:
    if args.sweep:
        return expand_sweep(workflow, load_sweep(args.sweep), registry, _scope(args))
    return [SweepJob(1, {}, workflow, job_key(workflow, _scope(args)))]


def _scope(args) -> str:
    return job_scope(args.out, args.server)  # several servers: one pool, not named


def _results_log(args) -> ResultsLog | None:
    if args.results:
        return ResultsLog(args.results)
    if args.sweep:
        sweep = Path(args.sweep)
        return ResultsLog(sweep.with_name(sweep.stem + ".results.jsonl"))
    return None


def _job_header(job: SweepJob, total: int) -> str | None:
    if not job.settings:
        return None
    settings = "  ".join(f"{k}={v!r}" for k, v in job.settings.items())
    return f"job {job.index}/{total}: {settings}"


# -- in this process ---------------------------------------------------------------------------

def _run_here(jobs: Sequence[SweepJob], pending: Iterable[SweepJob], args, registry,
              results: ResultsLog | None, display: "ProgressDisplay") -> int:
    """Every job is checked before the first one runs (sweep_checks.py: without validating
    each job of a large sweep); each is validated again just before it runs."""
    err = sys.stderr
    total = len(jobs)
    if isinstance(jobs, Sweep):
        verdict = check_sweep(jobs, registry, source=args.workflow)
    else:
        verdict = SweepVerdict()
        try:
            verdict.first = check_job(jobs[0], registry, args.workflow)
        except WorkflowError as exc:
            print(exc, file=err)
            return INVALID
    if verdict.invalid:
        for job, problems in verdict.reports:  # each problem once, under the first job with it
            print(_job_header(job, total) + "\n" + "\n".join(f"  - {line}" for line in problems),
                  file=err)
        print(f"{verdict.invalid} of {total} job(s) are invalid; nothing ran", file=err)
        return INVALID
    for warning in verdict.first.warnings if verdict.first is not None else ():
        print(f"warning: {warning}", file=err)

    stop = _StopRequest()
    try:
        with stop.installed():
            return _run_jobs_here(pending, total, args.workflow, registry, results, display,
                                  stop)
    except KeyboardInterrupt:  # a signal the runner's handler did not take
        display.close()
        print("interrupted", file=err)
        return FAILED


def _run_jobs_here(jobs, total, source, registry, results, display, stop) -> int:
    err = sys.stderr
    status = OK
    for job in jobs:
        if stop.requested:
            print("stopped before the next job", file=err)
            return FAILED
        try:  # again: a file a loader names may have changed since the sweep was checked
            validated = check_job(job, registry, source)
        except WorkflowError as exc:
            print(f"{_job_header(job, total) or 'the job'}: {exc}", file=err)
            if results is not None:
                results.append(result_record(job.job_key, job.settings, status="error",
                                             seconds=0.0, files=[], run_id=None,
                                             error=str(exc)))
            status = FAILED
            continue
        if results is not None and _recovered(job, validated, results, total):
            continue
        header = _job_header(job, total)
        if header:
            print(header, file=err)
        run_id = uuid.uuid4().hex
        started = time.perf_counter()
        listener = _file_recorder(results, job, run_id)
        host.add_output_listener(listener)
        try:
            with stop.stoppable():
                result = execute(validated, registry, on_event=display, run_id=run_id)
        except (RunError, KeyboardInterrupt) as exc:  # KeyboardInterrupt: a second signal
            display.close()
            interrupted = isinstance(exc, (RunInterrupted, KeyboardInterrupt))
            message = str(exc) or "interrupted"
            print(f"{'interrupted' if interrupted else 'failed'}: {message}", file=err)
            if results is not None:
                results.append(result_record(
                    job.job_key, job.settings, status="interrupted" if interrupted else
                    "error", seconds=time.perf_counter() - started, files=[], run_id=run_id,
                    error=message))
            if interrupted:
                return FAILED
            status = FAILED
            continue
        finally:
            host.remove_output_listener(listener)
        display.close()
        _print_summary(result.seconds, result.peak.as_dict(), result.files)
        if results is not None:
            results.append(result_record(
                job.job_key, job.settings, status="success", seconds=result.seconds,
                files=result.files, run_id=result.run_id, peak=result.peak.as_dict()))
    return status


def _file_recorder(results: ResultsLog | None, job: SweepJob, run_id: str):
    """Output listener writing a job's "writing" lines (no results file: nothing to record)."""
    def record(node_id: str, path, token=None) -> None:
        if results is not None:
            results.writing(job.job_key, node_id, path, run_id, token)
    return record


def _recovered(job: SweepJob, validated, results: ResultsLog, total: int) -> bool:
    """A job whose previous attempt wrote every video and was killed before its "success" line:
    recorded as succeeded from its files instead of running again."""
    from ..pipeline.video_io import read_tag

    orphans = results.orphans(job.job_key)
    savers = {node_id for node_id in validated.order
              if validated.nodes[node_id]["class_type"] in VIDEO_SAVERS}
    if not savers or not savers <= set(orphans):
        return False
    for node_id in savers:  # each file there, and written by that attempt (its token)
        file, token = orphans[node_id]
        if token is None or not Path(file).is_file() or read_tag(file) != token:
            return False
    files = [orphans[node_id][0] for node_id in sorted(savers)]
    record = result_record(job.job_key, job.settings, status="success", seconds=0.0,
                           files=files, run_id=None, error=None)
    record["recovered"] = True
    results.append(record)
    name = _job_header(job, total) or "the job"
    print(f"{name}: its video was written before the previous run stopped; recorded from "
          f"{', '.join(files)}, not run again", file=sys.stderr)
    return True


class _StopRequest:
    """Ctrl-C, `kill` (SIGTERM) or a hangup (SIGHUP) once: ask the running node to stop at its next
    check (between sampling steps, transformer blocks, a block's row chunks and decoded frames)
    and run no further job. A second one (either): stop at once, with exit code 1 (FAILED).

    A long operation inside PyTorch keeps the main thread, where Python runs signal handlers,
    for as long as it takes (minutes for one attention at 8192x8192). So a watcher thread sees
    each signal the moment it arrives (through signal.set_wakeup_fd): the first sets the
    interrupt flag at once; after the second, the main thread gets STOP_GRACE_S seconds to stop
    and clean up (its handler raises KeyboardInterrupt as soon as it runs, while a job runs:
    never in the job's results line), then the process exits with code 1 unless the run is over
    by then; hidden .partial files such an exit may leave are cleaned up by the next run
    (atomic_files.remove_stale_partials). A run that started with SIGINT ignored (a background
    job) keeps ignoring it; SIGTERM stops it all the same (stop_signals)."""

    def __init__(self):
        self.requested = False
        self.count = 0  # signals seen by the main thread's handler
        self.running = False  # a job runs (`stoppable`): a second signal may cut it
        self.over = threading.Event()  # the run is over: no exit from the watcher

    def _handle(self, signum, frame):
        self.count += 1
        self.requested = True
        host.request_interrupt()
        if self.count >= 2 and self.running:
            self.running = False  # once: what follows records the job
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def stoppable(self):
        """Around a job's execution, the one place a second signal raises KeyboardInterrupt."""
        if self.requested:  # came after the check before this job, which would clear the flag
            raise KeyboardInterrupt
        self.running = True
        try:
            yield
        finally:
            self.running = False

    def on_signal(self, seen: int, signum: int) -> None:
        """The watcher thread's reaction to the `seen`-th signal, `signum`."""
        self.requested = True
        host.request_interrupt()
        if seen == 1:
            _say("\nstopping at the next check; Ctrl-C again to stop at once"
                 if signum == signal.SIGINT else
                 f"\n{signal_name(signum)}: stopping at the next check; a second "
                 f"{signal_name(signum)} stops at once")
            return
        _say(f"\nstopping now (exit code {FAILED})")
        if self.over.wait(STOP_GRACE_S):
            return  # the main thread stopped and is ending the run
        _say("interrupted")
        os._exit(FAILED)  # the main thread is stuck in one long operation

    @contextlib.contextmanager
    def installed(self):
        try:
            with _SignalHandler(self._handle, self.on_signal):
                yield
        finally:
            self.over.set()


STOP_GRACE_S = 3.0
# the nodes that write a video a sweep's record names (and a rerun may recover)
VIDEO_SAVERS = ("WanEnhancedSaveVideo", "WanEnhancedDecodeSaveVideo")


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except Exception:  # a closed stream must not stop the stop
        pass


class _SignalHandler(StopSignals):
    """The stop signals (SIGINT, SIGTERM, SIGHUP) to `handler` in the main thread, and to
    `watch(n, signum)` for the n-th one in a daemon thread the moment it arrives; neither where
    the signal is ignored (the rule of stop_signals)."""

    def __init__(self, handler, watch):
        super().__init__(handler)
        self.watch = watch
        self.previous_fd = self.sockets = None

    def __enter__(self):
        if not super().__enter__().taken:
            return self
        try:
            self.sockets = socket.socketpair()
            for end in self.sockets:
                end.setblocking(False)
            self.previous_fd = signal.set_wakeup_fd(self.sockets[1].fileno(),
                                                    warn_on_full_buffer=False)
        except (OSError, ValueError):  # no wakeup descriptor here: handler only
            self.sockets = None
            return self
        threading.Thread(target=self._watch, args=(self.sockets[0], self.signals), daemon=True,
                         name="wan-enhanced-stop-signals").start()
        return self

    def _watch(self, reader, signals) -> None:
        seen = 0
        while True:
            try:
                select.select([reader], [], [])
                data = reader.recv(64)
            except (OSError, ValueError):
                return  # closed: the run is over
            if not data:
                return
            for signum in data:
                if signum in signals:
                    seen += 1
                    self.watch(seen, signum)

    def __exit__(self, *exc):
        if self.sockets is not None:
            signal.set_wakeup_fd(self.previous_fd if self.previous_fd is not None else -1)
            for end in self.sockets:
                end.close()
            self.sockets = None
        super().__exit__(*exc)
        host.clear_interrupt()


# -- on a server -------------------------------------------------------------------------------

def _run_on_server(client: Client, jobs: list[SweepJob], total: int, args,
                   results: ResultsLog | None, display: "ProgressDisplay") -> int:
    """Ctrl-C or SIGTERM while a job's prompt is followed interrupts it on the server (Client.run
    under this handler); anywhere else in a job (posting it, downloading its files) it is
    recorded as interrupted too; between jobs (its results line) the run stops before the next.
    Only the first signal counts, so later ones cannot cut the cancel requests or the line."""
    stop = FirstStopRaises(anywhere=False)
    with stop:
        return _run_jobs_on_server(client, jobs, total, args, results, display, stop)


def _run_jobs_on_server(client, jobs, total, args, results, display, stop) -> int:
    err = sys.stderr
    status = OK
    for job in jobs:
        if stop.count:
            print("stopped before the next job", file=err)
            return FAILED
        header = _job_header(job, total)
        if header:
            print(header, file=err)
        started = time.perf_counter()
        try:
            try:
                with stop.stoppable():
                    result = client.run(job.workflow, args.out, on_event=display)
            except KeyboardInterrupt:  # outside the prompt's wait, which cancels it itself
                raise RemoteInterrupted("", "interrupted") from None
        except (PromptRejected, RemoteRunError, RemoteInterrupted, ServerError) as exc:
            display.close()
            print(f"{'error' if isinstance(exc, PromptRejected) else 'failed'}: {exc}", file=err)
            if results is not None:
                kind = "interrupted" if isinstance(exc, RemoteInterrupted) else "error"
                results.append(result_record(job.job_key, job.settings, status=kind,
                                             seconds=time.perf_counter() - started, files=[],
                                             prompt_id=getattr(exc, "prompt_id", None) or "",
                                             error=str(exc)))
            if isinstance(exc, PromptRejected):
                return INVALID
            if isinstance(exc, RemoteRunError):
                status = FAILED
                continue
            return FAILED  # interrupted, or the server is gone: the next jobs would fail too
        display.close()
        _print_summary(result.seconds, None, result.files)
        if results is not None:
            results.append(result_record(job.job_key, job.settings, status="success",
                                         seconds=result.seconds, files=result.files,
                                         prompt_id=result.prompt_id))
    return status


# -- output ------------------------------------------------------------------------------------

def _print_summary(seconds: float, peak: Mapping | None, files: list[str]) -> None:
    parts = [f"finished in {format_seconds(seconds)}"]
    if peak:
        if peak.get("allocated") is not None:
            parts.append(f"peak GPU {format_bytes(peak['allocated'])} allocated, "
                         f"{format_bytes(peak['reserved'])} reserved")
        if peak.get("rss") is not None:
            parts.append(f"peak RSS {format_bytes(peak['rss'])}")
    print("; ".join(parts))
    for path in files:
        print(f"  {path}")


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s"


def format_bytes(count: int | None) -> str:
    if count is None:
        return "?"
    return f"{count / 2**30:.2f} GiB" if count >= 2**28 else f"{count / 2**20:.0f} MiB"


class ProgressDisplay:
    """One progress line per node: name, step i/total, elapsed. On a terminal the line is
    redrawn in place with \\r; otherwise plain lines, progress at most once a second."""

    def __init__(self, stream: TextIO, enabled: bool = True):
        self.stream, self.enabled = stream, enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.open_width = 0  # characters of the line being redrawn, 0 when none
        self.last_progress = 0.0

    def __call__(self, event: RunEvent) -> None:
        if not self.enabled:
            return
        position = f"[{event.index}/{event.count}]" if event.count else \
            (f"[{event.index}]" if event.index else "")
        name = f"{position} {event.name}".strip()
        if event.kind == "start":
            self.last_progress = 0.0
            self._draw(f"{name} ...", final=False)
        elif event.kind == "progress":
            line = f"{name}  step {event.value}/{event.total}  {format_seconds(event.seconds)}"
            # plain lines: the first, the last, and at most one a second in between
            if self.tty or event.value >= event.total or \
                    time.monotonic() - self.last_progress >= 1.0:
                self.last_progress = time.monotonic()
                self._draw(line, final=False)
        elif event.kind == "finish":
            self._draw(f"{name}  done in {format_seconds(event.seconds)}", final=True)
        elif event.kind == "cached":
            self._draw(f"{event.name}  cached on the server", final=True)

    def _draw(self, line: str, final: bool) -> None:
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            line = line[:width]
            self.stream.write("\r" + line.ljust(self.open_width))
            self.open_width = 0 if final else len(line)
            if final:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a line left open (a failure in the middle of a node)."""
        if self.tty and self.open_width:
            self.stream.write("\n")
            self.stream.flush()
            self.open_width = 0
