"""The warm worker group: one process per GPU (gloo processes on the CPU), started once and
reused by every run until its size changes, it fails, or the process exits.

The driver (ComfyUI's process, or our command line) is not a rank: no process group, NCCL state
or GPU memory of the group lives in it. It starts the ranks with torch.multiprocessing (spawn),
gives them a loopback rendezvous (a TCPStore listening on 127.0.0.1 only, on a free port), sends
each run's task and inputs down every rank's pipe and waits for rank 0's result, relaying
progress and watching for interrupts and failures meanwhile:

- interrupt: when the driver's `interrupt()` raises, every rank is sent "stop"; the ranks agree
  on it at their next step (WorkerState.check_stop) and rank 0 answers "interrupted"; the driver
  then re-raises the interrupt. Ranks that do not stop within `stop_grace_s` are shut down.
- failure: a rank that reports an error or dies ends the group (the others may wait in a
  collective forever); WorkerFailed names the rank, its device and why. The next run starts a
  fresh group.
- shutdown: every rank frees its cache, the process group and its GPU memory and exits; stragglers
  are terminated. At interpreter exit the group is shut down too.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import threading
import time
from typing import Any, Callable

from .errors import WorkerFailed
from .contracts import Float32Settings
from .launch import loopback_store, raised_in, spawn_ranks
from .messages import receive, send

logger = logging.getLogger(__name__)
PACKAGE_NAME = __name__.rsplit(".", 2)[0]
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 120.0
POLL_S = 0.1
# after a failure the other ranks may wait in a collective forever: a short wait, then terminate
FAILED_RANKS_GRACE_S = 2.0


class WorkerGroup:

    def __init__(self, world: int, device_type: str = "cuda",
                 start_timeout_s: float = START_TIMEOUT_S):
        if world < 1:
            raise ValueError(f"a worker group needs at least one rank, got {world}")
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"device type {device_type!r}: expected 'cuda' or 'cpu'")
        self.world, self.device_type = world, device_type
        self.start_timeout_s = start_timeout_s
        self.context = None
        self.conns: list = []
        self.store = None
        self.info: list[dict] = []
        self.renames: tuple = ()  # the ranks' package name -> ours (messages.py)

    def device_name(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device_type == "cuda" else f"CPU process {rank}"

    @property
    def alive(self) -> bool:
        return self.context is not None and all(p.is_alive() for p in self.context.processes)

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> "WorkerGroup":
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(self.world)]
        self.conns = [parent for parent, _ in pipes]
        self.store, port = loopback_store(self.start_timeout_s)
        prefix = f"wan-enhanced-{secrets.token_hex(4)}/"
        threads = max(1, (os.cpu_count() or 1) // self.world)
        self.context = spawn_ranks(self.world, (self.world, self.device_type, port, prefix,
                                                [child for _, child in pipes], threads))
        for _, child in pipes:
            child.close()
        try:
            self._await_ready()
        except BaseException:
            self.shutdown(FAILED_RANKS_GRACE_S)
            raise
        logger.info("wan-enhanced: started %d worker process(es) on %s", self.world,
                    ", ".join(self.device_name(r) for r in range(self.world)))
        return self

    def _await_ready(self) -> None:
        waiting = set(range(self.world))
        self.info = [{} for _ in range(self.world)]
        deadline = time.monotonic() + self.start_timeout_s
        while waiting:
            if time.monotonic() > deadline:
                ranks = ", ".join(str(r) for r in sorted(waiting))
                raise WorkerFailed(None, None, f"rank(s) {ranks} did not start within "
                                               f"{self.start_timeout_s:.0f} s")
            for rank, message in self._messages():
                if message[0] == "ready":
                    waiting.discard(rank)
                    self.info[rank] = message[2]
                    self.renames = ((message[2]["package"], PACKAGE_NAME),)
                else:
                    self._fail_on(rank, message)

    # -- running -------------------------------------------------------------------------------

    def run(self, task: str, payload: Any = None, *,
            on_progress: Callable[[Any], None] | None = None,
            interrupt: Callable[[], None] | None = None,
            stop_grace_s: float = STOP_GRACE_S, timeout_s: float | None = None) -> Any:
        """Run `task` ("module:function", worker.resolve_task) on every rank with `payload`;
        return rank 0's result. `interrupt()` is polled while waiting: when it raises, the ranks
        stop at their next step and its exception is re-raised here. Without an answer within
        `timeout_s` (default: no limit) the group is shut down (WorkerFailed)."""
        if not self.alive:
            raise WorkerFailed(None, None, "it is not running")
        settings = Float32Settings.current()  # the ranks compute as this process would
        try:
            for rank, conn in enumerate(self.conns):
                try:
                    send(conn, ("task", task, payload, settings))
                except (BrokenPipeError, OSError) as exc:
                    raise WorkerFailed(rank, self.device_name(rank),
                                       f"it cannot be reached ({exc})") from None
            return self._await_result(on_progress, interrupt, stop_grace_s, timeout_s)
        except _Stopped as stopped:  # every rank stopped at the same step: the group is fine
            raise stopped.exc from None
        except BaseException:  # a failure, or an exception in the driver: the state is unknown
            self.shutdown(FAILED_RANKS_GRACE_S)
            raise

    def _await_result(self, on_progress, interrupt, stop_grace_s, timeout_s):
        stop: BaseException | None = None
        deadline = None
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if give_up is not None and time.monotonic() > give_up:
                raise WorkerFailed(None, None, f"no answer within {timeout_s:.0f} s")
            for rank, message in self._messages():
                kind = message[0]
                if kind == "progress" and on_progress is not None and stop is None:
                    try:
                        on_progress(message[1])
                    except BaseException as exc:  # noqa: BLE001 - ComfyUI's progress hook
                        stop, deadline = self._stopping(exc, stop_grace_s)  # checks interrupts
                elif kind == "result":
                    if stop is not None:  # finished its last step as the stop came
                        raise _Stopped(stop)
                    return message[1]
                elif kind == "interrupted":
                    raise _Stopped(stop or InterruptedByDriver())
                elif kind == "error":
                    self._fail_on(rank, message)
            if stop is None and interrupt is not None:
                try:
                    interrupt()
                except BaseException as exc:  # noqa: BLE001 - the host's interrupt, re-raised
                    stop, deadline = self._stopping(exc, stop_grace_s)
            if deadline is not None and time.monotonic() > deadline:
                raise stop  # run() shuts the group down: some rank did not stop

    def _stopping(self, exc: BaseException, grace_s: float) -> tuple[BaseException, float]:
        """Ask every rank to stop; (the exception to re-raise, when to give up on them)."""
        self._tell_every_rank(("stop",))
        return exc, time.monotonic() + grace_s

    def _tell_every_rank(self, message: tuple) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                send(conn, message)

    def _messages(self):
        """(rank, message) for every message waiting, after at most POLL_S of waiting; a rank
        whose process ended raises WorkerFailed (after its last messages are read)."""
        processes = self.context.processes
        ready = multiprocessing.connection.wait(
            self.conns + [p.sentinel for p in processes], timeout=POLL_S)
        for rank, conn in enumerate(self.conns):
            while conn in ready or _has_data(conn):
                ready = [r for r in ready if r is not conn]
                try:
                    yield rank, receive(conn, self.renames)
                except (EOFError, OSError):
                    break
        for rank, process in enumerate(processes):
            if process.sentinel in ready or not process.is_alive():
                process.join(timeout=1.0)
                if not process.is_alive():
                    self._fail_on(rank, ("exited", process.exitcode))

    def _fail_on(self, rank: int, message: tuple) -> None:
        kind = message[0]
        if kind == "error":
            reason = message[2]
        elif kind == "exited":
            reason = _exit_reason(message[1])
            raised = raised_in(self.context, rank)
            if raised:  # the rank raised outside its task loop (torch wrote the traceback)
                last = raised.strip().splitlines()[-1]
                reason = f"{last} ({reason})\n{raised}"
        else:
            reason = f"unexpected message {kind!r}"
        self.shutdown(FAILED_RANKS_GRACE_S)
        raise WorkerFailed(rank, self.device_name(rank), reason)

    # -- stopping ------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Every rank leaves; the ones that do not within `timeout_s` are terminated."""
        if self.context is None:
            return
        context, self.context = self.context, None
        for conn in self.conns:
            with contextlib.suppress(Exception):
                send(conn, ("shutdown",))
        deadline = time.monotonic() + timeout_s
        for process in context.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        self.conns = []
        for path in getattr(context, "error_files", []) or []:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.store = None


