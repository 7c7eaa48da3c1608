"""Step caching (sampling/step_cache.py): EasyCache's decisions equal ComfyUI's own on the same
runs (tests/data/easycache, written by conformance/make_easycache_reference.py with ComfyUI
0.30's EasyCache), whichever way guidance calls the model; a zero threshold changes nothing."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wan_enhanced.conformance.make_easycache_reference import euler_run, shifted_sigmas, stand_in
from wan_enhanced.sampling.guidance import CfgConditioning, guided_velocity
from wan_enhanced.sampling.step_cache import (EasyCacheModel, EasyCacheSettings,
                                              percent_to_sigma)

DATA = Path(__file__).parent / "data" / "easycache"
REFERENCE = json.loads((DATA / "reference.json").read_text())
TENSORS = load_file(str(DATA / "reference.safetensors"))


def replay(run: dict, threshold: float | None = None, cache: bool = True):
    """The reference's driver (its grid, stand-in model and Euler update) with our loop's
    guidance call and our EasyCache: (final sample, steps skipped, model calls)."""
    name = run["name"]
    tensors = {k[len(name) + 1:]: v for k, v in TENSORS.items() if k.startswith(name + ".")}
    cond, uncond = object(), object()
    batched = object() if run["batched"] else None
    calls = []
    state = {}

    def model(x, t, conditioning):
        sigma = state["sigma"]
        calls.append(conditioning)
        if conditioning is batched:
            return torch.cat([stand_in(tensors, x[:1], sigma.view(1), "cond"),
                              stand_in(tensors, x[1:], sigma.view(1), "uncond")])
        branch = "cond" if conditioning is cond else "uncond"
        return stand_in(tensors, x, sigma.view(1), branch)

    settings = EasyCacheSettings(threshold=run["threshold"] if threshold is None else threshold,
                                 start_percent=run["start_percent"],
                                 end_percent=run["end_percent"], subsample=run["subsample"])
    wrapped = EasyCacheModel(model, settings, run["shift"], cond=cond, uncond=uncond,
                             batched=batched, uses_uncond=run["cfg"] != 1) if cache else model
    conditioning = CfgConditioning(cond, uncond, batched)
    def step_velocity(x, sigma):
        state["sigma"] = sigma
        t = (sigma.double() * 1000).view(1)  # (exactly the float32 sigma, over 1000)
        return guided_velocity(wrapped, x, t, conditioning, run["cfg"])

    x = euler_run(step_velocity, tensors["x0"], shifted_sigmas(run["steps"], run["shift"]))
    return x, (wrapped.skipped if cache else []), calls, tensors


@pytest.mark.parametrize("run", REFERENCE["runs"], ids=lambda r: r["name"])
def test_our_decisions_and_samples_equal_comfyuis(run):
    final, skipped, calls, tensors = replay(run)
    assert skipped == run["skipped"]
    assert len(skipped) == run["total_skipped"] > 0
    torch.testing.assert_close(final, tensors["final"], rtol=1e-6, atol=1e-6)
    # a skipped step calls no model: cfg 1 one call a step, else one batched or two
    per_step = 1 if run["cfg"] == 1 or run["batched"] else 2
    assert len(calls) == per_step * (run["steps"] - len(skipped))


@pytest.mark.parametrize("run", REFERENCE["runs"][:4], ids=lambda r: r["name"])
def test_a_zero_threshold_skips_nothing_and_changes_nothing(run):
    cached, skipped, _, _ = replay(run, threshold=0.0)
    plain, _, _, _ = replay(run, cache=False)
    assert skipped == [] and torch.equal(cached, plain)


def test_the_start_and_end_sigmas_are_comfyuis_percent_to_sigma():
    for run in REFERENCE["runs"]:
        assert percent_to_sigma(run["start_percent"], run["shift"]) == \
            pytest.approx(run["start_sigma"], rel=1e-12)
        assert percent_to_sigma(run["end_percent"], run["shift"]) == \
            pytest.approx(run["end_sigma"], rel=1e-12)
    assert percent_to_sigma(0.0, 5.0) == 1.0 and percent_to_sigma(1.0, 5.0) == 0.0
