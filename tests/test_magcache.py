"""MagCache (sampling/magcache.py through sampling/residual_cache.py): its decisions and samples
equal the reference's on the same runs (tests/data/magcache, written by
conformance/make_magcache_reference.py running MagCache4Wan2.1's and MagCache4Wan2.2's forward
and setup on stand-in models): every published table, resampled to other step counts as the
reference does, A14B pairs with one state over both experts, TI2V-5B with and without an
image."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wan_enhanced.conformance.cache_reference import StandIn, euler_run, inputs, shifted_sigmas
from wan_enhanced.sampling.guidance import CfgConditioning, guided_velocity
from wan_enhanced.sampling.magcache import MagCache, MagCacheSettings, per_call_ratios, plan
from wan_enhanced.sampling.magcache_ratios import MAG_RATIOS
from wan_enhanced.sampling.residual_cache import ResidualCache

from cache_replay import assert_reference_decisions

DATA = Path(__file__).parent / "data" / "magcache"
REFERENCE = json.loads((DATA / "reference.json").read_text())
FINALS = load_file(str(DATA / "reference.safetensors"))


def settings_of(run: dict, threshold: float | None = None) -> MagCacheSettings:
    return MagCacheSettings(MAG_RATIOS[run["table"]],
                            run["threshold"] if threshold is None else threshold,
                            max_skips=run["K"], retention_ratio=run["retention_ratio"],
                            high_noise_steps=run["high_noise_steps"],
                            image_to_video=run["table"] == "wan2.2-i2v-a14b")


def replay(run: dict, threshold: float | None = None, cache: bool = True):
    """The reference's driver (its expert switch included) with our loop's guidance and one
    MagCache for the run: (final sample, the calls skipped as [step, branch], block runs)."""
    seed, split, steps = run["seed"], run["high_noise_steps"], run["steps"]
    models = [StandIn(seed)] if split is None else [StandIn(seed), StandIn(100 + seed)]
    tensors = inputs(seed)
    cond, uncond = tensors["cond"], tensors["uncond"]
    ran = []
    for model in models:
        model.blocks[0].register_forward_hook(lambda *_: ran.append(1))
    cached = ResidualCache(MagCache(settings_of(run, threshold), steps), steps, cond=cond,
                           uncond=uncond if run["cfg"] != 1 else None)
    fns = [cached.model(m.ours) if cache else
           (lambda x, t, c, m=m: m.ours(x, t, c, lambda tokens, e, e0, blocks: blocks(tokens)))
           for m in models]
    conditioning = CfgConditioning(cond, uncond)

    def step_velocity(x, step, t):
        fn = fns[0] if split is None or step < split else fns[-1]
        return guided_velocity(fn, x, t, conditioning, run["cfg"])

    with torch.no_grad():
        final = euler_run(step_velocity, tensors["x0"], shifted_sigmas(steps, run["shift"]))
    return final, [list(s) for s in cached.skipped], len(ran)


@pytest.mark.parametrize("run", REFERENCE["runs"], ids=lambda r: r["name"])
def test_our_decisions_and_samples_equal_the_references(run):
    final, skipped, blocks_ran = replay(run)
    assert_reference_decisions(run, skipped, blocks_ran)
    # (the Wan2.2 reference embeds the timestep once per token: its linear layers see a batch
    # of rows, which float32 matrix products may round differently from one row)
    tolerance = 1e-6 if run["table"].startswith("wan2.1") else 1e-5
    torch.testing.assert_close(final, FINALS[f"{run['name']}.final"], rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("run", REFERENCE["runs"], ids=lambda r: r["name"])
def test_our_tables_resampled_are_the_references(run):
    assert per_call_ratios(MAG_RATIOS[run["table"]], run["steps"]) == run["ratios"]
    planned = plan(settings_of(run), run["steps"])
    assert [[i // 2, i % 2] for i, skip in enumerate(planned) if skip] == run["skipped"]


@pytest.mark.parametrize("run", REFERENCE["runs"][:8], ids=lambda r: r["name"])
def test_a_zero_threshold_skips_nothing_and_changes_nothing(run):
    cached, skipped, blocks_ran = replay(run, threshold=0.0)
    plain, _, plain_ran = replay(run, cache=False)
    assert skipped == [] and blocks_ran == plain_ran and torch.equal(cached, plain)


def test_no_more_than_k_calls_of_a_branch_skip_in_a_row():
    for run in REFERENCE["runs"]:
        planned = plan(settings_of(run), run["steps"])
        for branch in (0, 1):
            row = 0
            for skip in planned[branch::2]:
                row = row + 1 if skip else 0
                assert row <= run["K"]


def test_one_step_takes_the_last_entry_of_each_branch():
    table = MAG_RATIOS["wan2.1-t2v-14b"]
    assert per_call_ratios(table, 1) == [table[-2], table[-1]]
