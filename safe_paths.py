"""File names that come from a workflow, kept inside the folder they belong to.

A workflow may come from anyone: shared as a file, or posted to a ComfyUI server by whoever can
reach it. Every file name it gives for writing (a video's filename prefix, an event log's name) is
taken relative to the output folder and refused when it would lead anywhere else: an absolute
path, a drive or network share, a '..' step, or a symbolic link inside the folder that points out
of it (the path is resolved, links followed, before the check).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath


class UnsafePathError(ValueError):
    """A file name from a workflow that would lead outside its folder; names the field."""


def name_problem(name) -> str | None:
    """What is wrong with `name` as a relative file name, judged from the text alone (no disk
    access), or None. Backslashes count as separators, as on Windows."""
    if not isinstance(name, str):
        return f"expected a file name (text), got {type(name).__name__}"
    if not name.strip():
        return "the file name is empty"
    if "\x00" in name:
        return "the file name contains a NUL character"
    text = name.replace("\\", "/")
    windows = PureWindowsPath(name)
    if text.startswith("/") or windows.drive or windows.root:
        return (f"{name!r} is an absolute path, which leads outside the output folder; give a "
                f"name inside it (e.g. 'wan/clip')")
    if ".." in PurePosixPath(text).parts:
        return f"{name!r} leads outside the output folder with '..'"
    return None


def relative_parts(name: str) -> tuple[str, ...]:
    """The folder steps of a checked name ('.' and empty steps dropped)."""
    return tuple(part for part in PurePosixPath(name.replace("\\", "/")).parts
                 if part not in ("", "."))


def path_inside(folder: str | Path, name: str, field: str,
                what: str = "the output folder") -> Path:
    """folder/name, refused (UnsafePathError naming `field`) unless it stays inside `folder`
    once resolved, symbolic links included. The folder itself does not count as inside."""
    problem = name_problem(name)
    if problem is None and not relative_parts(name):
        problem = "the file name is empty"
    if problem is not None:
        raise UnsafePathError(f"{field}: {problem}")
    folder = Path(folder)
    target = folder.joinpath(*relative_parts(name))
    check_inside(folder, target, field, name, what)
    return target


def check_inside(folder: str | Path, target: str | Path, field: str, name: str,
                 what: str = "the output folder") -> None:
    """Raise UnsafePathError unless `target` resolves (links followed) to a path under the
    resolved `folder`."""
    root = Path(folder).resolve()
    resolved = Path(target).resolve()
    if resolved == root or not resolved.is_relative_to(root):
        raise UnsafePathError(f"{field}: {name!r} leads outside {what} (a symbolic link inside "
                              f"it points elsewhere)")


def folder_problem(folder: str | Path) -> str | None:
    """Why files cannot be written into `folder` (created as needed), or None: a part of it is a
    file, or the nearest folder of it that exists does not let this process create files."""
    folder = Path(folder)
    existing = folder
    while not existing.exists():
        if existing.is_symlink():
            return f"{existing} is a broken symbolic link"
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the folder {existing} is not writable"
    return None
