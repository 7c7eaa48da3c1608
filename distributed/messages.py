"""What the driver and the workers say to each other over their pipes.

Every message is a tuple pickled with the standard pickler into one send_bytes: tensors travel
by value inside the pickle (never through shared memory, which containers often keep at 64 MB),
and a worker never receives anything but plain data from the driver.

driver -> every rank:  ("task", task_ref, payload)   run a task (tasks.py)
                       ("shutdown",)                 leave the loop, free everything, exit
rank -> driver:        ("ready", rank, info)         after joining the process group
rank 0 -> driver:      ("progress", data)            a task's progress (a step done)
                       ("result", value)             the task's result
                       ("interrupted",)              every rank stopped at the same step
any rank -> driver:    ("error", rank, text)         the task failed there (the rank then exits)
"""

from __future__ import annotations

import pickle


def send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())
