"""profiling/kernels.py: kernel (or operator) totals of a torch.profiler profile."""

from types import SimpleNamespace

import torch

from wan_enhanced.profiling.kernels import KernelTotal, kernel_totals, profiled


def test_cpu_operators_by_their_own_time():
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    result, totals = profiled(lambda: (a @ b).relu() @ b, "cpu")
    assert torch.equal(result, (a @ b).relu() @ b)
    by_name = {t.name: t for t in totals}
    assert by_name["aten::mm"].calls == 2 and by_name["aten::relu"].calls == 1
    assert all(t.ms > 0 for t in totals)
    assert [t.ms for t in totals] == sorted((t.ms for t in totals), reverse=True)
    # own time: aten::matmul, which calls aten::mm, does not count the product again
    assert by_name["aten::matmul"].ms < by_name["aten::mm"].ms


def test_device_kernels_in_milliseconds_longest_first():
    events = [SimpleNamespace(key="gemm", device_time_total=1500.0, self_cpu_time_total=0.0,
                              count=3),
              SimpleNamespace(key="aten::mm", device_time_total=0.0, self_cpu_time_total=9.0,
                              count=3),  # a host operator: no device time of its own here
              SimpleNamespace(key="attention", device_time_total=4000.0,
                              self_cpu_time_total=0.0, count=1)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert kernel_totals(prof) == [KernelTotal("attention", 4.0, 1), KernelTotal("gemm", 1.5, 3)]
    assert kernel_totals(prof, "cpu") == [KernelTotal("aten::mm", 0.009, 3)]
    assert KernelTotal("gemm", 1.5, 3).to_dict() == {"name": "gemm", "ms": 1.5, "calls": 3}
