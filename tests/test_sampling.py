"""Samplers: golden trajectories, schedule rules, guidance, experts and the denoise loop."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import pytest
import torch

from wan_enhanced.conformance.golden_file import read_golden
from wan_enhanced.conformance.run_scheduler import run, run_case, toy_model
from wan_enhanced.sampling.experts import HIGH_NOISE, LOW_NOISE, ExpertPair
from wan_enhanced.sampling.guidance import CfgConditioning, guided_velocity
from wan_enhanced.sampling.loop import denoise, make_noise, noise_latent
from wan_enhanced.sampling.schedules import (
    FlowSchedule, denoise_start_step, dpm_schedule, unipc_schedule)
from wan_enhanced.sampling.solvers import SOLVER_NAMES, make_schedule, make_solver

GOLDEN = Path(__file__).parent / "golden" / "scheduler_unipc.safetensors"
SHAPE = (1, 4, 3, 4, 4)


@pytest.fixture(scope="module")
def golden():
    return read_golden(GOLDEN)


def _case_names():
    return [case.name for case in read_golden(GOLDEN).cases()]


# ---------------------------------------------------------------- golden conformance

@pytest.mark.parametrize("case_name", _case_names())
def test_golden_case(golden, case_name):
    case = next(c for c in golden.cases() if c.name == case_name)
    scores = run_case(golden, case)
    assert {s.output for s in scores} == set(case.expected)
    for s in scores:
        print(s.line())
    failed = [s.line() for s in scores if not s.passed]
    assert not failed, "\n".join(failed)


def test_golden_run_covers_every_output(golden):
    scores = run(golden)
    expected = sum(len(case.expected) for case in golden.cases())
    assert len(scores) == expected and all(s.passed for s in scores)


# ---------------------------------------------------------------- schedules

@pytest.mark.parametrize("build", [unipc_schedule, dpm_schedule])
@pytest.mark.parametrize("steps,shift", [(1, 5.0), (7, 1.0), (30, 5.0), (50, 12.0), (40, 0.5)])
def test_schedule_shape_and_monotonic(build, steps, shift):
    schedule = build(steps, shift)
    assert schedule.sigmas.dtype == torch.float32 and schedule.timesteps.dtype == torch.int64
    assert schedule.sigmas.shape == (steps + 1,) and schedule.timesteps.shape == (steps,)
    assert schedule.sigmas[-1].item() == 0.0
    assert torch.all(schedule.sigmas[1:] < schedule.sigmas[:-1])
    assert torch.all(schedule.timesteps[1:] <= schedule.timesteps[:-1])
    assert schedule.model_timesteps.dtype == torch.float32
    assert torch.equal(schedule.model_timesteps.to(torch.int64), schedule.timesteps)


def test_schedule_first_timesteps():
    assert unipc_schedule(5, 5.0).timesteps.tolist() == [999, 952, 882, 768, 555]
    assert dpm_schedule(5, 5.0).timesteps.tolist() == [1000, 952, 882, 769, 555]
    # Truncation after float64 rounding: 499.99999999999994 -> 499.
    assert dpm_schedule(30, 5.0).timesteps[25].item() == 499


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_schedule_rejects_bad_steps(steps):
    with pytest.raises(ValueError, match="steps"):
        unipc_schedule(steps, 5.0)


@pytest.mark.parametrize("shift", [0.0, -1.0, math.inf, math.nan])
def test_schedule_rejects_bad_shift(shift):
    with pytest.raises(ValueError, match="shift"):
        dpm_schedule(10, shift)


@pytest.mark.parametrize("denoise", [0.0, -0.5, 1.5])
def test_schedule_rejects_bad_denoise(denoise):
    with pytest.raises(ValueError, match="denoise"):
        unipc_schedule(10, 5.0, denoise=denoise)


def test_partial_denoise_schedule():
    full = unipc_schedule(10, 5.0)
    part = unipc_schedule(10, 5.0, denoise=0.6)
    assert part.steps == 6
    assert torch.equal(part.sigmas, full.sigmas[4:])
    assert torch.equal(part.timesteps, full.timesteps[4:])
    assert denoise_start_step(100, 0.29) == 71  # 100 * 0.29 is 28.999999999999996
    assert denoise_start_step(10, 0.01) == 9   # at least one step runs
    assert denoise_start_step(10, 1.0) == 0


# ---------------------------------------------------------------- solvers

def test_make_solver_names():
    schedule = make_schedule("unipc", 4, 5.0)
    for name in SOLVER_NAMES:
        assert make_solver(name, schedule).name == name
    with pytest.raises(ValueError, match="unipc, euler, dpm\\+\\+"):
        make_solver("heun", schedule)
    with pytest.raises(ValueError, match="valid names"):
        make_schedule("ddim", 4, 5.0)


def test_solver_refuses_extra_step_and_reuse():
    schedule = make_schedule("euler", 2, 5.0)
    solver = make_solver("euler", schedule)
    x = torch.zeros(SHAPE)
    x = solver.step(torch.ones(SHAPE), x)
    x = solver.step(torch.ones(SHAPE), x)
    with pytest.raises(RuntimeError):
        solver.step(torch.ones(SHAPE), x)
    with pytest.raises(ValueError, match="one solver per run"):
        denoise(lambda x, t, c: x, torch.zeros(SHAPE), solver)


def _final_error(solver_name, steps, a=0.8):
    """Distance to the exact solution of dx/dsigma = a * x from sigmas[0] down to 0."""
    schedule = make_schedule(solver_name, steps, 3.0)
    x_start = make_noise(SHAPE, seed=3)
    final = denoise(lambda x, t, c: a * x, x_start, make_solver(solver_name, schedule))
    exact = x_start.double() * math.exp(-a * float(schedule.sigmas[0]))
    return float((final.double() - exact).abs().max() / exact.abs().max())


def test_euler_converges_to_the_analytic_solution():
    errors = [_final_error("euler", steps) for steps in (8, 32, 128, 512)]
    # First order: 4x the steps gives about 4x less error.
    assert all(coarse / fine > 3 for coarse, fine in zip(errors, errors[1:]))
    assert errors[-1] < 1e-3


def test_multistep_solvers_beat_euler():
    for name in ("unipc", "dpm++"):
        assert _final_error(name, 20) < 0.2 * _final_error("euler", 20)


def test_solver_history_is_released():
    schedule = make_schedule("unipc", 6, 5.0)
    solver = make_solver("unipc", schedule)
    denoise(lambda x, t, c: 0.1 * x, make_noise(SHAPE, 0), solver)
    assert solver.finished
    assert solver._x0_prev is None and solver._x0_prev2 is None and solver._sample_prev is None


# ---------------------------------------------------------------- guidance

class RecordingModel:
    """v = 0.3 x + cond * (t / 1000); cond is a [B, C] tensor. Records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, t, cond):
        self.calls.append((x.shape[0], t.clone(), cond))
        t = t.reshape(t.shape[0], 1, -1, 1, 1) if t.dim() == 2 else t.reshape(-1, 1, 1, 1, 1)
        return 0.3 * x + cond[:, :, None, None, None] * (t / 1000)


