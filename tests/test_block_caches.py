"""TeaCache and MagCache on a tiny real Wan DiT through wan/dit.py's block_stack hook: a
threshold of 0 gives the uncached run bit for bit; a skipped call runs no block and gives the
head of its tokens plus the branch's last residual (the last block's output minus the first
block's input); block swap gives the same numbers; the sampler node runs both, says what it
skipped, and refuses a model without a published table by name."""

import logging

import pytest
import torch

from wan_enhanced.checkpoints.tiny import TINY_DIT, randomize
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.offload.block_swap import BlockSwap
from wan_enhanced.sampling.loop import denoise
from wan_enhanced.sampling.magcache import MagCache, MagCacheSettings, plan
from wan_enhanced.sampling.magcache_ratios import MAG_RATIOS
from wan_enhanced.sampling.residual_cache import ResidualCache
from wan_enhanced.sampling.solvers import make_schedule, make_solver
from wan_enhanced.sampling.teacache import COEFFICIENTS, TeaCache, TeaCacheSettings
from wan_enhanced.wan.dit import WanDiT

STEPS, CFG = 12, 4.0


@pytest.fixture(scope="module")
def dit():
    model = WanDiT(TINY_DIT["t2v"]).eval()
    model.load_state_dict(randomize(model, 0))
    return model


def inputs():
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(1, 16, 2, 8, 8, generator=gen),
            torch.randn(1, 6, 64, generator=gen), torch.randn(1, 6, 64, generator=gen))


def sample(dit, policy=None, swap: BlockSwap | None = None):
    """(final sample, block runs, the cache) of a cfg 4 Euler run; policy None: uncached."""
    noise, cond, uncond = inputs()
    ran = []
    handle = dit.blocks[0].register_forward_hook(lambda *_: ran.append(1))

    def forward(x, t, context, block_stack=None):
        return dit(x, t, context, block_stack=block_stack,
                   blocks=None if swap is None else swap.blocks())
    cache = None if policy is None else ResidualCache(policy, STEPS, cond=cond, uncond=uncond)
    model = forward if cache is None else cache.model(forward)
    try:
        with torch.no_grad():
            out = denoise(model, noise, make_solver("euler", make_schedule("euler", STEPS, 5.0)),
                          cond, uncond=uncond, guidance_scale=CFG)
    finally:
        handle.remove()
    return out, len(ran), cache


def magcache(threshold: float) -> MagCache:
    return MagCache(MagCacheSettings(MAG_RATIOS["wan2.1-t2v-1.3b"], threshold), STEPS)


def test_a_zero_threshold_changes_nothing(dit):
    plain, plain_ran, _ = sample(dit)
    assert plain_ran == 2 * STEPS
    # (I2V 480P with ret steps: a polynomial positive on these changes, so no sum stays under 0)
    tea = TeaCache(TeaCacheSettings(COEFFICIENTS["wan2.1-i2v-14b-480p"][True], 0.0, True), STEPS)
    for policy in (magcache(0.0), tea):
        cached, ran, cache = sample(dit, policy)
        assert cache.skipped == [] and ran == plain_ran and torch.equal(cached, plain)


