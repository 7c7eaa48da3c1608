"""The benchmark harness's timing in turns (bench/harness.py timed_in_turns), on the CPU."""

import torch

from wan_enhanced.bench.harness import timed_in_turns


def test_calls_are_warmed_up_then_timed_in_turns_and_a_failing_one_leaves_the_turns(capsys):
    calls = []

    def side(name, fail_at=None):
        def fn():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} refused the shapes")
            return torch.full((2,), float(len(name)))
        return fn

    got = timed_in_turns({"a": side("a"), "bb": side("bb"), "ccc": side("ccc", fail_at=3)},
                         repeats=3, device=torch.device("cpu"), to_cpu=lambda t: t * 10)
    # warm-ups first, then a, bb, ccc in turns until ccc's third call fails
    assert calls == ["a", "bb", "ccc", "a", "bb", "ccc", "a", "bb", "ccc", "a", "bb"]
    (out_a, run_a), (out_b, run_b), (out_c, run_c) = got["a"], got["bb"], got["ccc"]
    assert torch.equal(out_a, torch.full((2,), 10.0)) and torch.equal(out_b, torch.full((2,), 20.0))
    assert len(run_a.times_ms) == len(run_b.times_ms) == 3 and run_a.error is None
    assert out_c is None and run_c.times_ms == [] and run_c.median_ms is None
    assert run_c.error == "error: ccc refused the shapes"
    assert "ccc: error: ccc refused the shapes" in capsys.readouterr().out


def test_a_call_that_fails_its_warm_up_is_never_timed():
    calls = []

    def broken():
        calls.append("broken")
        raise RuntimeError("no kernel for this GPU")

    got = timed_in_turns({"ok": lambda: torch.zeros(1), "broken": broken}, repeats=2,
                         device=torch.device("cpu"), to_cpu=lambda t: t)
    assert calls == ["broken"]
    assert len(got["ok"][1].times_ms) == 2
    assert got["broken"][0] is None and got["broken"][1].error.startswith("error: no kernel")