def _conds(batch=1, channels=SHAPE[1]):
    cond = torch.linspace(-1, 1, batch * channels).reshape(batch, channels)
    uncond = torch.full((batch, channels), 0.25)
    return cond, uncond


def test_cfg_scale_one_skips_uncond():
    cond, uncond = _conds()
    schedule = make_schedule("unipc", 5, 5.0)
    noise = make_noise(SHAPE, 1)
    guided = RecordingModel()
    out = denoise(guided, noise, make_solver("unipc", schedule), cond, uncond=uncond,
                  batched_cond=torch.cat([cond, uncond]), guidance_scale=1.0)
    plain = RecordingModel()
    ref = denoise(plain, noise, make_solver("unipc", schedule), cond)
    assert torch.equal(out, ref)
    assert len(guided.calls) == schedule.steps
    assert all(c is cond and b == 1 for b, _, c in guided.calls)


def test_cfg_batched_and_unbatched_agree():
    cond, uncond = _conds(batch=2)
    schedule = make_schedule("dpm++", 6, 5.0)
    noise = make_noise((2, *SHAPE[1:]), 2)
    two = RecordingModel()
    out_two = denoise(two, noise, make_solver("dpm++", schedule), cond, uncond=uncond,
                      guidance_scale=5.0)
    one = RecordingModel()
    out_one = denoise(one, noise, make_solver("dpm++", schedule), cond, uncond=uncond,
                      batched_cond=torch.cat([cond, uncond]), guidance_scale=5.0)
    assert torch.equal(out_one, out_two)
    assert len(two.calls) == 2 * schedule.steps and all(b == 2 for b, _, _ in two.calls)
    assert len(one.calls) == schedule.steps and all(b == 4 for b, _, _ in one.calls)


