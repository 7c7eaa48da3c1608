"""TeaCache (sampling/teacache.py through sampling/residual_cache.py): its decisions and samples
equal the reference's on the same runs (tests/data/teacache, written by
conformance/make_teacache_reference.py running TeaCache4Wan2.1's teacache_forward and setup on a
stand-in model), for every published coefficient set, with and without use_ret_steps; our
coefficients are the ones the reference picks."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wan_enhanced.conformance.cache_reference import StandIn, euler_run, inputs, shifted_sigmas
from wan_enhanced.sampling.guidance import CfgConditioning, guided_velocity
from wan_enhanced.sampling.residual_cache import ResidualCache
from wan_enhanced.sampling.teacache import COEFFICIENTS, TeaCache, TeaCacheSettings, polynomial

from cache_replay import assert_reference_decisions

DATA = Path(__file__).parent / "data" / "teacache"
REFERENCE = json.loads((DATA / "reference.json").read_text())
FINALS = load_file(str(DATA / "reference.safetensors"))


def replay(run: dict, threshold: float | None = None, cache: bool = True):
    """The reference's driver with our loop's guidance and our TeaCache: (final sample, the
    calls skipped as [step, branch], block runs)."""
    model = StandIn(run["seed"])
    tensors = inputs(run["seed"])
    cond, uncond = tensors["cond"], tensors["uncond"]
    ran = []
    model.blocks[0].register_forward_hook(lambda *_: ran.append(1))
    settings = TeaCacheSettings(COEFFICIENTS[run["table"]][run["use_ret_steps"]],
                                run["threshold"] if threshold is None else threshold,
                                run["use_ret_steps"])
    steps = run["steps"]
    cached = ResidualCache(TeaCache(settings, steps), steps, cond=cond,
                           uncond=uncond if run["cfg"] != 1 else None)
    fn = cached.model(model.ours) if cache else \
        (lambda x, t, c: model.ours(x, t, c, lambda tokens, e, e0, blocks: blocks(tokens)))
    conditioning = CfgConditioning(cond, uncond)
    with torch.no_grad():
        final = euler_run(lambda x, step, t: guided_velocity(fn, x, t, conditioning, run["cfg"]),
                          tensors["x0"], shifted_sigmas(steps, run["shift"]))
    return final, [list(s) for s in cached.skipped], len(ran)


@pytest.mark.parametrize("run", REFERENCE["runs"], ids=lambda r: r["name"])
def test_our_decisions_and_samples_equal_the_references(run):
    final, skipped, blocks_ran = replay(run)
    assert_reference_decisions(run, skipped, blocks_ran)
    torch.testing.assert_close(final, FINALS[f"{run['name']}.final"], rtol=1e-6, atol=1e-6)
    assert list(COEFFICIENTS[run["table"]][run["use_ret_steps"]]) == run["coefficients"]


@pytest.mark.parametrize("run", REFERENCE["runs"], ids=lambda r: r["name"])
def test_the_always_full_steps_never_skip(run):
    steps = run["steps"]
    full = set(range(5)) if run["use_ret_steps"] else {0, steps - 1}
    assert not [s for s in run["skipped"] if s[0] in full]


def test_a_zero_threshold_with_a_positive_polynomial_changes_nothing():
    """I2V 480P with use_ret_steps: its polynomial is positive on the stand-in's changes, so no
    sum stays under 0."""
    run = next(r for r in REFERENCE["runs"] if r["table"] == "wan2.1-i2v-14b-480p"
               and r["use_ret_steps"])
    cached, skipped, blocks_ran = replay(run, threshold=0.0)
    plain, _, plain_ran = replay(run, cache=False)
    assert skipped == [] and blocks_ran == plain_ran and torch.equal(cached, plain)


def test_the_polynomial_is_numpys_polyval():
    import numpy as np

    for per_model in COEFFICIENTS.values():
        for coefficients in per_model.values():
            for x in (0.0, 0.013, 0.07, 0.31, 1.7):
                assert polynomial(coefficients, x) == float(np.poly1d(coefficients)(x))
