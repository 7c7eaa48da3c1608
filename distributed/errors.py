"""The errors of the several-GPU path."""

from __future__ import annotations


class WorkerFailed(RuntimeError):
    """A rank of the worker group failed or died; the group has been shut down and the next
    run starts a fresh one. The message names the rank, its device and why (the rank's
    traceback, when it sent one, after the message)."""

    def __init__(self, rank: int | None, device: str | None, reason: str):
        self.rank, self.device = rank, device
        headline, _, self.details = reason.partition("\n")
        self.reason = headline.rstrip(".")
        where = "the worker group" if rank is None else f"rank {rank} ({device})"
        message = (f"{where} failed: {self.reason}. The worker group was shut down; the next "
                   f"run starts a fresh one")
        if self.details.strip():
            message += f"\n\nrank {rank}'s traceback:\n{self.details.rstrip()}"
        super().__init__(message)


class WorkerInterrupted(Exception):
    """Raised inside every rank when the run was asked to stop (all ranks at the same step)."""
