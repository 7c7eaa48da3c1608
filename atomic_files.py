"""Writing files atomically: readers see the previous file or the complete new one, never part.

Everything the package writes (videos, event logs, reports, checkpoints made for tests) goes to
a hidden temporary file beside its destination and is renamed over it when complete; on any
failure, interrupts included, the temporary file is removed and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_target(path: str | Path, what: str = "the file",
                  make_folder: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; renamed onto `path` when the block
    completes, removed when it raises. An OSError names `what` and the folder."""
    path = Path(path)
    folder = path.parent
    temp = folder / f".{path.name}.{secrets.token_hex(4)}.partial"
    try:
        if make_folder:
            folder.mkdir(parents=True, exist_ok=True)
        elif not folder.is_dir():
            raise FileNotFoundError(2, f"cannot write {what}: the folder {folder} does not exist")
        # os.open rather than mkstemp: the file gets the usual umask permissions, not 0600.
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as error:  # OSError(errno, …) keeps the subclass: PermissionError, …
        raise OSError(error.errno, f"cannot write {what} into {folder}: "
                                   f"{error.strerror or error}") from error
    try:
        yield temp
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_atomically(path: str | Path, data: bytes, what: str = "the file") -> Path:
    """Write `data` to `path` atomically (flushed to disk first); missing folders are created."""
    with atomic_target(path, what) as temp:
        with open(temp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    return Path(path)