def test_cfg_formula_and_missing_uncond():
    x = make_noise(SHAPE, 4)
    t = torch.full((1,), 500.0)
    cond, uncond = _conds()
    model = RecordingModel()
    v = guided_velocity(model, x, t, CfgConditioning(cond, uncond), 4.0)
    c, u = model(x, t, cond), model(x, t, uncond)
    assert v.dtype == torch.float32 and torch.equal(v, u + 4.0 * (c - u))
    with pytest.raises(ValueError, match="uncond"):
        denoise(model, x, make_solver("euler", make_schedule("euler", 2, 5.0)), cond,
                guidance_scale=3.0)


# ---------------------------------------------------------------- experts

def _hand_schedule(timesteps):
    sigmas = [t / 1000 for t in timesteps] + [0.0]
    return FlowSchedule(torch.tensor(sigmas, dtype=torch.float32),
                        torch.tensor(timesteps, dtype=torch.int64))


def test_expert_switch_at_boundary():
    schedule = _hand_schedule([999, 900, 875, 874, 600, 100])
    high, low = RecordingModel(), RecordingModel()
    switches = []
    pair = ExpertPair(high, low, boundary=0.875, guidance_scales=(3.0, 4.0),
                      on_switch=lambda prev, cur: switches.append(
                          (prev.name if prev else None, cur.name)))
    assert pair.plan(schedule) == [HIGH_NOISE] * 3 + [LOW_NOISE] * 3
    assert pair.steps_of(schedule) == {HIGH_NOISE: [0, 1, 2], LOW_NOISE: [3, 4, 5]}
    cond, uncond = _conds()
    noise = make_noise(SHAPE, 5)
    out = denoise(pair, noise, make_solver("unipc", schedule), cond, uncond=uncond)
    assert switches == [(None, HIGH_NOISE), (HIGH_NOISE, LOW_NOISE)]
    assert [int(t) for _, t, _ in high.calls] == [999, 999, 900, 900, 875, 875]
    assert [int(t) for _, t, _ in low.calls] == [874, 874, 600, 600, 100, 100]

    # The same run by hand: high-noise scale 4 while t >= 875, low-noise scale 3 after.
    solver, x = make_solver("unipc", schedule), noise
    for t in schedule.timesteps.tolist():
        model, scale = (high, 4.0) if t >= 875 else (low, 3.0)
        tt = torch.full((1,), float(t))
        c, u = model(x, tt, cond), model(x, tt, uncond)
        x = solver.step(u + scale * (c - u), x)
    assert torch.equal(out, x)


def test_expert_plan_official_defaults():
    # T2V-A14B: 40 steps, shift 12, boundary 0.875; I2V-A14B: 40 steps, shift 5, boundary 0.9.
    t2v = ExpertPair(None, None, 0.875).steps_of(make_schedule("unipc", 40, 12.0))
    i2v = ExpertPair(None, None, 0.9).steps_of(make_schedule("unipc", 40, 5.0))
    assert len(t2v[HIGH_NOISE]) == 26 and len(i2v[HIGH_NOISE]) == 15
    with pytest.raises(ValueError, match="boundary"):
        ExpertPair(None, None, 1.5)


# ---------------------------------------------------------------- the loop

