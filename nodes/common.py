"""What every node shares: the category, node-error wrapping and memory events."""

from __future__ import annotations

import contextlib

CATEGORY = "Wan Enhanced"


class AnyType(str):
    """A wire type that fits every other, on an input and on an output.

    ComfyUI's POST /prompt compares a link's output type with the input's through `!=` (equal
    types fit; a plain "*" is no wildcard there), and its graph editor lets "*" connect to
    anything. A str "*" whose `!=` always answers False is both: it is sent to the editor as
    "*", and /prompt (and our runner, runner/workflow.py) find it equal to every type, also
    when it stands on the right of the comparison (Python asks the subclass first)."""

    def __ne__(self, other) -> bool:
        return False

    __hash__ = str.__hash__


ANY = AnyType("*")


class NodeInputError(ValueError):
    """A bad input, reported with the node's display name and the field."""


class NodeRunError(RuntimeError):
    """A failure while the node ran that is not its inputs' fault (a GPU worker process that
    failed), reported with the node's display name."""


# ComfyUI names a failed node's exception by its class's module, which for a custom node it
# loaded is the folder's path on the server: the package's name instead
for _error in (NodeInputError, NodeRunError):
    _error.__module__ = "wan_enhanced.nodes.common"


@contextlib.contextmanager
def node_errors(node: str):
    """Re-raise input and checkpoint errors with the node's name in front: the message then says
    which node and which field, and the process stays usable."""
    from ..checkpoints.reader import CheckpointError
    from ..distributed.errors import WorkerFailed
    from ..host import ModelNameError, hide_server_paths
    from ..pipeline.errors import InputError
    from ..safe_paths import UnsafePathError

    try:
        yield
    except (CheckpointError, InputError, UnsafePathError, ModelNameError,
            FileNotFoundError) as exc:
        raise NodeInputError(f"{node}: {hide_server_paths(str(exc))}") from exc
    except WorkerFailed as exc:
        raise NodeRunError(f"{node}: {hide_server_paths(str(exc))}") from exc


# the decode nodes' event when their frames are decoded (the bench splits a node that also
# writes the video there: runner/bench_phases.py)
DECODE_DONE = "decode done"


def memory_event(label: str, stage: str, node_id=None, **extra) -> None:
    """One event in the run's memory log (profiling/events.py)."""
    from ..profiling.events import record_event

    record_event(label, stage=stage, node=str(node_id or ""), extra=extra or None)


def progress_bar(display: str):
    """progress(done, total) driving the host's progress bar for node `display`, the bar made at
    the first call (when the total is known)."""
    from .. import host

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        bar = bar or host.Progress(total, display)
        bar.update_to(done)
    return progress
