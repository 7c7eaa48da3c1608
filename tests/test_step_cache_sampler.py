"""EasyCache inside the Wan Sampler's runs: each A14B expert keeps its own cache (a skipped step
of the low-noise expert never reuses the high-noise expert's residual), and block swap, which
only moves weights, leaves the cached run's latent unchanged."""

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES

from tiny_sets import ALL_TE as TE, NAMES


@pytest.fixture(scope="module")
def models(all_kinds_models):
    return all_kinds_models


@pytest.fixture
def headless(models, tmp_path):
    host.set_headless_folders(models=models, output=tmp_path / "out")
    host.clear_interrupt()
    yield tmp_path
    host.set_headless_folders(models="models", output="output")


def node(name):
    return NODES[f"WanEnhanced{name}"]()


def test_each_expert_of_a_pair_keeps_its_own_cache(headless, monkeypatch):
    dit, _ = NAMES["t2v"]
    (high,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (low,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a", "b")
    (latent,) = node("EmptyLatent").make(high, 32, 32, 5, 1)
    calls = []
    for name, handle in (("high", high), ("low", low)):
        original = handle.model.forward

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(handle.model, "forward", spy)

    def run(cache, block_swap=0):
        calls.clear()
        (out,) = node("Sampler").run(high, pos, neg, latent, seed=1, steps=20, cfg=3.0,
                                     shift=5.0, scheduler="euler", denoise=1.0,
                                     low_noise_model=low, boundary=0.875, cfg_low_noise=1.0,
                                     cache=cache, cache_threshold=3.0, block_swap=block_swap)
        return out["samples"], list(calls)

    full, full_calls = run("off")
    cached, cached_calls = run("easycache")
    # every expert ran its first steps in full, and each skipped some of its own
    for name in ("high", "low"):
        assert 0 < cached_calls.count(name) < full_calls.count(name)
    # a fresh cache measures two full forwards before it can skip: the low-noise expert's own
    assert cached_calls.count("low") >= 2
    # the high expert runs cfg 3 (two calls a step), the low one cfg 1 (one)
    assert full_calls.count("high") % 2 == 0
    assert cached.shape == full.shape and not torch.equal(cached, full)
    swapped, swapped_calls = run("easycache", block_swap=1)
    assert torch.equal(swapped, cached) and swapped_calls == cached_calls
