"""ComfyUI's own LATENT and CONDITIONING keys reaching the Wan Sampler, built as ComfyUI's nodes
build them (comfy_extras/nodes_wan.py: Wan22ImageToVideoLatent, WanImageToVideo): each gives the
same video as this package's own form of the same input, or is refused by name."""

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.sampling.noise import make_noise
from wan_enhanced.wan.latent_format import WAN22_LATENT

from tiny_sets import ALL_TE as TE, CLIP, NAMES


@pytest.fixture(scope="module")
def models(all_kinds_models):
    host.set_headless_folders(models=all_kinds_models)
    yield all_kinds_models
    host.set_headless_folders(models="models")


def node(name):
    return NODES[f"WanEnhanced{name}"]()


def load(kind):
    dit, vae = NAMES[kind]
    (model,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (vae_handle,) = node("VAELoader").load(vae, "fp32")
    return model, vae_handle


@pytest.fixture(scope="module")
def text(models):
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    return node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")


def sample(model, positive, negative, latent, **kwargs):
    settings = dict(seed=5, steps=3, cfg=3.0, shift=5.0, scheduler="unipc", denoise=1.0)
    settings.update(kwargs)
    return node("Sampler").run(model, positive, negative, latent, **settings)[0]["samples"]


IMAGE = torch.rand(1, 40, 56, 3, generator=torch.Generator().manual_seed(4))


def comfy_ti2v_latent(first: torch.Tensor, frames: int) -> dict:
    """What Wan22ImageToVideoLatent returns for a start image encoded as `first` [1, 48, 1, h,
    w]: the raw frame where the mask is 0, the latent format's zero (its mean) elsewhere."""
    _, c, _, h, w = first.shape
    latent = torch.zeros(1, c, frames, h, w)
    latent[:, :, :1] = first
    mask = torch.ones(1, 1, frames, h, w)
    mask[:, :, :1] = 0
    samples = WAN22_LATENT.denormalise(latent) * mask + latent * (1 - mask)
    return {"samples": samples, "noise_mask": mask}


def test_wan22_image_to_video_latent_keeps_its_start_frame_as_ours_does(models, text):
    model, vae = load("ti2v")
    (ours,) = node("ImageToVideoLatent").make(model, vae, IMAGE, 64, 32, 9, 1)
    native = comfy_ti2v_latent(ours["first_frame"], ours["samples"].shape[2])
    expected = sample(model, *text, ours)
    got = sample(model, *text, native)
    assert torch.equal(got, expected)
    assert torch.allclose(got[:, :, :1], ours["first_frame"], atol=1e-5)  # the start image
    unmasked = sample(model, *text, {"samples": native["samples"]})
    assert not torch.allclose(unmasked, got)  # the mask is what kept it
    ones = dict(native, noise_mask=torch.ones_like(native["noise_mask"]))
    assert torch.equal(sample(model, *text, ones), unmasked)  # an all-ones mask changes nothing


@pytest.mark.parametrize("change, message", [
    (lambda m: m[:, :, :, :1, :], "is not a mask per latent frame"),
    (lambda m: m * 0.5 + 0.25, "not 0 or 1 over whole latent frames"),
    (lambda m: torch.cat([m[:, :, :, :1, :] * 0 + 1, m[:, :, :, 1:, :]], 3),
     "not 0 or 1 over whole latent frames"),
    (lambda m: torch.zeros_like(m), "leave at least one frame to generate"),
    (lambda m: m.flip(2), "keep the same leading latent frames"),
])
def test_other_noise_masks_are_refused(models, text, change, message):
    model, vae = load("ti2v")
    (ours,) = node("ImageToVideoLatent").make(model, vae, IMAGE, 64, 32, 9, 1)
    native = comfy_ti2v_latent(ours["first_frame"], ours["samples"].shape[2])
    native["noise_mask"] = change(native["noise_mask"])
    with pytest.raises(NodeInputError, match=f"Wan Sampler: latent: its noise_mask .*{message}"):
        sample(model, *text, native)


def test_a_kept_frame_on_a_one_timestep_model_and_both_forms_are_refused(models, text):
    t2v, _ = load("t2v")
    mask = torch.ones(1, 1, 3, 4, 4)
    mask[:, :, 0] = 0
    with pytest.raises(NodeInputError, match="noise_mask keeps the first 1 latent frame.*takes "
                                             "one timestep for all frames"):
        sample(t2v, *text, {"samples": torch.zeros(1, 16, 3, 4, 4), "noise_mask": mask})
    model, vae = load("ti2v")
    (ours,) = node("ImageToVideoLatent").make(model, vae, IMAGE, 64, 32, 9, 1)
    both = dict(ours, noise_mask=comfy_ti2v_latent(ours["first_frame"], 3)["noise_mask"])
    with pytest.raises(NodeInputError, match="both a first_frame .* and a noise_mask"):
        sample(model, *text, both)


def with_keys(conditioning, **keys):
    return [[conditioning[0][0], {**conditioning[0][1], **keys}]]


def comfy_i2v_conditioning(text, vae, width, height, frames):
    """What WanImageToVideo adds: the image then mid-grey frames encoded raw, and a mask that
    is 0 on the image's latent frame (ComfyUI's pixel 0.5 is our 0 in -1..1)."""
    from wan_enhanced.pipeline.start_image import fit_image

    pixels = fit_image(IMAGE, width, height).unsqueeze(2)
    video = torch.cat([pixels, torch.zeros(1, 3, frames - 1, height, width)], dim=2)
    image = vae.model.encode(video)
    mask = torch.ones(1, 1, image.shape[2], *image.shape[3:])
    mask[:, :, :1] = 0
    keys = {"concat_latent_image": image, "concat_mask": mask}
    return with_keys(text[0], **keys), with_keys(text[1], **keys)


def test_wan_image_to_video_conditioning_is_the_same_start_image_as_ours(models, text):
    model, vae = load("i2v_a14b")
    (ours,) = node("ImageToVideoLatent").make(model, vae, IMAGE, 48, 32, 9, 1)
    positive, negative = comfy_i2v_conditioning(text, vae, 48, 32, 9)
    expected = sample(model, *text, ours)
    got = sample(model, positive, negative, {"samples": ours["samples"]})
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    with pytest.raises(NodeInputError, match="negative: its concat_latent_image differs"):
        sample(model, positive, text[1], {"samples": ours["samples"]})
    with pytest.raises(NodeInputError, match="carries a start image .* and the positive "
                                             "conditioning another one"):
        sample(model, positive, negative, ours)
    ti2v, _ = load("ti2v")
    with pytest.raises(NodeInputError, match="positive: carries a start image "
                                             "\\(concat_latent_image.*has no image input"):
        sample(ti2v, positive, negative, {"samples": torch.zeros(1, 48, 3, 2, 3)})


def test_clip_vision_output_is_the_clip_tokens_wan21_i2v_attends_to(models, text):
    class ClipVisionOutput:  # comfy.clip_vision.Output: fields as attributes
        def __init__(self, tokens):
            self.penultimate_hidden_states = tokens

    model, vae = load("i2v")
    (clip,) = node("CLIPVisionLoader").load(CLIP, "fp32")
    (ours,) = node("ImageToVideoLatent").make(model, vae, IMAGE, 48, 32, 5, 1, clip_vision=clip)
    output = ClipVisionOutput(ours["clip_tokens"].clone())
    positive, negative = (with_keys(c, clip_vision_output=output) for c in text)
    without = {k: v for k, v in ours.items() if k != "clip_tokens"}
    assert torch.equal(sample(model, positive, negative, without), sample(model, *text, ours))
    with pytest.raises(NodeInputError, match="carries clip_tokens and the positive "
                                             "conditioning a clip_vision_output"):
        sample(model, positive, negative, ours)
    t2v, _ = load("t2v")
    with pytest.raises(NodeInputError, match="positive: carries a clip_vision_output; .* does "
                                             "not attend"):
        sample(t2v, positive, negative, {"samples": torch.zeros(1, 16, 2, 4, 4)})


def test_batch_index_takes_the_noise_of_those_batch_items(models, text):
    model, _ = load("t2v")
    whole = sample(model, *text, {"samples": torch.zeros(3, 16, 2, 4, 4)})
    part = sample(model, *text, {"samples": torch.zeros(1, 16, 2, 4, 4), "batch_index": [2]})
    assert torch.allclose(part[0], whole[2], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(part[0], whole[0], atol=1e-3)
    from wan_enhanced.pipeline.native_keys import noise_for
    assert torch.equal(noise_for({"batch_index": [2, 0]}, (2, 1, 1, 2, 2), 9),
                       make_noise((3, 1, 1, 2, 2), 9)[[2, 0]])
    with pytest.raises(NodeInputError, match="batch_index \\[-1\\] is not one index"):
        sample(model, *text, {"samples": torch.zeros(1, 16, 2, 4, 4), "batch_index": [-1]})


@pytest.mark.parametrize("extra, message", [
    ({"type": "audio"}, "a LATENT of type 'audio' is not a video latent"),
    ({"latent_shapes": [1]}, "carries 'latent_shapes', which no Wan Enhanced node knows"),
    ({"downscale_ratio_spacial": 4}, "downscale_ratio_spacial 4 is not a Wan VAE's"),
])
def test_latent_keys_nobody_honours_are_refused_by_name(models, text, extra, message):
    model, _ = load("t2v")
    with pytest.raises(NodeInputError, match=f"Wan Sampler: latent: .*{message}"):
        sample(model, *text, {"samples": torch.zeros(1, 16, 2, 4, 4), **extra})
