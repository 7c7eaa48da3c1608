"""The report's per-rank table, from a log with hand-made rank events."""

from wan_enhanced.profiling.report_ranks import rank_runs, render_ranks


def _event(index, rank, **extra):
    metrics = {"rank": rank, "device": f"cuda:{rank}", "request_total_seconds": 12.5,
               "compute_seconds": 10.0, "forwards": 60, "all_to_all_seconds": 1.25,
               "all_to_all_bytes": 3 << 20, "ring_seconds": 0.0, "ring_bytes": 0,
               "gather_seconds": 0.01, "cfg_seconds": 0.5, "cfg_bytes": 1 << 20,
               "reserved_peak_bytes": 40 << 30, "weight_bytes": 7 << 30, "gpus": 4,
               "fsdp": True, "cfg_parallel": True, **extra}
    return {"index": index, "label": f"rank {rank}", "stage": "ranks", "node": "",
            "extra": metrics, "monotonic": float(index)}


def test_one_table_per_run_one_row_per_rank():
    events = [_event(0, 0), _event(1, 1), {"index": 2, "label": "x", "stage": "sample",
                                           "extra": None, "monotonic": 2.0},
              _event(3, 0, gpus=2, fsdp=False), _event(4, 1, gpus=2, fsdp=False)]
    runs = rank_runs({"events": events})
    assert [len(r.rows) for r in runs] == [2, 2]
    assert (runs[0].gpus, runs[0].fsdp, runs[1].gpus, runs[1].fsdp) == (4, True, 2, False)
    lines = render_ranks(runs)
    assert "Run 1 (4 ranks, fsdp, CFG parallel):" in lines
    assert "Run 2 (2 ranks, CFG parallel):" in lines
    assert "| 1 | cuda:1 | 12.500 | 10.000 | 60 | 1.250 | 3.0 | 0.000 | 0.0 | 0.010 | 0.500 | " \
           "1.0 | 40.00 | 7.00 |" in lines


def test_device_peak_counts_what_a_rank_held_outside_the_allocator():
    """fsdp on GPUs: the chunks of the blocks live in symmetric memory, which the allocator's
    peak does not see."""
    runs = rank_runs({"events": [_event(0, 0, outside_allocator_bytes=7 << 30)]})
    assert runs[0].rows[0].device_peak == 47 << 30
    assert "| 47.00 | 7.00 |" in render_ranks(runs)[-1]


def test_logs_without_rank_events_have_no_section():
    assert rank_runs({"events": [{"stage": "sample", "extra": {"step": 1}}]}) == []
    assert render_ranks([]) == []


def test_missing_numbers_show_as_not_available():
    event = {"stage": "ranks", "extra": {"rank": 0}, "monotonic": 0.0}
    lines = render_ranks(rank_runs({"events": [event]}))
    assert "| 0 | ? | n/a | n/a | n/a |" in lines[-1]
