"""The VAE decoder in channels_last_3d (the CUDA path): the same video as the NCDHW decoder within
float32 rounding, the CPU path untouched, and the fused channel-norm kernel against its PyTorch
statement (opt-in, --gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from test_tiled_decode import build_vae
from wan_enhanced.wan import channel_norm
from wan_enhanced.wan.vae22 import DuplicateUp, unfold_pixels
from wan_enhanced.wan.vae_blocks import (CausalCache, CausalConv3d, ChannelRMSNorm,
                                         NearestUpsample2x, _interleave_channel_halves,
                                         set_weight_layout)

KINDS = ("vae21", "vae22")
CL = torch.channels_last_3d


def conv_weights(vae: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in vae.decoder.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]


def decode_seeing_conv_inputs(vae: nn.Module, latent: torch.Tensor):
    """vae.decode(latent), and the input of every decoder convolution it ran, in order."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
             for m in vae.decoder.modules() if isinstance(m, (nn.Conv3d, nn.Conv2d))]
    try:
        return vae.decode(latent), seen
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 2])
def test_channels_last_decode_equals_the_ncdhw_decode(kind, batch):
    vae = build_vae(kind)
    latent = torch.randn(batch, vae.z_dim, 3, 6, 5, generator=torch.Generator().manual_seed(3))
    reference = vae.decode(latent)
    vae.decode_memory_format = CL
    try:
        decoded, seen = decode_seeing_conv_inputs(vae, latent)
    finally:
        vae.decode_memory_format = None
    assert decoded.shape == reference.shape
    assert (decoded - reference).abs().max() <= 1e-5 * reference.abs().max()
    # every layer kept the layout: the convolutions' inputs other than the latent's frames
    # (the CPU's convolution of a single video answers in NCDHW; cuDNN keeps it: see the GPU test)
    if batch > 1:
        assert all(x.is_contiguous(memory_format=CL) for x in seen if x.shape[1] != vae.z_dim)
    assert all(w.is_contiguous(memory_format=CL if w.dim() == 5 else torch.channels_last)
               for w in conv_weights(vae))
    # the next decode in the default layout (the CPU's) puts the weights back and is the same
    # to the bit as before
    assert torch.equal(vae.decode(latent), reference)
    assert all(w.is_contiguous() for w in conv_weights(vae))


@pytest.mark.parametrize("kind", KINDS)
def test_a_vae_loaded_in_inference_mode_decodes_channels_last_in_inference_mode(kind):
    """As ComfyUI and our runner run nodes: the loader makes the weights in inference mode and
    the decode, also in inference mode, reorders them (their views must stay usable)."""
    with torch.inference_mode():
        vae = build_vae(kind)
        latent = torch.randn(1, vae.z_dim, 2, 6, 5, generator=torch.Generator().manual_seed(4))
        reference = vae.decode(latent)
        vae.decode_memory_format = CL
        decoded = vae.decode(latent)
        assert all(w.is_inference() for w in conv_weights(vae))
        vae.decode_memory_format = None
        assert torch.equal(vae.decode(latent), reference)
    assert (decoded - reference).abs().max() <= 1e-5 * reference.abs().max()


def channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=CL)


def test_the_moving_layers_give_the_same_values_in_channels_last_order():
    x = torch.randn(2, 6, 3, 4, 5)
    for fn in (NearestUpsample2x(), _interleave_channel_halves):
        out = fn(channels_last(x))
        assert out.is_contiguous(memory_format=CL) and torch.equal(out, fn(x))
    folded = torch.randn(2, 12, 3, 4, 5)
    out = unfold_pixels(channels_last(folded), 2, channels_last=True)
    assert out.is_contiguous(memory_format=CL) and torch.equal(out, unfold_pixels(folded, 2))


@pytest.mark.parametrize("shape", [(8, 8, 2, 2), (8, 4, 1, 2), (8, 8, 1, 2)])
@pytest.mark.parametrize("first_chunk", [True, False])
def test_the_duplicating_shortcut_adds_in_place_what_it_would_copy(shape, first_chunk):
    channels, out_channels, ft, fs = shape
    up = DuplicateUp(channels, out_channels, ft, fs)
    t = 1 if first_chunk else 2
    x = torch.randn(2, channels, t, 3, 4)
    expected_shape = up(x, first_chunk).shape
    base = torch.randn(expected_shape)
    out = up.add_to(channels_last(base.clone()), channels_last(x), first_chunk)
    assert out.is_contiguous(memory_format=CL)
    assert torch.equal(out, base + up(x, first_chunk))


