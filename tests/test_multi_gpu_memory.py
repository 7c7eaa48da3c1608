"""The per-GPU estimate of a several-GPU run at real sizes (weights on the meta device), and the
refusal of what cannot fit even sharded, before anything loads."""

from types import SimpleNamespace

import pytest
import torch

from wan_enhanced.distributed.memory import check_fits_group, estimate
from wan_enhanced.pipeline.errors import InputError
from wan_enhanced.wan.configs import KNOWN_DITS
from wan_enhanced.wan.dit import WanDiT

GIB = 1 << 30
LATENT_720P = (1, 16, 21, 90, 160)  # 1280x720x81


def _handle(name="wan2.1-t2v-14b"):
    config = KNOWN_DITS[name].config
    with torch.device("meta"):
        model = WanDiT(config, compute_dtype=torch.bfloat16).to(torch.bfloat16)
    return SimpleNamespace(model=model, config=config, vae_kind="vae21", name=f"{name}.safetensors")


@pytest.fixture(scope="module")
def t2v_14b():
    return _handle()


def _gpus(monkeypatch, count, gib):
    props = SimpleNamespace(total_memory=gib * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_estimates_at_720p(t2v_14b):
    whole = estimate([t2v_14b], LATENT_720P, 2, fsdp=False, cfg_parallel=True)
    sharded = estimate([t2v_14b], LATENT_720P, 2, fsdp=True, cfg_parallel=True)
    assert 26 * GIB < whole.weights < 27 * GIB  # 14.3 billion bf16 values
    assert 13 * GIB < sharded.weights < 16 * GIB  # half the blocks, the rest and two blocks
    # CFG parallel on 2 GPUs: each computes every token of one pass
    split = estimate([t2v_14b], LATENT_720P, 2, fsdp=False, cfg_parallel=False)
    assert whole.activations > 1.8 * split.activations - 0.1 * GIB
    assert 3 * GIB < whole.activations < 8 * GIB


def test_fits_on_80_gib_without_fsdp(t2v_14b, monkeypatch):
    _gpus(monkeypatch, 2, 80)
    need = check_fits_group([t2v_14b], LATENT_720P, 2, False, True, "cuda")
    assert need.total < 80 * GIB


def test_refused_whole_but_fits_sharded(t2v_14b, monkeypatch):
    _gpus(monkeypatch, 4, 24)
    with pytest.raises(InputError) as caught:
        check_fits_group([t2v_14b], LATENT_720P, 4, False, True, "cuda")
    message = str(caught.value)
    assert message.startswith("gpus: sampling wan2.1-t2v-14b.safetensors at 1280x720x81 over 4 "
                              "GPUs needs about ")
    assert "per GPU (weights 26.6 GiB" in message and "the smallest GPU has 24.0 GiB in all" \
        in message and message.endswith("with fsdp on it fits")
    assert check_fits_group([t2v_14b], LATENT_720P, 4, True, True, "cuda").total < 24 * GIB


def test_a14b_pair_that_cannot_fit_even_sharded(t2v_14b, monkeypatch):
    _gpus(monkeypatch, 2, 24)
    with pytest.raises(InputError, match="with fsdp needs about .* use more GPUs or a smaller "
                                         "video$"):
        check_fits_group([t2v_14b, t2v_14b], LATENT_720P, 2, True, True, "cuda")
