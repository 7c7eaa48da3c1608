"""Who takes Ctrl-C (SIGINT), `kill` (SIGTERM) and a closed terminal (SIGHUP) during a run: one
rule for runs in this process, on one ComfyUI server and on several.

Each runner takes these signals with its own handler while it runs, so that any of them stops
the run the way Ctrl-C does and is recorded, and puts the previous handlers back afterwards. A
hangup (the terminal or the SSH session that started the run went away) would otherwise end the
process on the spot: no results line, and on servers our prompts left running.

A process that starts with SIGINT ignored is a background job: a non-interactive shell starts
`cmd &` so, and Python then installs no KeyboardInterrupt handler. The terminal's Ctrl-C is not
meant for it, so SIGINT stays ignored for the whole run; SIGTERM, which the shell leaves alone,
is the way to stop it. The same holds for the others: one ignored at the start stays ignored,
SIGHUP under `nohup` among them (the run then outlives its terminal, as `nohup` asks). Nothing
here takes an ignored signal over, so "ignored now" is "ignored when the process started",
unless the program embedding the runner chose to ignore it since.

Handlers are installed in the main thread only (the only one where Python runs them); a
StopSignals inside another one leaves the signals to the outer one, whose handler knows the
whole run (the single-server runner around Client.run).
"""

from __future__ import annotations

import contextlib
import signal
import threading

# SIGHUP where the platform has it (not on Windows)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + (
    (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
# What a handler not set from Python (signal.signal answered None) is put back as.
_DEFAULT = {signum: signal.SIG_DFL for signum in STOP_SIGNALS} | {
    signal.SIGINT: signal.default_int_handler}


def ignored(signum: int) -> bool:
    """The signal is ignored in this process (for SIGINT: a background job's start, see above)."""
    return signal.getsignal(signum) == signal.SIG_IGN


def sigint_ignored() -> bool:
    return ignored(signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """The STOP_SIGNALS (SIGINT, SIGTERM, SIGHUP) within the block are counted (`count`, the
    first one's number in `signum`) and go to `handler(signum, frame)` where one is given: in
    the main thread, each unless it is ignored or an outer StopSignals has it. `signals` lists
    those taken (`taken`: any); the previous handlers are back afterwards (Python's own where
    the previous one was not set from Python)."""

    def __init__(self, handler=None):
        self.handler = handler
        self.count = 0
        self.signum: int | None = None
        self.signals: tuple[int, ...] = ()
        self.previous: dict[int, object] = {}

    @property
    def taken(self) -> bool:
        return bool(self.signals)

    def _dispatch(self, signum, frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.handler is not None:
            self.handler(signum, frame)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        taken = []
        for signum in STOP_SIGNALS:
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN or isinstance(getattr(current, "__self__", None),
                                                       StopSignals):
                continue
            try:
                self.previous[signum] = signal.signal(signum, self._dispatch)
            except ValueError:  # not the main interpreter
                break
            taken.append(signum)
        self.signals = tuple(taken)
        return self

    def __exit__(self, *exc) -> None:
        for signum in reversed(self.signals):
            previous = self.previous.pop(signum)
            signal.signal(signum, previous if previous is not None else _DEFAULT[signum])
        self.signals = ()


class FirstStopRaises(StopSignals):
    """The first stop signal raises KeyboardInterrupt, as Python's own SIGINT handler
    does; later ones are only counted, so that they cannot cut short the cleanup the first one
    started (a server's cancel requests, the results line).

    With anywhere=False the first one raises only inside a `stoppable()` block (the parts of a
    run that may be cut: waiting for a server), or at the start of the next such block where it
    came outside one (writing the results line); the runner also reads `count` between jobs."""

    def __init__(self, anywhere: bool = True):
        super().__init__(self._handle)
        self.raised = False
        self.raising = anywhere

    def _handle(self, signum, frame) -> None:
        self._raise_once()

    def _raise_once(self) -> None:
        if self.count and self.raising and not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def stoppable(self):
        raising = self.raising
        self.raising = True
        try:
            self._raise_once()  # one that came since the last block
            yield
        finally:
            self.raising = raising
