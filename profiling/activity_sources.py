"""What the activity monitor reads on each tick: the GPU through NVML, or the CPU side instead.

A source is opened once (`open_source`), read many times from the sampling thread (`read()`
returns one sample dict) and closed once. NVML fields the device does not support (power on some
boards, utilisation on MIG slices) are found when the source opens and recorded as None from then
on, so a sample never pays for a call that is known to fail.
"""

from __future__ import annotations

import time

import psutil

from .snapshot import NvmlReader, cuda_index

NVML_FIELDS = ("sm_activity", "memory_used_bytes", "power_w", "sm_clock_mhz")
CPU_FIELDS = ("cpu_percent", "rss_bytes")
NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM; fixed by the NVML API, named here for fakes


class SourceUnavailable(Exception):
    """The GPU cannot be monitored here; the message says why."""


class NvmlSource:
    name = "nvml"
    fields = NVML_FIELDS

    def __init__(self, device=None):
        index = cuda_index(device)
        if index is None:
            raise SourceUnavailable("no CUDA device")
        try:
            import pynvml
        except ImportError:
            raise SourceUnavailable("pynvml is not installed (pip install nvidia-ml-py)") from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            raise SourceUnavailable(f"NVML did not initialise: {exc}") from None
        self._nvml = pynvml
        self.device = f"cuda:{index}"
        try:
            # The same UUID-first lookup the memory snapshots use (CUDA and NVML number devices
            # differently when CUDA_VISIBLE_DEVICES reorders them).
            handle = NvmlReader._find_handle(pynvml, index)
        except Exception as exc:
            self.close()
            raise SourceUnavailable(f"NVML has no handle for {self.device}: {exc}") from None
        readers = {
            "sm_activity": lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "memory_used_bytes": lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
            "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW
            "sm_clock_mhz": lambda: float(pynvml.nvmlDeviceGetClockInfo(
                handle, getattr(pynvml, "NVML_CLOCK_SM", NVML_CLOCK_SM))),
        }
        self._readers = {name: read for name, read in readers.items() if _works(read)}
        if not self._readers:
            self.close()
            raise SourceUnavailable(f"NVML reads nothing on {self.device}")
        self.unsupported = [name for name in NVML_FIELDS if name not in self._readers]

    def read(self) -> dict:
        sample = {"monotonic": time.monotonic()}
        for name in NVML_FIELDS:
            read = self._readers.get(name)
            sample[name] = read() if read is not None else None
        return sample

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()  # balances our nvmlInit (NVML counts them)
        except Exception:
            pass


class CpuSource:
    name = "cpu"
    fields = CPU_FIELDS
    device = None
    unsupported: list[str] = []

    def __init__(self):
        self._process = psutil.Process()
        psutil.cpu_percent(None)  # starts the first interval
        self._first = True

    def read(self) -> dict:
        cpu = float(psutil.cpu_percent(None))
        if self._first:  # an interval of a millisecond or so: noise, not a reading
            cpu, self._first = None, False
        return {"monotonic": time.monotonic(), "cpu_percent": cpu,
                "rss_bytes": int(self._process.memory_info().rss)}

    def close(self) -> None:
        pass


def _works(read) -> bool:
    try:
        read()
        return True
    except Exception:
        return False
