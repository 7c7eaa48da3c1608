"""Writing files atomically: readers see the previous file or the complete new one, never part.

Everything the package writes (videos, event logs, reports, checkpoints made for tests) goes to
a hidden temporary file beside its destination and is renamed over it when complete; on any
failure, interrupts included, the temporary file is removed and nothing is left behind. A process
killed outright (kill -9, a power cut) cannot remove its temporary file: the name carries the
writer's process id and start time, and the next write into that folder removes the files of
writers that no longer run (remove_stale_partials), also when another process has since been
given the same id (a restarted container's server is PID 1 again). The finished file gets the
permissions a new file gets (0666 less the umask), whatever the writer that filled the temporary
file did.

A file that must not replace anything (a numbered video) is first claimed: a hidden `.claim`
file made with exclusive creation reserves its name across processes (claim), and the finished
file is linked into place, which fails rather than replace a file another writer put there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_target(path: str | Path, what: str = "the file", make_folder: bool = True,
                  replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; renamed onto `path` when the block
    completes, removed when it raises. An OSError names `what` and the folder. replace=False:
    the finished file never replaces one at `path` (FileExistsError instead: see put_new)."""
    path = Path(path)
    folder = path.parent
    temp = folder / f".{path.name}.{writer_tag()}-{secrets.token_hex(4)}.partial"
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
        if replace:
            os.replace(temp, path)
        else:
            put_new(temp, path, what)
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


def put_new(temp: Path, path: Path, what: str = "the file") -> None:
    """Move the finished `temp` to `path`, which must not exist: a hard link made there (which
    fails if a file is there) and `temp` unlinked; where the file system has no hard links, a
    rename after a check (the claim the caller holds keeps our own writers away). Raises
    FileExistsError naming the file when one is there: nothing is replaced."""
    try:
        os.link(temp, path)
    except FileExistsError:
        raise FileExistsError(17, f"cannot write {what}: {path} was created by another writer "
                                  f"while this one was written; nothing was replaced") from None
    except OSError:  # no hard links here (FAT, some network file systems)
        if path.exists():
            raise FileExistsError(17, f"cannot write {what}: {path} exists") from None
        os.replace(temp, path)
        return
    os.unlink(temp)


# -- who writes --------------------------------------------------------------------------------

def writer_tag(pid: int | None = None) -> str:
    """"PID@START" of a process (default: this one): its id and its start time in hundredths of
    a second, which tell it from a later process given the same id."""
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    return f"{pid}@{start}" if start is not None else str(pid)


def _start_time(pid: int) -> int | None:
    try:
        import psutil
        return int(round(psutil.Process(pid).create_time() * 100))
    except Exception:  # no such process, no psutil, no permission
        return None


def _writer_running(pid: int, start: int | None) -> bool:
    if not _running(pid):
        return False
    if start is None:
        return True
    now = _start_time(pid)
    return now is None or abs(now - start) <= 1  # else another process now has this id


# -- claims ------------------------------------------------------------------------------------

@dataclass
class Claim:
    """A name reserved for a file this process will write (`path`); `token` names the write
    (put into the file where its format has room, so that a later reader can tell it)."""
    path: Path
    token: str
    claim_file: Path

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.claim_file.unlink()


def claim(path: str | Path) -> Claim | None:
    """Reserve `path` across processes, or None when another writer holds it or a file is
    there already. The reservation is the hidden file `.NAME.claim`, made with exclusive
    creation; Claim.release removes it, and a later write into the folder removes it when its
    writer no longer runs."""
    path = Path(path)
    claim_file = path.parent / f".{path.name}.claim"
    token = secrets.token_hex(8)
    try:
        handle = os.open(claim_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return None
    with os.fdopen(handle, "w") as file:
        json.dump({"writer": writer_tag(), "token": token}, file)
    if path.exists():  # a file written without a claim (another program, an older version)
        with contextlib.suppress(OSError):
            claim_file.unlink()
        return None
    return Claim(path, token, claim_file)


CLAIM = re.compile(r"^\..+\.claim$")


# A temporary file of this package: .NAME.PID@START-TOKEN.partial (older versions:
# .NAME.PID-TOKEN.partial, .NAME.TOKEN.partial)
PARTIAL = re.compile(r"^\..+\.(?:(?P<pid>\d+)(?:@(?P<start>\d+))?-)?[0-9a-f]{8}\.partial$")
# Temporary files without a process id (older versions) count as stale after this long.
STALE_WITHOUT_PID_S = 3600


def remove_stale_partials(folder: str | Path) -> list[Path]:
    """Remove the temporary files and claims in `folder` whose writer no longer runs; return
    them. Files of running processes (this one included) are kept."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        path = Path(folder) / name
        match = PARTIAL.match(name)
        if match is not None:
            start = match.group("start")
            stale = _is_stale(path, match.group("pid"), None if start is None else int(start))
        elif CLAIM.match(name):
            stale = _claim_is_stale(path)
        else:
            continue
        if stale:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def _is_stale(path: Path, pid: str | None, start: int | None = None) -> bool:
    if pid is None:
        try:
            return time.time() - path.stat().st_mtime > STALE_WITHOUT_PID_S
        except OSError:
            return False
    return not _writer_running(int(pid), start)


def _claim_is_stale(path: Path) -> bool:
    try:
        writer = str(json.loads(path.read_text()).get("writer", ""))
    except (OSError, ValueError, AttributeError):
        # being written this instant, or unreadable: stale only when old
        return _is_stale(path, None)
    pid, _, start = writer.partition("@")
    if not pid.isdigit():
        return _is_stale(path, None)
    return not _writer_running(int(pid), int(start) if start.isdigit() else None)


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