def test_skipped_calls_run_no_block(dit):
    plain, plain_ran, _ = sample(dit)
    policy = magcache(0.5)
    cached, ran, cache = sample(dit, policy)
    planned = [(i // 2, i % 2) for i, skip in enumerate(policy.plan) if skip]
    assert cache.skipped == planned and len(planned) > 0
    assert ran == plain_ran - len(planned)  # blocks counted: each skipped call ran none
    assert not torch.equal(cached, plain) and bool(torch.isfinite(cached).all())
    # (the random time embedding changes far more per step than a trained one: the 14B
    # polynomial is negative there, so every call past the first step skips)
    tea = TeaCache(TeaCacheSettings(COEFFICIENTS["wan2.1-t2v-14b"][False], 0.2), STEPS)
    _, ran, cache = sample(dit, tea)
    assert len(cache.skipped) > 0 and ran == plain_ran - len(cache.skipped)


def test_a_skipped_call_is_the_head_of_tokens_plus_the_residual(dit):
    class SecondSkips:
        def skips(self, step, branch, e, e0):
            return step == 1

    noise, cond, _ = inputs()
    cache = ResidualCache(SecondSkips(), 2, cond=cond)
    seen = {}

    def forward(x, t, context, block_stack):
        def watch(tokens, e, e0, run_blocks):
            seen["in"] = tokens.clone()
            seen["out"] = block_stack(tokens, e, e0, run_blocks).clone()
            return seen["out"]
        return dit(x, t, context, block_stack=watch)

    model = cache.model(forward)
    t0, t1 = torch.tensor([900.0]), torch.tensor([700.0])
    with torch.no_grad():
        model(noise, t0, cond)
        residual = cache.residuals[0]
        assert torch.equal(residual, seen["out"] - seen["in"])
        plain_first = dit(noise, t0, cond)
        assert torch.equal(dit(noise, t0, cond, block_stack=lambda tk, e, e0, run: run(tk)),
                           plain_first)
        x1 = noise * 0.9
        skipped = model(x1, t1, cond)
        expected = dit(x1, t1, cond, block_stack=lambda tk, e, e0, run: tk + residual)
    assert cache.skipped == [(1, 0)] and torch.equal(skipped, expected)


def test_block_swap_gives_the_same_numbers(dit):
    cached, ran, cache = sample(dit, magcache(0.5))
    with BlockSwap(list(dit.blocks), range(1), "cpu", 2) as swap:
        swapped, swapped_ran, swapped_cache = sample(dit, magcache(0.5), swap)
    assert torch.equal(swapped, cached) and swapped_ran == ran
    assert swapped_cache.skipped == cache.skipped


def test_plans_follow_the_step_count():
    settings = MagCacheSettings(MAG_RATIOS["wan2.1-t2v-14b"], 0.12)
    assert len(plan(settings, 7)) == 14 and len(plan(settings, 50)) == 100
    assert not any(plan(settings, 50)[:int(100 * 0.2)])  # the retention window runs in full


# -- the sampler node ------------------------------------------------------------------------

@pytest.fixture
def node_inputs(all_kinds_models, tmp_path, monkeypatch):
    from tiny_sets import ALL_TE, NAMES
    from wan_enhanced import host

    host.set_headless_folders(models=all_kinds_models, output=tmp_path / "out")
    host.clear_interrupt()
    (model,) = NODES["WanEnhancedModelLoader"]().load(NAMES["t2v"][0], "fp32", "sdpa")
    (encoder,) = NODES["WanEnhancedTextEncoderLoader"]().load(ALL_TE, "fp32", "cpu")
    pos, neg = NODES["WanEnhancedTextEncode"]().encode(encoder, "a red fox", "blurry")
    (latent,) = NODES["WanEnhancedEmptyLatent"]().make(model, 32, 32, 5, 1)
    yield model, pos, neg, latent
    host.set_headless_folders(models="models", output="output")


def run_node(model, pos, neg, latent, **kwargs):
    (out,) = NODES["WanEnhancedSampler"]().run(model, pos, neg, latent, 3, STEPS, CFG, 5.0,
                                               "euler", 1.0, **kwargs)
    return out["samples"]


def test_the_sampler_runs_both_and_says_what_it_skipped(node_inputs, monkeypatch, caplog):
    model, pos, neg, latent = node_inputs
    plain = run_node(model, pos, neg, latent)
    # the tiny model takes the name of a model both methods have tables for (one whose TeaCache
    # polynomials are negative on the random time embedding's changes, so TeaCache skips)
    monkeypatch.setattr(model.model, "config", model.config.renamed("wan2.1-t2v-14b"))
    assert torch.equal(run_node(model, pos, neg, latent, cache="magcache",
                                cache_threshold=0.0), plain)
    for method in ("magcache", "teacache", "teacache_ret_steps"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="wan_enhanced"):
            cached = run_node(model, pos, neg, latent, cache=method, cache_threshold=3.0)
        said = [r.getMessage() for r in caplog.records if "transformer blocks" in r.getMessage()]
        assert len(said) == 1 and "wan2.1-t2v-14b table" in said[0]
        assert f"of {2 * STEPS} forwards over {STEPS} steps" in said[0]
        assert "in 0 of" not in said[0] and not torch.equal(cached, plain)
    swapped = run_node(model, pos, neg, latent, cache="magcache", cache_threshold=3.0,
                       block_swap=1)
    assert torch.equal(swapped, run_node(model, pos, neg, latent, cache="magcache",
                                         cache_threshold=3.0))


def test_models_without_a_published_table_are_refused_by_name(node_inputs, monkeypatch):
    model, pos, neg, latent = node_inputs
    with pytest.raises(NodeInputError, match=r"Wan Sampler: cache: magcache has no published "
                       r"table for tiny_t2v.safetensors \(a size no released Wan model has\); it "
                       r"covers .*Wan2.2 "
                       r"TI2V-5B. For this model choose easycache"):
        run_node(model, pos, neg, latent, cache="magcache")
    monkeypatch.setattr(model.model, "config", model.config.renamed("wan2.1-flf2v-14b"))
    with pytest.raises(NodeInputError, match=r"teacache has no published table .*"
                       r"\(wan2.1-flf2v-14b\).* choose easycache"):
        run_node(model, pos, neg, latent, cache="teacache")
    monkeypatch.setattr(model.model, "config", model.config.renamed("wan2.2-ti2v-5b"))
    with pytest.raises(NodeInputError, match=r"teacache_ret_steps has no published table .*"
                       r"Wan2.1 I2V-14B 720P, Wan2.1 T2V-1.3B, Wan2.1 T2V-14B. For this model "
                       r"choose easycache or magcache"):
        run_node(model, pos, neg, latent, cache="teacache_ret_steps")
    with pytest.raises(NodeInputError, match="cache_threshold: -0.5 is negative"):
        run_node(model, pos, neg, latent, cache="magcache", cache_threshold=-0.5)
    with pytest.raises(NodeInputError, match="cache: magcache runs on one GPU; with gpus 2"):
        run_node(model, pos, neg, latent, cache="magcache", gpus=2)


def test_the_memory_guard_counts_the_residuals_the_cache_holds(dit):
    """block_cache_bytes: the residual each guidance branch keeps (what the cache holds after a
    run), and one more for the full pass that makes the next."""
    from wan_enhanced.pipeline import memory_guard as guard

    _, _, cache = sample(dit, magcache(0.0))
    held = sum(r.numel() * r.element_size() for r in cache.residuals.values())
    assert len(cache.residuals) == 2 and held > 0
    noise, _, _ = inputs()
    size = guard.size_of_latent(noise.shape, "vae21")
    assert guard.block_cache_bytes(dit.config, "vae21", size, 2) == held * 3 // 2
    assert guard.block_cache_bytes(dit.config, "vae21", size, 1) == held


def test_sampling_with_a_block_cache_is_refused_where_only_the_plain_run_fits(monkeypatch):
    """check_sampling adds the residuals: a device that holds the plain run exactly refuses the
    cached one, naming the step cache."""
    import types

    from wan_enhanced.pipeline import memory_guard as guard
    from wan_enhanced.wan.configs import KNOWN_DITS

    config = KNOWN_DITS["wan2.1-t2v-1.3b"].config
    model = torch.nn.Linear(2, 2)
    model.compute_dtype = torch.bfloat16
    handle = types.SimpleNamespace(model=model, config=config, vae_kind="vae21",
                                   name="a.safetensors", spatial_stride=16)
    shape = (1, 16, 21, 60, 104)
    size = guard.size_of_latent(shape, "vae21")
    plain = guard.sampling_bytes(config, "vae21", size, 2)
    monkeypatch.setattr(guard, "free_memory", lambda device: (plain, "this CPU"))
    guard.check_sampling(handle, shape, torch.device("cpu"))
    with pytest.raises(Exception, match="step cache residuals"):
        guard.check_sampling(handle, shape, torch.device("cpu"), cache_branches=2)
