"""The loop each worker process runs: join the process group, then run the driver's tasks until
it says to shut down (or goes away).

A worker keeps what its tasks cache between runs (`WorkerState.cache`: the model shards, keyed by
what they were loaded from) and frees all of it, the process group and the GPU memory when it
leaves. A task that raises is reported to the driver with the rank's traceback, after which the
rank exits: the other ranks may be waiting in a collective, so the driver replaces the whole
group.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from .errors import WorkerInterrupted
from .messages import receive, send

# exported to every worker before torch.distributed starts (the user's own values win):
# NVLink SHARP multicast off (it needs fabric-manager support that many hosts lack), loopback
# sockets for gloo and NCCL bootstrap on Linux
WORKER_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class WorkerState:
    """What a task gets: this rank, its device, the link to the driver and the cache."""

    def __init__(self, rank: int, world: int, device: torch.device, conn, control):
        self.rank, self.world, self.device = rank, world, device
        self.conn = conn
        self.control = control  # a gloo group over every rank, for CPU-side agreement
        self.cache: dict = {}
        self.renames: tuple = ()  # the driver's package name -> ours (messages.py)
        self.stop_seen = False
        self.shutdown_seen = False

    def progress(self, data) -> None:
        """Tell the driver (rank 0 only; the ranks run in step), once this rank's GPU has done
        the work queued so far: the host queues a step's kernels well before they finish, so a
        step reported when it was queued would reach the driver's progress bar and step events
        up to a step early, at uneven intervals."""
        if self.rank == 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            send(self.conn, ("progress", data))

    def stop_requested(self) -> bool:
        """Whether the driver asked to stop, agreed by every rank (one tiny all-reduce over
        gloo), so that all of them stop at the same step and no collective is left waiting."""
        while not self.stop_seen and _has_data(self.conn):
            kind = receive(self.conn, self.renames)[0]
            self.stop_seen = kind in ("stop", "shutdown")
            self.shutdown_seen = self.shutdown_seen or kind == "shutdown"
        flag = torch.tensor([1 if self.stop_seen else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def check_stop(self) -> None:
        if self.stop_requested():
            raise WorkerInterrupted("interrupted")


PACKAGE = __name__.rsplit(".", 2)[0]


def serve(rank: int, world: int, device_type: str, store_port: int, prefix: str, conns: list,
          threads: int, driver_package: str = PACKAGE) -> None:
    conn = conns[rank]
    for other in conns:  # the other ranks' pipe ends: not ours to hold open
        if other is not conn:
            other.close()
    os.environ["WAN_ENHANCED_WORKER"] = "1"  # host.py: no ComfyUI in a worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    _watch_parent()
    for key, value in {**WORKER_ENVIRONMENT, **_loopback_sockets()}.items():
        os.environ.setdefault(key, value)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, threads))
    try:
        control = _join(rank, world, device, store_port, prefix)
    except Exception as exc:  # noqa: BLE001 - reported, then this rank exits
        send(conn, ("error", rank, f"could not join the process group: {exc}"))
        return
    state = WorkerState(rank, world, device, conn, control)
    state.renames = ((driver_package, PACKAGE),)
    send(conn, ("ready", rank, {"pid": os.getpid(), "device": str(device),
                                "backend": str(dist.get_backend()), "package": PACKAGE}))
    try:
        _loop(state)
    finally:
        state.cache.clear()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _join(rank, world, device, store_port, prefix):
    """Join the group; returns the gloo group for control (None on the CPU: the default one)."""
    store = dist.TCPStore("127.0.0.1", store_port, None, False, COLLECTIVE_TIMEOUT)
    store = dist.PrefixStore(prefix, store)
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo") if device.type == "cuda" else None
    dist.barrier(group=control)
    return control


def _loop(state: WorkerState) -> None:
    while not state.shutdown_seen:
        try:
            message = receive(state.conn, state.renames)
        except (EOFError, OSError):
            return  # the driver is gone
        if message[0] == "shutdown":
            return
        if message[0] != "task":
            continue  # a stop that came after this rank's task had ended
        state.stop_seen = False
        _, task_ref, payload, settings = message
        try:
            settings.apply()
            result = resolve_task(task_ref)(state, payload)
        except WorkerInterrupted:
            _drop_traceback()
            if state.rank == 0:
                send(state.conn, ("interrupted",))
            continue
        except BaseException:  # noqa: BLE001 - any failure ends this rank
            send(state.conn, ("error", state.rank, _short_traceback()))
            return
        if state.rank == 0:
            send(state.conn, ("result", result))
        del result


def resolve_task(ref: str):
    """"module:function"; a module starting with "." is inside this package."""
    module_name, _, function = ref.partition(":")
    if module_name.startswith("."):
        module = importlib.import_module(module_name, PACKAGE)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, function)


def _has_data(conn) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return False


def _short_traceback() -> str:
    """The exception line first (what the node shows), the traceback after it."""
    kind, value, _ = sys.exc_info()
    head = f"{kind.__name__}: {value}".strip()
    return head + "\n" + traceback.format_exc()


def _drop_traceback() -> None:
    sys.last_traceback = None
    gc.collect()


def _watch_parent() -> None:
    """Exit when the driver's process ends, even in the middle of a computation."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="wan-enhanced-parent-watch").start()


def _loopback_sockets() -> dict:
    """gloo and NCCL's bootstrap on the loopback interface, where the host has one named lo."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return {}
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"} if "lo" in names else {}
