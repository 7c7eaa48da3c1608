"""What the driver and the workers say to each other over their pipes.

Every message is a tuple pickled with the standard pickler into one send_bytes: tensors travel
by value inside the pickle (never through shared memory, which containers often keep at 64 MB),
and a worker never receives anything but plain data from the driver.

driver -> every rank:  ("task", task_ref, payload, Float32Settings)   run a task (tasks.py)
                       with the driver's float32 settings (contracts.py)
                       ("stop",)                     stop the task at the next step (interrupt)
                       ("shutdown",)                 leave the loop, free everything, exit
rank -> driver:        ("ready", rank, info)         after joining the process group
rank 0 -> driver:      ("progress", data)            a task's progress (a step done)
                       ("result", value)             the task's result
                       ("interrupted",)              every rank stopped at the same step
any rank -> driver:    ("error", rank, text)         the task failed there (the rank then exits)
"""

from __future__ import annotations

import io
import pickle

# The records (contracts.py) are pickled under their module's name, which is this package's name
# in the sending process. Inside ComfyUI that is the package folder's path, which a rank cannot
# import; a rank loads the package under another name (boot module). The receiving side renames
# the sender's package to its own.
Renames = tuple[tuple[str, str], ...]


def send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn, renames: Renames = ()) -> tuple:
    return _Unpickler(io.BytesIO(conn.recv_bytes()), renames).load()


class _Unpickler(pickle.Unpickler):

    def __init__(self, file, renames: Renames):
        super().__init__(file)
        self.renames = [(theirs, ours) for theirs, ours in renames if theirs != ours]

    def find_class(self, module: str, name: str):
        for theirs, ours in self.renames:
            if module == theirs or module.startswith(theirs + "."):
                module = ours + module[len(theirs):]
                break
        return super().find_class(module, name)
