"""The idle-time analysis of bench/gpu_timeline.py on hand-made timelines (nanoseconds)."""

import pytest

from wan_enhanced.bench.gpu_timeline import DeviceSpan, describe, idle_of

US = 1000


def test_busy_time_is_the_union_of_overlapping_spans_and_gaps_are_ranked():
    spans = [
        DeviceSpan(100 * US, 200 * US, "a", launched_ns=90 * US),
        DeviceSpan(150 * US, 250 * US, "b (another stream, overlapping a)", 140 * US),
        DeviceSpan(160 * US, 170 * US, "c (inside b)", 150 * US),
        DeviceSpan(300 * US, 400 * US, "d", launched_ns=290 * US),  # 50 us gap after b
        DeviceSpan(410 * US, 500 * US, "e", launched_ns=300 * US),  # 10 us: the GPU's own latency
        DeviceSpan(800 * US, 900 * US, "f", launched_ns=790 * US),  # 300 us gap, launched late
    ]
    syncs = [(550 * US, 780 * US, "cudaStreamSynchronize"),
             (100 * US, 120 * US, "cudaLaunchKernel")]
    idle = idle_of(0, spans, syncs)
    assert idle.wall_ms == pytest.approx(0.9)
    assert idle.busy_ms == pytest.approx((150 + 100 + 90 + 100) / 1000)
    assert idle.before_first_ms == pytest.approx(0.1)
    assert idle.idle_ms == pytest.approx(0.9 - 0.44)
    assert idle.gap_count == 2
    first, second = idle.gaps
    assert (first.ms, first.before, first.after) == (pytest.approx(0.3), "e", "f")
    assert first.launch_delay_ms == pytest.approx(0.29)
    assert first.syncs == ("cudaStreamSynchronize", )
    assert (second.ms, second.before, second.after) == (
        pytest.approx(0.05), "b (another stream, overlapping a)", "d")
    assert second.syncs == ()
    text = describe(idle)
    assert "GPU busy 0.4 of 0.9 ms" in text and "| 0.300 | `e` | `f` | 0.290 |" in text


def test_a_span_ending_inside_an_earlier_one_keeps_the_later_end():
    spans = [DeviceSpan(0, 1000 * US, "long"), DeviceSpan(10 * US, 20 * US, "short"),
             DeviceSpan(1100 * US, 1200 * US, "next")]
    idle = idle_of(0, spans)
    assert idle.busy_ms == pytest.approx(1.1)
    assert [(g.before, g.after) for g in idle.gaps] == [("long", "next")]
    assert idle.gaps[0].launch_delay_ms is None and "| ? |" in describe(idle)


def test_no_device_activity_is_refused():
    with pytest.raises(ValueError, match="no device activity"):
        idle_of(0, [])


def test_a_profile_is_read_by_its_marker_and_launch_correlations():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from wan_enhanced.bench.gpu_timeline import idle_of_profile

    def event(name, device, start, end, corr=0, linked=0):
        return SimpleNamespace(name=lambda: name, device_type=lambda: device,
                               start_ns=lambda: start, end_ns=lambda: end,
                               correlation_id=lambda: corr, linked_correlation_id=lambda: linked)
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [event("call", cpu, 1000 * US, 3000 * US),
              event("cudaLaunchKernel", cpu, 1010 * US, 1020 * US, corr=7),
              event("kernel_a", cuda, 1100 * US, 1500 * US, corr=70, linked=7),
              event("cudaDeviceSynchronize", cpu, 1600 * US, 2000 * US, corr=8),
              event("cudaLaunchKernel", cpu, 2100 * US, 2110 * US, corr=9),
              event("kernel_b", cuda, 2150 * US, 2900 * US, corr=90, linked=9)]
    prof = SimpleNamespace(profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(events=lambda: events)))
    idle = idle_of_profile(prof, "call")
    assert idle.wall_ms == pytest.approx(1.9) and idle.before_first_ms == pytest.approx(0.1)
    (gap, ) = idle.gaps
    assert (gap.before, gap.after, gap.syncs) == ("kernel_a", "kernel_b",
                                                  ("cudaDeviceSynchronize", ))
    assert gap.launch_delay_ms == pytest.approx(0.6)
    with pytest.raises(ValueError, match="no host event named 'other'"):
        idle_of_profile(prof, "other")