class InterruptedByDriver(Exception):
    """The ranks stopped although the driver's interrupt did not raise (the stop flag was set
    by someone else)."""

    def __init__(self):
        super().__init__("interrupted")


class _Stopped(Exception):
    """Carries the driver's interrupt out of the wait without shutting the healthy group down."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


def _has_data(conn) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return False


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "its process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the out-of-memory killer, or a kill from outside)" if name == "SIGKILL" else ""
        return f"its process was killed by {name}{hint}"
    return f"its process exited with code {code}"


# -- the process-wide group ----------------------------------------------------------------------

_GROUP: WorkerGroup | None = None
_GROUP_LOCK = threading.Lock()


def worker_group(world: int, device_type: str) -> WorkerGroup:
    """The warm group of this size and device type, started when there is none (another size's
    group is shut down first: one group at a time)."""
    global _GROUP
    with _GROUP_LOCK:
        group = _GROUP
        if group is not None and group.alive and (group.world, group.device_type) == (
                world, device_type):
            return group
        if group is not None:
            group.shutdown()
            _GROUP = None
        _GROUP = WorkerGroup(world, device_type).start()
        return _GROUP


def shutdown_worker_group() -> None:
    """Shut the warm group down (its GPU memory is freed when its processes exit)."""
    global _GROUP
    with _GROUP_LOCK:
        if _GROUP is not None:
            _GROUP.shutdown()
            _GROUP = None


atexit.register(shutdown_worker_group)
