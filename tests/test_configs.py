"""The table of model facts agrees with itself: every released DiT names a VAE of the table,
the one whose latents its channels are, and its video sizes divide by that VAE's stride."""

from wan_enhanced.wan.configs import KNOWN_DITS, VAES, pixel_stride, vae_kind, vae_spec


def test_every_known_model_points_at_the_vae_it_works_with():
    for name, known in KNOWN_DITS.items():
        assert known.vae in VAES, name
        assert vae_kind(known.config) == known.vae, name
        assert vae_spec(known.config).latent_channels == known.config.out_dim, name


def test_pixel_strides():
    assert pixel_stride(KNOWN_DITS["wan2.2-ti2v-5b"].config) == 32
    assert pixel_stride(KNOWN_DITS["wan2.1-t2v-14b"].config) == 16
    assert {spec.temporal_stride for spec in VAES.values()} == {4}
