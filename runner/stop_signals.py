"""Who takes Ctrl-C (SIGINT) during a run: one rule for runs in this process, on one ComfyUI
server and on several.

A process that starts with SIGINT ignored is a background job: a non-interactive shell starts
`cmd &` so, and Python then installs no KeyboardInterrupt handler. The terminal's Ctrl-C is not
meant for it, so SIGINT stays ignored for the whole run; SIGTERM is the way to stop it.
Otherwise each runner takes SIGINT with its own handler while it runs, so that Ctrl-C stops the
run and is recorded, and puts the previous handler back afterwards.

Nothing here takes an ignored SIGINT over, so "ignored now" is "ignored when the process
started", unless the program embedding the runner chose to ignore it since.
"""

from __future__ import annotations

import signal
import threading


def sigint_ignored() -> bool:
    """SIGINT is ignored in this process (a background job's start, see above)."""
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


class StopSignals:
    """`handler` takes SIGINT within the block: in the main thread (the only one where Python
    runs signal handlers) and unless SIGINT is ignored. `taken` says whether it did; the
    previous handler is back afterwards (Python's own where the previous one was not set from
    Python)."""

    def __init__(self, handler):
        self.handler = handler
        self.taken = False
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread() or sigint_ignored():
            return self
        try:
            self.previous = signal.signal(signal.SIGINT, self.handler)
        except ValueError:  # not the main interpreter
            return self
        self.taken = True
        return self

    def __exit__(self, *exc) -> None:
        if self.taken:
            signal.signal(signal.SIGINT, self.previous if self.previous is not None
                          else signal.default_int_handler)
            self.taken = False
