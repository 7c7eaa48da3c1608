"""How the ranks of a worker group start: spawned with torch.multiprocessing, meeting at a
TCPStore on the loopback.

A spawned process starts from a fresh interpreter and imports the function it runs by module
name, and spawn re-imports the parent's main script. Inside ComfyUI this package is registered
under its folder's path (no fresh interpreter can import that name) and the main script is
ComfyUI's main.py (which must not run again in every rank). So the ranks start in the boot
module (boot/), importable by its own name from a folder holding nothing else, and the parent's
main module is hidden from spawn while the processes start.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import socket
import sys
import threading
import types
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_NAME = __name__.rsplit(".", 2)[0]
BOOT_FOLDER = Path(__file__).resolve().parent / "boot"
_MAIN_LOCK = threading.Lock()


def spawn_ranks(world: int, args: tuple):
    """Start `world` processes running worker.serve(rank, *args); their ProcessContext."""
    with _spawnable() as boot:
        return torch.multiprocessing.start_processes(
            boot.main, args=(PACKAGE_NAME, str(PACKAGE_ROOT), *args), nprocs=world, join=False,
            daemon=True, start_method="spawn")


def loopback_store(timeout_s: float):
    """(the rendezvous store, its port): a TCPStore listening on 127.0.0.1 only (Linux: a socket
    bound here and handed over; elsewhere the store's own, on a free port)."""
    timeout = timedelta(seconds=timeout_s)
    if sys.platform.startswith("linux"):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, timeout, False,
                              master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the socket now and closes it
        return store, port
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, False)
    return store, store.port


def raised_in(context, rank: int) -> str | None:
    """The traceback torch.multiprocessing saved for a rank whose function raised."""
    files = getattr(context, "error_files", None) or []
    path = files[rank] if rank < len(files) else None
    if not path or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    try:
        with open(path, "rb") as f:
            return str(pickle.load(f))
    except Exception:  # noqa: BLE001 - a damaged file: the exit code still says enough
        return None


@contextlib.contextmanager
def _spawnable():
    """The boot module importable by its own name (its folder on the path), and no __main__
    for spawn to import again in the ranks."""
    folder = str(BOOT_FOLDER)
    if folder not in sys.path:
        sys.path.append(folder)
    boot = importlib.import_module("wan_enhanced_worker_boot")
    with _MAIN_LOCK:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield boot
        finally:
            if main is not None:
                sys.modules["__main__"] = main