def test_fixed_first_frame():
    schedule = make_schedule("unipc", 5, 5.0)
    noise = make_noise(SHAPE, 6)
    noise_before = noise.clone()
    first = make_noise((1, SHAPE[1], 1, SHAPE[3], SHAPE[4]), 7)
    model = RecordingModel()
    seen = []
    out = denoise(model, noise, make_solver("unipc", schedule), _conds()[0], first_frame=first,
                  callback=lambda i, n, x: seen.append(torch.equal(x[:, :, :1], first)))
    assert torch.equal(out[:, :, :1], first)
    assert seen == [True] * schedule.steps
    assert torch.equal(noise, noise_before)
    for (_, t, _), timestep in zip(model.calls, schedule.timesteps.tolist()):
        assert t.shape == (1, SHAPE[2])
        assert t[0, 0].item() == 0.0 and torch.all(t[0, 1:] == timestep)
    # The other frames still move.
    assert not torch.equal(out[:, :, 1:], noise[:, :, 1:])


def test_callback_and_progress():
    schedule = make_schedule("euler", 4, 5.0)
    progress = []
    denoise(lambda x, t, c: x, make_noise(SHAPE, 8), make_solver("euler", schedule),
            callback=lambda i, n, x: progress.append((i, n)))
    assert progress == [(0, 4), (1, 4), (2, 4), (3, 4)]


class Interrupted(Exception):
    pass


def test_interrupt_propagates_and_frees():
    schedule = make_schedule("unipc", 8, 5.0)
    solver = make_solver("unipc", schedule)
    produced = []

    def model(x, t, cond):
        v = 0.3 * x
        produced.append(weakref.ref(v))
        return v

    checks = []

    def interrupt():
        checks.append(1)
        if len(checks) == 4:
            raise Interrupted()

    with pytest.raises(Interrupted) as info:
        denoise(model, make_noise(SHAPE, 9), solver, interrupt=interrupt,
                callback=lambda i, n, x: produced.append(weakref.ref(x)))
    assert len(checks) == 4
    assert info.value.__traceback__ is not None  # the exception is still alive here
    gc.collect()
    assert all(ref() is None for ref in produced)
    assert solver._x0_prev is None and solver._sample_prev is None


def test_model_exception_frees_tensors():
    produced = []

    def failing_model(x, t, cond):
        big = torch.zeros(SHAPE)
        produced.append(weakref.ref(big))
        if len(produced) == 3:
            raise RuntimeError("out of memory")
        return big

    schedule = make_schedule("dpm++", 5, 5.0)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        denoise(failing_model, make_noise(SHAPE, 10), make_solver("dpm++", schedule))
    assert info.value is not None
    gc.collect()
    assert all(ref() is None for ref in produced)


def test_partial_denoise_starts_at_the_right_step():
    steps, strength = 10, 0.6
    full = make_schedule("unipc", steps, 5.0)
    part = make_schedule("unipc", steps, 5.0, denoise=strength)
    clean, noise = make_noise(SHAPE, 11), make_noise(SHAPE, 12)
    start = noise_latent(clean, noise, part)
    sigma = float(full.sigmas[4])
    assert torch.equal(start, (1 - sigma) * clean + sigma * noise)
    model = RecordingModel()
    denoise(model, start, make_solver("unipc", part), _conds()[0])
    assert [int(t) for _, t, _ in model.calls] == full.timesteps[4:].tolist()


def test_make_noise_is_seeded_and_device_independent():
    a, b = make_noise(SHAPE, 42), make_noise(SHAPE, 42, device="cpu")
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, make_noise(SHAPE, 43))
    generator = torch.Generator().manual_seed(42)
    assert torch.equal(a, torch.randn(SHAPE, generator=generator))
    with pytest.raises(ValueError, match="seed"):
        make_noise(SHAPE, 1.5)


def test_toy_model_formula():
    model = toy_model(0.3, -0.1)
    x = torch.ones(SHAPE)
    v = model(x, torch.full((1,), 500.0), None)
    assert torch.allclose(v, torch.full(SHAPE, 0.3 - 0.05))
