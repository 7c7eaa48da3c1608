"""Wan2.1 / Wan2.2 VAE: golden conformance, checkpoint layout, causality, streaming, dtypes, and
that a call leaves nothing behind on the modules."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from wan_enhanced.conformance.golden_file import read_golden
from wan_enhanced.conformance.run_vae import build_model, run
from wan_enhanced.wan.latent_format import WAN21_LATENT, WAN22_LATENT, normalise_latent
from wan_enhanced.wan.vae21 import WanVAE21
from wan_enhanced.wan.vae22 import WanVAE22
from wan_enhanced.wan.vae_blocks import CausalCache, CausalConv3d

GOLDEN_DIR = Path(__file__).parent / "golden"
KEY_MANIFESTS = Path(__file__).parent / "data" / "key_manifests.json"
KINDS = ["vae21", "vae22"]


def rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    actual, reference = actual.double(), reference.double()
    return float((actual - reference).abs().max() / reference.abs().max())


@pytest.fixture(scope="module", params=KINDS)
def golden(request):
    return read_golden(GOLDEN_DIR / f"{request.param}.safetensors")


@pytest.fixture(scope="module")
def model(golden):
    return build_model(golden)


@pytest.fixture(scope="module")
def video(golden):
    return golden.cases()[0].inputs["video"]


# --- conformance -------------------------------------------------------------------------------

def test_golden_outputs_within_tolerance(golden):
    scores = run(golden)
    for s in scores:
        print(f"{golden.kind}: {s.line()}")
    assert {(s.case, s.output) for s in scores} == {
        (c.name, name) for c in golden.cases() for name in c.expected}
    assert all(s.passed for s in scores), [s.line() for s in scores if not s.passed]


def test_latent_statistics_equal_the_golden_constants(golden):
    fmt = {"vae21": WAN21_LATENT, "vae22": WAN22_LATENT}[golden.kind]
    assert torch.equal(fmt.mean_tensor(), golden.tensor("const.latents_mean"))
    assert torch.equal(fmt.std_tensor(), golden.tensor("const.latents_std"))
    # The stored normalised latent is the stored mu normalised exactly as we do it.
    for case in golden.cases():
        assert torch.equal(fmt.normalise(case.expected["latent_raw"]), case.expected["latent"])
        assert torch.equal(
            normalise_latent(case.expected["latent_raw"], golden.tensor("const.latents_mean"),
                             golden.tensor("const.latents_std")),
            case.expected["latent"])


# --- checkpoint layout -------------------------------------------------------------------------

def test_golden_weights_load_strictly(golden):
    vae = {"vae21": WanVAE21, "vae22": WanVAE22}[golden.kind](**golden.config)
    result = vae.load_state_dict(golden.weights, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert not list(vae.buffers())


@pytest.mark.parametrize("cls, manifest_entry, z_dim, spatial_stride", [
    (WanVAE21, "official/vae21", 16, 8),
    (WanVAE22, "official/vae22", 48, 16),
])
def test_real_size_keys_and_shapes_match_the_official_checkpoint(cls, manifest_entry, z_dim,
                                                                 spatial_stride):
    expected = {k: shape for k, (shape, _dtype) in json.loads(KEY_MANIFESTS.read_text())
                [manifest_entry].items()}
    with torch.device("meta"):
        vae = cls()
    ours = {k: list(v.shape) for k, v in vae.state_dict().items()}
    assert sorted(set(ours) - set(expected)) == []
    assert sorted(set(expected) - set(ours)) == []
    assert {k: s for k, s in ours.items() if expected[k] != s} == {}
    assert (vae.z_dim, vae.spatial_stride, vae.temporal_stride) == (z_dim, spatial_stride, 4)


# --- chunked causal processing -----------------------------------------------------------------

def test_encode_shape_and_frame_count_check(model, video):
    mu = model.encode(video)
    b, _, t, h, w = video.shape
    s = model.spatial_stride
    assert list(mu.shape) == [b, model.z_dim, 1 + (t - 1) // 4, h // s, w // s]
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        model.encode(video[:, :, :-1])


def test_changing_the_last_frame_leaves_earlier_latent_frames_bitwise_unchanged(model, video):
    edited = video.clone()
    edited[:, :, -1] = -edited[:, :, -1]
    before, after = model.encode(video), model.encode(edited)
    assert torch.equal(before[:, :, :-1], after[:, :, :-1])
    assert not torch.equal(before[:, :, -1], after[:, :, -1])


def test_changing_the_last_latent_frame_leaves_earlier_output_frames_bitwise_unchanged(model, video):
    mu = model.encode(video)
    edited = mu.clone()
    edited[:, :, -1] += 1.0
    before, after = model.decode(mu), model.decode(edited)
    earlier = 1 + 4 * (mu.shape[2] - 2)
    assert torch.equal(before[:, :, :earlier], after[:, :, :earlier])
    assert not torch.equal(before[:, :, earlier:], after[:, :, earlier:])


def test_decode_frames_streams_one_then_four_frames_and_concatenates_to_decode(model, video):
    mu = model.encode(video)
    chunks = list(model.decode_frames(mu))
    assert [c.shape[2] for c in chunks] == [1] + [4] * (mu.shape[2] - 1)
    assert torch.equal(torch.cat(chunks, dim=2), model.decode(mu))


# --- reduced precision -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_runs_close_to_float32(golden, model, video, dtype, bound):
    mu32 = model.encode(video)
    video32 = model.decode(mu32)
    half = build_model(golden).to(dtype)
    mu = half.encode(video)
    decoded = half.decode(mu32)
    assert mu.dtype == decoded.dtype == dtype
    assert torch.isfinite(mu).all() and torch.isfinite(decoded).all()
    print(f"{golden.kind} {dtype}: encode rel {rel(mu, mu32):.2e}, "
          f"decode rel {rel(decoded, video32):.2e}")
    assert rel(mu, mu32) < bound and rel(decoded, video32) < bound


# --- nothing survives a call -------------------------------------------------------------------

def _module_state(vae: torch.nn.Module) -> dict:
    """Every attribute of every submodule, with tensors recorded by identity."""
    state = {}
    for name, module in vae.named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                value = {k: id(v) for k, v in value.items()}
            elif isinstance(value, torch.Tensor):
                value = id(value)
            elif not isinstance(value, (int, float, str, bool, tuple, type(None))):
                value = type(value).__name__
            state[f"{name}.{attr}"] = value
    return state


def _watch_caches_and_activations(vae: torch.nn.Module, refs: list) -> list:
    """Hooks every causal conv to keep weak references to its cache and its output."""
    def before(module, args):
        if len(args) > 1 and isinstance(args[1], CausalCache):
            refs.append(weakref.ref(args[1]))

    def after(module, args, output):
        refs.append(weakref.ref(output))

    handles = []
    for module in vae.modules():
        if isinstance(module, CausalConv3d):
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))
    return handles


def test_a_call_leaves_no_tensor_on_the_modules(golden, video):
    vae = build_model(golden)
    state_before = _module_state(vae)
    keys_before = {k: v.data_ptr() for k, v in vae.state_dict().items()}
    refs: list = []
    handles = _watch_caches_and_activations(vae, refs)
    try:
        mu = vae.encode(video)
        decoded = vae.decode(mu)
    finally:
        for handle in handles:
            handle.remove()
    del decoded
    gc.collect()
    assert refs and all(ref() is None for ref in refs), "an intermediate or cache outlived the call"
    assert _module_state(vae) == state_before
    assert {k: v.data_ptr() for k, v in vae.state_dict().items()} == keys_before


def test_an_abandoned_decode_stream_releases_its_cache(golden, video):
    vae = build_model(golden)
    mu = vae.encode(video)
    refs: list = []
    handles = _watch_caches_and_activations(vae, refs)
    try:
        stream = vae.decode_frames(mu)
        first = next(stream)
        assert first.shape[2] == 1
        assert any(ref() is not None for ref in refs)  # the stream holds its cache while open
        del stream, first
    finally:
        for handle in handles:
            handle.remove()
    gc.collect()
    assert all(ref() is None for ref in refs)
