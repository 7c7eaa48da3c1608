"""One reading of the memory counters: torch's CUDA allocator, the process, and NVML.

`take_snapshot()` never raises and never creates a CUDA context: without CUDA (or before the
process has touched the GPU) the torch fields read 0 or None, and NVML fields are None when
`pynvml` (package nvidia-ml-py) is missing or fails to initialise.

Fields (bytes unless named otherwise):

    time                       wall clock, seconds since the epoch (time.time)
    monotonic                  seconds on time.monotonic(), for intervals
    device                     "cuda:N" read by the torch and NVML fields, or None
    cuda_allocated_bytes       torch.cuda.memory_allocated
    cuda_reserved_bytes        torch.cuda.memory_reserved (allocator cache included)
    cuda_max_allocated_bytes   torch.cuda.max_memory_allocated since the last peak reset
    cuda_max_reserved_bytes    torch.cuda.max_memory_reserved since the last peak reset
    rss_bytes                  resident memory of this process (psutil)
    nvml_used_bytes            device memory in use by every process (NVML), or None
    nvml_total_bytes           device memory size (NVML), or None
"""

from __future__ import annotations

import os
import threading
import time

import psutil
import torch

SNAPSHOT_FIELDS = (
    "time", "monotonic", "device",
    "cuda_allocated_bytes", "cuda_reserved_bytes",
    "cuda_max_allocated_bytes", "cuda_max_reserved_bytes",
    "rss_bytes", "nvml_used_bytes", "nvml_total_bytes",
)

_process = psutil.Process()


def take_snapshot(device=None) -> dict:
    """Read every counter now. `device`: a CUDA device (index, "cuda:1", torch.device);
    None means the current CUDA device, or none when CUDA is unavailable."""
    index = cuda_index(device)
    snapshot = {"time": time.time(), "monotonic": time.monotonic(),
                "device": None if index is None else f"cuda:{index}"}
    snapshot.update(_torch_counters(index))
    snapshot["rss_bytes"] = _process.memory_info().rss
    snapshot.update(NVML.memory(index))
    return snapshot


def cuda_index(device=None) -> int | None:
    """The CUDA device index a snapshot reads, without initialising CUDA."""
    try:
        if device is None:
            if not torch.cuda.is_available():
                return None
            return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        if isinstance(device, int):
            return device
        device = torch.device(device)
        if device.type != "cuda":
            return None
        if device.index is not None:
            return device.index
        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    except Exception:
        return None


def reset_cuda_peaks(index: int | None) -> None:
    """Start a new peak interval. Skipped before CUDA is initialised: nothing was allocated
    yet, and resetting would create a context."""
    if index is None:
        return
    try:
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(index)
    except Exception:
        pass


def _torch_counters(index: int | None) -> dict:
    names = ("cuda_allocated_bytes", "cuda_reserved_bytes",
             "cuda_max_allocated_bytes", "cuda_max_reserved_bytes")
    if index is None:
        return dict.fromkeys(names)
    try:
        # With an explicit index these read 0 before CUDA is initialised, and initialise nothing.
        values = (torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
                  torch.cuda.max_memory_allocated(index), torch.cuda.max_memory_reserved(index))
        return {name: int(value) for name, value in zip(names, values)}
    except Exception:
        return dict.fromkeys(names)


class NvmlReader:
    """Device memory as the driver sees it (every process, not only torch's allocator).

    NVML is initialised once, on first use; a failure is remembered so that later snapshots
    stay cheap. Handles are looked up by UUID because NVML numbers devices in PCI order while
    CUDA_VISIBLE_DEVICES and CUDA's own ordering can renumber them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._nvml = None         # the pynvml module once initialised
        self._tried = False
        self._handles: dict[int, object] = {}

    def memory(self, index: int | None) -> dict:
        empty = {"nvml_used_bytes": None, "nvml_total_bytes": None}
        if index is None:
            return empty
        try:
            nvml = self._module()
            handle = self._handle(nvml, index) if nvml is not None else None
            if handle is None:
                return empty
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            return {"nvml_used_bytes": int(info.used), "nvml_total_bytes": int(info.total)}
        except Exception:
            return empty

    def device_name(self, index: int | None) -> str | None:
        try:
            nvml = self._module()
            handle = self._handle(nvml, index) if nvml is not None and index is not None else None
            if handle is None:
                return None
            name = nvml.nvmlDeviceGetName(handle)
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            return None

    def _module(self):
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    import pynvml
                    pynvml.nvmlInit()
                    self._nvml = pynvml
                except Exception:
                    self._nvml = None
            return self._nvml

    def _handle(self, nvml, index: int):
        with self._lock:
            if index not in self._handles:
                self._handles[index] = self._find_handle(nvml, index)
            return self._handles[index]

    @staticmethod
    def _find_handle(nvml, index: int):
        uuid = _cuda_uuid(index)
        if uuid is not None:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(uuid)
            except Exception:
                pass
        return nvml.nvmlDeviceGetHandleByIndex(_nvml_index_guess(index))


def _cuda_uuid(index: int) -> str | None:
    """"GPU-…" for a CUDA device, from torch when CUDA is up, else from CUDA_VISIBLE_DEVICES."""
    try:
        if torch.cuda.is_initialized():
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:
        pass
    visible = _visible_devices()
    if index < len(visible) and visible[index].startswith(("GPU-", "MIG-")):
        return visible[index]
    return None


def _nvml_index_guess(index: int) -> int:
    """NVML index when no UUID is known: CUDA_VISIBLE_DEVICES's entry, else the same number
    (right unless CUDA's fastest-first order differs from PCI order on a mixed machine)."""
    visible = _visible_devices()
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def _visible_devices() -> list[str]:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return []
    return [entry.strip() for entry in value.split(",") if entry.strip()]


NVML = NvmlReader()


def reset_rss_peak() -> bool:
    """Linux resets the VmHWM high-water mark when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak() -> int | None:
    """This process's peak resident memory in bytes (VmHWM, or getrusage where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
        import sys
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return None
