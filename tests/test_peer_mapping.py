"""The peer benchmark's weight mapping: diffusers' models on our tensors compute what ours do.

bench/peer_diffusers.py hands one set of random weights to our DiT/VAE and, renamed, to
diffusers' WanTransformer3DModel/AutoencoderKLWan. Its time and memory ratios mean something only
if both run the same network; here both run in float32 on the CPU and must agree to float32
rounding. Skipped where diffusers is not installed (it is not a dependency of the package).
"""

import pytest
import torch

pytest.importorskip("diffusers")

from wan_enhanced.checkpoints.tiny import TINY_DIT, TINY_VAE  # noqa: E402
from wan_enhanced.vae_tiling.decode import decode_to_images  # noqa: E402
from wan_enhanced.wan.dit import WanDiT  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def peer():
    from wan_enhanced.bench import peer_diffusers
    return peer_diffusers


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max())


def dit_pair(peer, config):
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = peer.random_state(skeleton, 0, CPU, torch.float32)
    return peer.ours_dit(config, state, torch.float32), peer.diffusers_dit(config, state)


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_wan21_dit_matches_diffusers(peer, kind):
    config = TINY_DIT[kind]
    ours, theirs = dit_pair(peer, config)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 3, 6, 8, generator=gen)
    y = torch.randn(1, 20, 3, 6, 8, generator=gen) if kind == "i2v" else None
    clip = torch.randn(1, 257, config.image_dim, generator=gen) if kind == "i2v" else None
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen)
    t = torch.tensor([437.5])
    with torch.inference_mode():
        expected = theirs(hidden_states=x if y is None else torch.cat([x, y], 1), timestep=t,
                          encoder_hidden_states=context, encoder_hidden_states_image=clip,
                          return_dict=False)[0]
        got = ours(x, t, context, y=y, clip_tokens=clip)
    assert got.shape == expected.shape
    assert relative_difference(got, expected) < 1e-5


def test_wan22_ti2v_dit_matches_diffusers_with_per_token_timesteps(peer):
    """diffusers' TI2V pipeline passes one timestep per patch token; ours one per latent frame.
    The first frame at t=0 (the conditioning image) and the rest at t exercises that mapping."""
    config = TINY_DIT["ti2v"]
    ours, theirs = dit_pair(peer, config)
    gen = torch.Generator().manual_seed(2)
    f, h, w = 3, 6, 8
    x = torch.randn(1, 48, f, h, w, generator=gen)
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen)
    per_frame = torch.tensor([0.0, 812.0, 812.0])
    per_token = per_frame.repeat_interleave((h // 2) * (w // 2)).unsqueeze(0)
    with torch.inference_mode():
        expected = theirs(hidden_states=x, timestep=per_token, encoder_hidden_states=context,
                          return_dict=False)[0]
        got_tokens = ours(x, per_token, context)
        got_frames = ours(x, per_frame.unsqueeze(0), context)
    assert relative_difference(got_tokens, expected) < 1e-5
    assert relative_difference(got_frames, expected) < 1e-5


@pytest.mark.parametrize("kind,latent", [("vae21", (1, 16, 2, 4, 6)), ("vae22", (1, 48, 2, 3, 4))])
def test_vae_decode_matches_diffusers(peer, kind, latent):
    config = peer.vae_arguments(kind, TINY_VAE[kind])
    with torch.device("meta"):
        skeleton = peer.VAE_CLASSES[kind](**config)
    state = peer.random_state(skeleton, 0, CPU, torch.float32)
    ours = peer.ours_vae(kind, config, state)
    theirs = peer.diffusers_vae(kind, config, state)
    z = torch.randn(latent, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = peer.images_from_video(theirs.decode(z, return_dict=False)[0])
        got = decode_to_images(ours, z, tiled=False)
    assert got.shape == expected.shape
    # both clamp to [-1, 1]; random weights saturate a share of the pixels, not all of them
    assert 0.05 < float(((expected > 0) & (expected < 1)).float().mean())
    assert float((got - expected).abs().max()) < 1e-5
