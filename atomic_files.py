"""Writing files atomically: readers see the previous file or the complete new one, never part.

Everything the package writes (videos, event logs, reports, checkpoints made for tests) goes to
a hidden temporary file beside its destination and is renamed over it when complete; on any
failure, interrupts included, the temporary file is removed and nothing is left behind. A process
killed outright (kill -9, a power cut) cannot remove its temporary file: the name carries the
writer's process id, and the next write into that folder removes the files of writers that no
longer run (remove_stale_partials). The finished file gets the permissions a new file gets
(0666 less the umask), whatever the writer that filled the temporary file did.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_target(path: str | Path, what: str = "the file",
                  make_folder: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; renamed onto `path` when the block
    completes, removed when it raises. An OSError names `what` and the folder."""
    path = Path(path)
    folder = path.parent
    temp = folder / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    try:
        if make_folder:
            folder.mkdir(parents=True, exist_ok=True)
        elif not folder.is_dir():
            raise FileNotFoundError(2, f"cannot write {what}: the folder {folder} does not exist")
        remove_stale_partials(folder)
        # os.open rather than mkstemp: the file gets the usual umask permissions, not 0600.
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = os.stat(temp).st_mode & 0o777
    except OSError as error:  # OSError(errno, …) keeps the subclass: PermissionError, …
        raise OSError(error.errno, f"cannot write {what} into {folder}: "
                                   f"{error.strerror or error}") from error
    try:
        yield temp
        if os.stat(temp).st_mode & 0o777 != mode:
            os.chmod(temp, mode)  # a writer that recreated the file (safetensors: 0600)
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


# A temporary file of this package: .NAME.PID-TOKEN.partial (older versions: .NAME.TOKEN.partial)
PARTIAL = re.compile(r"^\..+\.(?:(?P<pid>\d+)-)?[0-9a-f]{8}\.partial$")
# Temporary files without a process id (older versions) count as stale after this long.
STALE_WITHOUT_PID_S = 3600


def remove_stale_partials(folder: str | Path) -> list[Path]:
    """Remove the temporary files in `folder` whose writer no longer runs; return them.
    Files of running processes (this one included) are kept."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = PARTIAL.match(name)
        if match is None:
            continue
        path = Path(folder) / name
        if _is_stale(path, match.group("pid")):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def _is_stale(path: Path, pid: str | None) -> bool:
    if pid is None:
        try:
            return time.time() - path.stat().st_mtime > STALE_WITHOUT_PID_S
        except OSError:
            return False
    return not _running(int(pid))


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or a number we cannot test: keep its file
    return True