def test_a_causal_convolution_streams_its_history_without_a_concatenation():
    conv = CausalConv3d(4, 5, 3)
    set_weight_layout(conv, channels_last=True)
    chunks = [torch.randn(2, 4, t, 6, 7) for t in (1, 4, 4)]
    plain, streamed = CausalCache(), CausalCache(channels_last=True)
    for chunk in chunks:
        expected = conv(chunk, plain)
        got = conv(channels_last(chunk), streamed)
        assert got.is_contiguous(memory_format=CL)
        assert (got - expected).abs().max() <= 1e-5


def test_the_norm_into_a_buffer_falls_back_to_the_modules_off_cuda():
    norm = ChannelRMSNorm(6)
    nn.init.normal_(norm.gamma)
    x = channels_last(torch.randn(2, 6, 3, 4, 5))
    out = torch.empty(2, 6, 5, 4, 5, memory_format=CL)[:, :, 2:]
    assert not channel_norm.kernel_usable(x, out)
    norm.into(x, out, silu=True)
    assert torch.equal(out, torch.nn.functional.silu(norm(x)))
    # the statement the kernel is tested against is the module's arithmetic in float32
    assert (channel_norm.reference(x, norm.gamma, norm.scale, True) - out).abs().max() <= 1e-6
    bias = torch.randn(6)
    norm.into(x, out, silu=False, bias=bias)
    assert torch.equal(out, norm(x + bias.view(6, 1, 1, 1)))
    assert (channel_norm.reference(x, norm.gamma, norm.scale, False, bias) - out).abs().max() \
        <= 1e-6


def test_channels_last_rows_are_recognised():
    x = torch.randn(2, 6, 3, 4, 5)
    assert channel_norm.batch_stride(x) is None
    assert channel_norm.batch_stride(channels_last(x)) == 6 * 3 * 4 * 5
    buffer = torch.empty(2, 6, 5, 4, 5, memory_format=CL)
    assert channel_norm.batch_stride(buffer[:, :, 2:]) == 6 * 5 * 4 * 5


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("channels", [96, 192, 256, 384, 1024, 12])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("silu,with_bias", [(True, False), (False, False), (True, True)])
def test_channel_norm_kernel_matches_its_statement(channels, dtype, silu, with_bias):
    gen = torch.Generator(device="cuda").manual_seed(channels)
    x = channels_last(torch.randn(2, channels, 3, 9, 11, device="cuda", generator=gen) * 3)
    x = x.to(dtype)
    x[0, :, 0, 0, 0] = 0  # a zero pixel: the norm's floor, no NaN
    gamma = torch.randn(channels, 1, 1, 1, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(channels, device="cuda", generator=gen).to(dtype) if with_bias else None
    buffer = torch.full((2, channels, 5, 9, 11), float("nan"), device="cuda",
                        dtype=dtype).contiguous(memory_format=CL)
    out = buffer[:, :, 2:]
    assert channel_norm.kernel_usable(x, out)
    channel_norm.launch(x, gamma, channels ** 0.5, silu, out, bias)
    expected = channel_norm.reference(x, gamma, channels ** 0.5, silu, bias)
    assert torch.isnan(buffer[:, :, :2]).all()  # nothing written outside the view
    assert not torch.isnan(out).any()
    error = (out.double() - expected.double()).abs()
    # one rounding of a float32 value a few float32 ulps away: at most one step of bf16; in
    # float32 the product is formed in another order (x * (scale / norm) * gamma)
    step = torch.finfo(dtype).eps if dtype == torch.bfloat16 else 1e-5
    assert (error <= step * expected.double().abs() + 1e-6).all(), float(error.max())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_channels_last_decode_matches_the_ncdhw_decode(kind):
    vae = build_vae(kind).cuda()
    latent = torch.randn(1, vae.z_dim, 3, 6, 5, generator=torch.Generator().manual_seed(3)).cuda()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        vae.decode_memory_format = torch.contiguous_format
        reference = vae.decode(latent)
        vae.decode_memory_format = None  # CUDA: channels_last_3d and the kernel
        decoded, seen = decode_seeing_conv_inputs(vae, latent)
        assert all(x.is_contiguous(memory_format=CL) for x in seen if x.shape[1] != vae.z_dim)
        assert all(w.is_contiguous(memory_format=CL if w.dim() == 5 else torch.channels_last)
                   for w in conv_weights(vae))
        assert (decoded - reference).abs().max() <= 1e-4 * reference.abs().max()
        bf16 = vae.to(torch.bfloat16).decode(latent.bfloat16()).float()
        assert (bf16 - reference).abs().max() <= 0.05 * reference.abs().max()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
