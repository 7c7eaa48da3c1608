"""The whole text-to-video graph through the node classes, on tiny random models, on the CPU:
outputs, bad inputs with clear messages, interrupts, and memory that returns to its baseline."""

import gc
import shutil

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.pipeline.video_io import read_mp4

from tiny_sets import ALL_TE as TE, CLIP, NAMES


@pytest.fixture(scope="module")
def models(all_kinds_models):
    return all_kinds_models


@pytest.fixture
def headless(models, tmp_path):
    out = tmp_path / "out"
    host.set_headless_folders(models=models, output=out)
    host.clear_interrupt()
    yield out
    host.set_headless_folders(models="models", output="output")


def node(name):
    return NODES[f"WanEnhanced{name}"]()


def run_graph(kind="ti2v", width=64, height=64, frames=5, steps=2, prefix="test/clip",
              mode="tiled", sampler_kwargs=None):
    dit, vae = NAMES[kind]
    (model,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    (vae_handle,) = node("VAELoader").load(vae, "fp32")
    pos, neg = node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")
    (latent,) = node("EmptyLatent").make(model, width, height, frames, 1)
    (sampled,) = node("Sampler").run(model, pos, neg, latent, seed=7, steps=steps, cfg=4.0,
                                     shift=5.0, scheduler="unipc", denoise=1.0,
                                     **(sampler_kwargs or {}))
    (images,) = node("TiledDecode").run(vae_handle, sampled, 32, 32, 16, 16, mode)
    ui = node("SaveVideo").save(images, prefix, 16.0, 19)
    return sampled, images, ui


def test_text_to_video_graph(headless):
    sampled, images, ui = run_graph()
    samples = sampled["samples"]
    assert samples.device.type == "cpu" and samples.dtype == torch.float32
    assert samples.shape == (1, 48, 2, 4, 4)  # TI2V: 16x VAE stride
    assert torch.isfinite(samples).all() and samples.abs().max() > 0
    assert images.shape == (5, 64, 64, 3) and images.device.type == "cpu"
    assert 0 <= float(images.min()) and float(images.max()) <= 1
    entry = ui["ui"]["images"][0]
    assert entry["type"] == "output" and entry["subfolder"] == "test"
    frames, fps = read_mp4(headless / "test" / entry["filename"])
    assert frames.shape[0] == 5 and fps == 16


def test_wan21_graph_and_determinism(headless):
    first, _, _ = run_graph("t2v", width=48, height=32)
    second, _, _ = run_graph("t2v", width=48, height=32)
    assert first["samples"].shape == (1, 16, 2, 4, 6)
    assert torch.equal(first["samples"], second["samples"])  # same seed, same result


def test_text_encode_matches_comfyui_form(headless):
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a cat", "")
    rows = pos[0][0]
    assert rows.shape == (1, 512, 4096) or rows.shape[:2] == (1, 512)
    valid = int((rows.abs().sum(-1) > 0).sum())
    ids, mask = encoder.tokenizer(["a cat"])
    assert valid == int(mask.sum())  # rows past the prompt's tokens are zero
    assert isinstance(pos[0][1], dict)


def expert_pair(monkeypatch, frames=1):
    """Two tiny T2V experts whose forwards append "high" / "low" to the list returned, with a
    conditioning and a latent for them."""
    dit, _ = NAMES["t2v"]
    (high,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (low,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a", "b")
    (latent,) = node("EmptyLatent").make(high, 32, 32, frames, 1)
    calls = []
    for name, handle in (("high", high), ("low", low)):
        original = handle.model.forward

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(handle.model, "forward", spy)
    return high, low, pos, neg, latent, calls


def test_a14b_expert_pair_switches_once(headless, monkeypatch):
    high, low, pos, neg, latent, calls = expert_pair(monkeypatch)
    node("Sampler").run(high, pos, neg, latent, seed=1, steps=8, cfg=3.0, shift=5.0,
                        scheduler="unipc", denoise=1.0, low_noise_model=low, boundary=0.875,
                        cfg_low_noise=2.0)
    switched = [i for i in range(1, len(calls)) if calls[i] != calls[i - 1]]
    assert calls[0] == "high" and calls[-1] == "low" and len(switched) == 1


def test_bad_inputs_name_node_and_field(headless, tmp_path):
    dit, vae21 = NAMES["t2v"]
    with pytest.raises(NodeInputError, match="Wan Model Loader: .*Wan2.1 VAE.*VAE loader"):
        node("ModelLoader").load(str(host.resolve_model("vae", vae21)), "bf16", "sdpa")
    with pytest.raises(NodeInputError, match="Wan VAE Loader: .*no such file"):
        node("VAELoader").load("missing.safetensors", "bf16")
    (ti2v,) = node("ModelLoader").load(NAMES["ti2v"][0], "fp32", "sdpa")
    with pytest.raises(NodeInputError, match=r"Wan Empty Latent: width 100 is not a multiple of "
                                             r"32 \(nearest valid: 96 or 128\); frames 80 is not "
                                             r"of the form 4n\+1 \(nearest valid: 77 or 81\)"):
        node("EmptyLatent").make(ti2v, 100, 64, 80, 1)
    (vae_handle,) = node("VAELoader").load(vae21, "fp32")
    (latent,) = node("EmptyLatent").make(ti2v, 64, 64, 5, 1)
    with pytest.raises(NodeInputError, match="Wan Tiled Decode: latent: a 48-channel latent "
                                             ".*Wan2.1 VAE"):
        node("TiledDecode").run(vae_handle, latent, 32, 32, 16, 16, "tiled")
    (t2v,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    wrong_width = [[torch.zeros(1, 77, 768), {}]]
    with pytest.raises(NodeInputError, match="Wan Sampler: positive: conditioning of width 768"):
        node("Sampler").run(t2v, wrong_width, wrong_width, {"samples": torch.zeros(
            1, 16, 1, 4, 4)}, 0, 2, 5.0, 5.0, "unipc", 1.0)
    good = [[torch.zeros(1, 512, 64), {}]]  # the tiny models take 64-wide text rows
    with pytest.raises(NodeInputError, match="latent has 48 channels"):
        node("Sampler").run(t2v, good, good, latent, 0, 2, 5.0, 5.0, "unipc", 1.0)


def test_decode_modes_of_the_decode_node(headless):
    _, vae21 = NAMES["t2v"]
    (vae_handle,) = node("VAELoader").load(vae21, "fp32")
    latent = {"samples": torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(3))}
    decode = node("TiledDecode").run
    (untiled,) = decode(vae_handle, latent, 32, 32, 16, 16, "untiled")
    # a budget that holds the whole frame decodes it untiled, bit for bit
    (roomy,) = decode(vae_handle, latent, 32, 32, 16, 16, "auto", vram_budget_gb=8.0)
    assert torch.equal(roomy, untiled)
    # a small budget tiles: the same frames and size, blended from several tiles
    (tight,) = decode(vae_handle, latent, 32, 32, 16, 16, "auto", vram_budget_gb=0.003,
                      overlap=16)
    assert tight.shape == untiled.shape and not torch.equal(tight, untiled)
    assert 0 <= float(tight.min()) and float(tight.max()) <= 1
    # on the CPU, 0 ("what the device has free") means no limit: untiled
    (free,) = decode(vae_handle, latent, 32, 32, 16, 16, "auto", vram_budget_gb=0.0)
    assert torch.equal(free, untiled)
    with pytest.raises(NodeInputError, match="Wan Tiled Decode: vram_budget_gb: .*cannot hold"):
        decode(vae_handle, latent, 32, 32, 16, 16, "auto", vram_budget_gb=1e-7)
    with pytest.raises(NodeInputError, match="Wan Tiled Decode: stride_x: must be smaller"):
        decode(vae_handle, latent, 32, 32, 48, 16, "tiled")
    with pytest.raises(NodeInputError, match="Wan Tiled Decode: vram_budget_gb"):
        decode(vae_handle, latent, 32, 32, 16, 16, "auto", vram_budget_gb=-1.0)
    with pytest.raises(NodeInputError, match="Wan Tiled Decode: mode"):
        decode(vae_handle, latent, 32, 32, 16, 16, "fast")


def test_auto_decode_halves_its_budget_after_out_of_memory(headless, monkeypatch):
    from wan_enhanced.pipeline import decode as decode_stage

    _, vae21 = NAMES["t2v"]
    (vae_handle,) = node("VAELoader").load(vae21, "fp32")
    latent = {"samples": torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(3))}
    (expected,) = node("TiledDecode").run(vae_handle, latent, 32, 32, 16, 16, "auto",
                                          vram_budget_gb=0.004, overlap=16)
    real_decode, real_plan, budgets = decode_stage.decode_to_images, decode_stage.plan_grid, []

    def recording_plan(*args, budget_bytes=None, **kwargs):  # the budget of each planned grid
        grid = real_plan(*args, budget_bytes=budget_bytes, **kwargs)
        budgets.append(budget_bytes)
        return grid

    def short_of_memory(failures):
        calls = []

        def fake(*args, **kwargs):
            calls.append(1)
            if len(calls) <= failures:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return real_decode(*args, **kwargs)
        return fake

    monkeypatch.setattr(decode_stage, "plan_grid", recording_plan)
    start = int(0.016 * (1 << 30))
    monkeypatch.setattr(decode_stage, "decode_to_images", short_of_memory(2))
    with pytest.warns(UserWarning, match="out of device memory .* decoding again"):
        (images,) = node("TiledDecode").run(vae_handle, latent, 32, 32, 16, 16, "auto",
                                            vram_budget_gb=0.016, overlap=16)
    assert budgets == [start, start // 2, start // 4]
    assert torch.equal(images, expected)  # what a first try at a quarter of the budget gives
    # it gives up after OOM_RETRIES smaller budgets ...
    budgets.clear()
    monkeypatch.setattr(decode_stage, "decode_to_images", short_of_memory(99))
    with pytest.raises(torch.cuda.OutOfMemoryError), pytest.warns(UserWarning):
        node("TiledDecode").run(vae_handle, latent, 32, 32, 16, 16, "auto",
                                vram_budget_gb=0.016, overlap=16)
    assert budgets == [start >> k for k in range(decode_stage.OOM_RETRIES + 1)]
    # ... or at once when half the budget cannot hold a grid
    budgets.clear()
    monkeypatch.setattr(decode_stage, "decode_to_images", short_of_memory(99))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        node("TiledDecode").run(vae_handle, latent, 32, 32, 16, 16, "auto",
                                vram_budget_gb=0.002, overlap=16)
    assert budgets == [int(0.002 * (1 << 30))]


def test_fit_image_covers_and_centre_crops():
    from wan_enhanced.pipeline.start_image import fit_image

    columns = torch.arange(8, dtype=torch.float32) / 7
    image = columns.view(1, 1, 8, 1).expand(1, 4, 8, 3)  # 4 high, 8 wide
    fitted = fit_image(image, width=4, height=4)
    assert fitted.shape == (1, 3, 4, 4)
    assert torch.equal(fitted[0, 0, 0], columns[2:6] * 2 - 1)  # the middle four columns
    # a small image is scaled up to cover the size: values stay within the image's range
    up = fit_image(torch.rand(2, 3, 5, 3), width=32, height=16)
    assert up.shape == (2, 3, 16, 32) and up.min() >= -1 and up.max() <= 1


def test_image_to_video_keeps_the_start_image_as_frame_zero(headless, monkeypatch):
    dit, vae22 = NAMES["ti2v"]
    (model,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (vae_handle,) = node("VAELoader").load(vae22, "fp32")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")
    image = torch.rand(1, 40, 70, 3, generator=torch.Generator().manual_seed(5))
    (latent,) = node("ImageToVideoLatent").make(model, vae_handle, image, 64, 32, 9, 2)
    first = latent["first_frame"]
    assert latent["samples"].shape == (2, 48, 3, 2, 4) and first.shape == (2, 48, 1, 2, 4)
    from wan_enhanced.pipeline.start_image import fit_image
    expected = vae_handle.model.encode(fit_image(image, 64, 32).unsqueeze(2))
    assert torch.allclose(first[:1], expected, atol=1e-6) and torch.equal(first[0], first[1])

    seen = []
    original = model.model.forward

    def spy(x, t, *args, **kwargs):
        seen.append(t.clone())
        return original(x, t, *args, **kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    (sampled,) = node("Sampler").run(model, pos, neg, latent, seed=7, steps=3, cfg=4.0,
                                     shift=5.0, scheduler="unipc", denoise=1.0)
    out = sampled["samples"]
    assert torch.allclose(out[:, :, :1], first, rtol=1e-5, atol=1e-5)  # frame 0 is the image
    assert not torch.allclose(out[:, :, 1:], torch.zeros_like(out[:, :, 1:]))
    assert seen and all(t.shape == (2, 3) and bool((t[:, 0] == 0).all())
                        and bool((t[:, 1:] > 0).all()) for t in seen)
    # the same latent without its first frame samples frame 0 too
    monkeypatch.setattr(model.model, "forward", original)
    (plain,) = node("Sampler").run(model, pos, neg, {"samples": latent["samples"]}, seed=7,
                                   steps=3, cfg=4.0, shift=5.0, scheduler="unipc", denoise=1.0)
    assert not torch.allclose(plain["samples"][:, :, :1], first, atol=1e-3)


def test_image_to_video_refuses_what_does_not_fit(headless):
    dit21, vae21 = NAMES["t2v"]
    dit22, vae22 = NAMES["ti2v"]
    (t2v,) = node("ModelLoader").load(dit21, "fp32", "sdpa")
    (ti2v,) = node("ModelLoader").load(dit22, "fp32", "sdpa")
    (v21,) = node("VAELoader").load(vae21, "fp32")
    (v22,) = node("VAELoader").load(vae22, "fp32")
    image = torch.rand(1, 32, 32, 3)
    make = node("ImageToVideoLatent").make
    with pytest.raises(NodeInputError, match="Wan Image to Video Latent: model: .*is a "
                                             "text-to-video model"):
        make(t2v, v22, image, 64, 32, 9, 1)
    with pytest.raises(NodeInputError, match="vae: .*Wan2.1 VAE"):
        make(ti2v, v21, image, 64, 32, 9, 1)
    with pytest.raises(NodeInputError, match="start_image: expected an IMAGE"):
        make(ti2v, v22, torch.rand(32, 32, 3), 64, 32, 9, 1)
    with pytest.raises(NodeInputError, match="start_image: 2 images for a batch of 3"):
        make(ti2v, v22, torch.rand(2, 32, 32, 3), 64, 32, 9, 3)
    with pytest.raises(NodeInputError, match="frames 8 is not of the form 4n\\+1"):
        make(ti2v, v22, image, 64, 32, 8, 1)
    (latent,) = make(ti2v, v22, image, 64, 32, 9, 1)
    latent["first_frame"] = latent["first_frame"][:, :, :, :1]
    good = [[torch.zeros(1, 512, 64), {}]]  # the tiny models take 64-wide text rows
    with pytest.raises(NodeInputError, match="Wan Sampler: latent: its first_frame"):
        node("Sampler").run(ti2v, good, good, latent, 0, 2, 5.0, 5.0, "unipc", 1.0)


def test_i2v_a14b_takes_the_image_as_conditioning_channels(headless, monkeypatch):
    from wan_enhanced.pipeline.start_image import fit_image
    from wan_enhanced.wan.latent_format import WAN21_LATENT

    dit, vae21 = NAMES["i2v_a14b"]
    (high,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (low,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (vae_handle,) = node("VAELoader").load(vae21, "fp32")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")
    image = torch.rand(1, 30, 50, 3, generator=torch.Generator().manual_seed(6))
    (latent,) = node("ImageToVideoLatent").make(high, vae_handle, image, 48, 32, 9, 1)
    condition = latent["image_condition"]
    assert latent["samples"].shape == (1, 16, 3, 4, 6) and "first_frame" not in latent
    assert condition.shape == (1, 20, 3, 4, 6)
    mask, image_latent = condition[:, :4], condition[:, 4:]
    assert bool((mask[:, :, 0] == 1).all()) and bool((mask[:, :, 1:] == 0).all())
    pixels = fit_image(image, 48, 32).unsqueeze(2)
    video = torch.cat([pixels, torch.zeros(1, 3, 8, 32, 48)], dim=2)  # then mid-grey frames
    expected = WAN21_LATENT.normalise(vae_handle.model.encode(video))
    assert torch.allclose(image_latent, expected, atol=1e-5)

    seen = []
    for name, handle in (("high", high), ("low", low)):
        original = handle.model.forward

        def spy(x, t, context, *args, _name=name, _original=original, **kwargs):
            seen.append((_name, kwargs["y"]))
            return _original(x, t, context, *args, **kwargs)

        monkeypatch.setattr(handle.model, "forward", spy)
    (sampled,) = node("Sampler").run(high, pos, neg, latent, seed=3, steps=4, cfg=3.0, shift=5.0,
                                     scheduler="euler", denoise=1.0, low_noise_model=low,
                                     boundary=0.9)
    assert {name for name, _ in seen} == {"high", "low"}
    assert all(torch.equal(y, condition) for _, y in seen)
    assert sampled["samples"].shape == (1, 16, 3, 4, 6)
    assert torch.isfinite(sampled["samples"]).all()
    good = [[torch.zeros(1, 512, 64), {}]]  # the tiny models take 64-wide text rows
    with pytest.raises(NodeInputError, match="is an image-to-video model; give it the LATENT of "
                                             "Wan Image to Video Latent"):
        node("Sampler").run(high, good, good, {"samples": latent["samples"]}, 0, 2, 5.0, 5.0,
                            "unipc", 1.0)
    (t2v,) = node("ModelLoader").load(NAMES["t2v"][0], "fp32", "sdpa")
    with pytest.raises(NodeInputError, match="carries a start image .* takes none"):
        node("Sampler").run(t2v, good, good, latent, 0, 2, 5.0, 5.0, "unipc", 1.0)
    # the switch point left at -1 is the pair's own: I2V 0.9, T2V 0.875
    from wan_enhanced.pipeline.sample import expert_boundary
    assert expert_boundary(None, high) == 0.9 and expert_boundary(None, t2v) == 0.875
    assert expert_boundary(0.5, high) == 0.5


def test_wan21_i2v_attends_to_the_start_image_clip_tokens(headless, monkeypatch):
    dit, vae21 = NAMES["i2v"]
    (model,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (vae_handle,) = node("VAELoader").load(vae21, "fp32")
    (clip,) = node("CLIPVisionLoader").load(CLIP, "fp32")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")
    image = torch.rand(1, 30, 50, 3, generator=torch.Generator().manual_seed(8))
    make = node("ImageToVideoLatent").make
    with pytest.raises(NodeInputError, match="clip_vision: .*Wan2.1 image-to-video model"):
        make(model, vae_handle, image, 48, 32, 5, 2)
    (latent,) = make(model, vae_handle, image, 48, 32, 5, 2, clip_vision=clip)
    tokens = latent["clip_tokens"]
    expected = clip.model(clip.model.preprocess(image))
    assert tokens.shape == (2, 5, 64) and torch.allclose(tokens[1:], expected, atol=1e-6)
    assert latent["image_condition"].shape == (2, 20, 2, 4, 6)

    seen = []
    original = model.model.forward

    def spy(x, t, context, *args, **kwargs):
        seen.append(kwargs["clip_tokens"])
        return original(x, t, context, *args, **kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    (sampled,) = node("Sampler").run(model, pos, neg, latent, seed=1, steps=2, cfg=3.0,
                                     shift=5.0, scheduler="unipc", denoise=1.0)
    assert len(seen) == 4 and all(torch.equal(t, tokens) for t in seen)  # cond and uncond
    assert torch.isfinite(sampled["samples"]).all()
    without = {k: v for k, v in latent.items() if k != "clip_tokens"}
    with pytest.raises(NodeInputError, match="also attends to the start image's CLIP tokens"):
        node("Sampler").run(model, pos, neg, without, 1, 2, 3.0, 5.0, "unipc", 1.0)


def test_unwritable_output_leaves_nothing(headless):
    headless.parent.mkdir(parents=True, exist_ok=True)
    headless.write_text("a file where the output folder should be")
    images = torch.rand(3, 16, 16, 3)
    with pytest.raises((NodeInputError, OSError)):
        node("SaveVideo").save(images, "clip", 16.0, 19)
    assert headless.read_text().startswith("a file")


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects()
               if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type != "meta")


def test_interrupt_mid_sampling_releases_and_next_run_works(headless, monkeypatch):
    run_graph()  # warm up imports and caches
    before = _live_tensors()
    calls = {"n": 0}
    real_check = host.check_interrupt

    def interrupt_at_third_step():
        calls["n"] += 1
        if calls["n"] == 3:
            host.request_interrupt()
        real_check()

    monkeypatch.setattr(host, "check_interrupt", interrupt_at_third_step)
    with pytest.raises(host.Interrupted):
        run_graph(steps=6)
    monkeypatch.setattr(host, "check_interrupt", real_check)
    assert _live_tensors() <= before
    _, images, _ = run_graph()
    assert images.shape[0] == 5


def test_repeated_runs_leave_nothing_behind(headless):
    import psutil

    run_graph()
    gc.collect()
    baseline_tensors = _live_tensors()
    baseline_rss = psutil.Process().memory_info().rss
    for _ in range(3):
        outputs = run_graph()
        del outputs
        assert _live_tensors() <= baseline_tensors
    gc.collect()
    growth = psutil.Process().memory_info().rss - baseline_rss
    assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over three runs"


def test_sampler_takes_comfyui_shaped_conditioning(headless):
    """ComfyUI's own text encoding gives at least 512 rows and a dict of extras: pooled_output
    None (umT5) is nothing to apply, an attention_mask zeroes the rows outside it (the padding
    Wan was trained with); several entries or extras with another meaning are refused."""
    (model,) = node("ModelLoader").load(NAMES["t2v"][0], "fp32", "sdpa")
    width = model.config.text_dim
    rows = torch.zeros(1, 600, width)
    rows[:, :9] = torch.randn(1, 9, width, generator=torch.Generator().manual_seed(2))
    noisy = rows.clone()
    noisy[:, 9:] = torch.randn(1, 591, width)
    mask = torch.zeros(1, 600)
    mask[:, :9] = 1
    (latent,) = node("EmptyLatent").make(model, 32, 32, 1, 1)

    def sampled(cond):
        return node("Sampler").run(model, cond, cond, latent, 3, 2, 1.0, 5.0, "euler",
                                   1.0)[0]["samples"]

    plain = sampled([[rows, {}]])
    assert torch.equal(sampled([[noisy, {"pooled_output": None, "attention_mask": mask}]]), plain)
    assert not torch.allclose(sampled([[noisy, {}]]), plain)
    with pytest.raises(NodeInputError, match="positive: carries 'area' \\(set by "
                                             "ConditioningSetArea\\), which the Wan Sampler"):
        sampled([[rows, {"area": (8, 8, 0, 0)}]])
    with pytest.raises(NodeInputError, match="positive: 2 conditionings"):
        sampled([[rows, {}], [rows, {}]])
    with pytest.raises(NodeInputError, match="positive: carries a pooled_output"):
        sampled([[rows, {"pooled_output": torch.zeros(1, 768)}]])


def test_text_encoder_without_tokenizer(headless, tmp_path):
    from wan_enhanced.checkpoints.tiny import write_text_encoder

    bare = write_text_encoder(tmp_path / "lonely" / "umt5.safetensors", "hf")
    with pytest.raises(NodeInputError, match=r"Wan Text Encoder Loader: .*umt5\.safetensors: no "
                                             r"tokenizer found.*google/umt5-xxl/, tokenizer\.json"):
        node("TextEncoderLoader").load(str(bare), "fp32", "cpu")


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_sample_what_eager_blocks_do(headless):
    """The loader's compile option: the sampler runs the blocks through torch.compile and gets
    the eager result up to float32 rounding."""
    dit = NAMES["t2v"][0]
    (eager,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (compiled,) = node("ModelLoader").load(dit, "fp32", "sdpa", compile=True)
    assert compiled.compile and not eager.compile
    pos, neg = node("TextEncode").encode(
        node("TextEncoderLoader").load(TE, "fp32", "cpu")[0], "a red fox", "")
    (latent,) = node("EmptyLatent").make(eager, 32, 32, 5, 1)
    outs = [node("Sampler").run(m, pos, neg, latent, 3, 2, 4.0, 5.0, "euler", 1.0)[0]["samples"]
            for m in (eager, compiled)]
    scale = float(outs[0].abs().max())
    assert scale > 0
    assert float((outs[1] - outs[0]).abs().max()) < 1e-5 * scale


def test_block_swap_samples_what_resident_blocks_do(headless):
    """The sampler's block_swap option streams the first blocks through slot buffers (on the CPU
    host-to-host): same numbers, and the model's weights are back on the CPU afterwards."""
    plain, _, _ = run_graph("t2v", width=32, height=32, mode="untiled")
    for swap, prefetch in ((1, 1), (2, 1), (64, 3)):
        swapped, _, _ = run_graph("t2v", width=32, height=32, mode="untiled",
                                  sampler_kwargs={"block_swap": swap, "prefetch_blocks": prefetch})
        assert torch.equal(swapped["samples"], plain["samples"])


def test_block_swap_with_the_a14b_pair(headless):
    dit, _ = NAMES["t2v"]
    (high,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (low,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a", "b")
    (latent,) = node("EmptyLatent").make(high, 32, 32, 1, 1)
    args = dict(seed=1, steps=6, cfg=3.0, shift=5.0, scheduler="unipc", denoise=1.0,
                low_noise_model=low, boundary=0.875)
    (plain,) = node("Sampler").run(high, pos, neg, latent, **args)
    (swapped,) = node("Sampler").run(high, pos, neg, latent, block_swap=1, **args)
    assert torch.equal(plain["samples"], swapped["samples"])
    assert all(p.device.type == "cpu" for h in (high, low) for p in h.model.parameters())


def test_block_swap_bad_values(headless):
    dit, _ = NAMES["t2v"]
    (model,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a", "b")
    (latent,) = node("EmptyLatent").make(model, 32, 32, 1, 1)
    with pytest.raises(NodeInputError, match="Wan Sampler: block_swap -2.*expected block_swap >= 0"):
        node("Sampler").run(model, pos, neg, latent, 1, 2, 3.0, 5.0, "euler", 1.0, block_swap=-2)


def test_a_budget_of_what_is_free_is_read_after_the_host_made_room(headless, monkeypatch):
    """vram_budget_gb 0 on a GPU: the host (ComfyUI) is asked first to make room for the untiled
    decode's estimate, then what is free is read, and the grid planned from it."""
    from wan_enhanced import host
    from wan_enhanced.pipeline import decode as decode_stage
    from wan_enhanced.vae_tiling.budget import DecodeCost

    _, vae21 = NAMES["t2v"]
    (vae_handle,) = node("VAELoader").load(vae21, "fp32")
    samples = torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(3))
    events = []
    monkeypatch.setattr(host, "make_room", lambda size, device: events.append(("room", size)))
    monkeypatch.setattr(decode_stage, "free_device_bytes",
                        lambda device: events.append(("free",)) or 12345)
    cuda = torch.device("cuda")
    assert decode_stage.free_after_room(vae_handle, samples, cuda) == 12345
    untiled = DecodeCost(vae_handle.model, 1, torch.float32).bytes(6, 8)
    assert events == [("room", untiled), ("free",)]
    events.clear()
    assert decode_stage.free_after_room(vae_handle, samples, torch.device("cpu")) is None
    assert events == []  # a CPU has no limit to read, and nothing is asked of the host


def test_the_sampler_with_easycache_skips_steps_and_says_so(headless, caplog):
    """cache easycache on the tiny model: off and a zero threshold give the uncached latent bit
    for bit; a high threshold skips steps (the log counts them) and gives another latent of the
    same shape; a bad value is refused by name, and with several GPUs."""
    import logging

    dit, _ = NAMES["t2v"]
    (model,) = node("ModelLoader").load(dit, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    pos, neg = node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")
    (latent,) = node("EmptyLatent").make(model, 32, 32, 5, 1)
    sampler = node("Sampler")

    def run(**kwargs):
        (out,) = sampler.run(model, pos, neg, latent, 3, 12, 4.0, 5.0, "euler", 1.0, **kwargs)
        return out["samples"]

    plain = run()
    assert torch.equal(run(cache="off"), plain)
    with caplog.at_level(logging.INFO, logger="wan_enhanced"):
        assert torch.equal(run(cache="easycache", cache_threshold=0.0), plain)
        caplog.clear()
        cached = run(cache="easycache", cache_threshold=3.0)
    said = [r.getMessage() for r in caplog.records if "EasyCache" in r.getMessage()]
    assert len(said) == 1 and "of 12 steps" in said[0] and "skipped 0 " not in said[0]
    assert cached.shape == plain.shape and not torch.equal(cached, plain)
    assert bool(torch.isfinite(cached).all())
    with pytest.raises(NodeInputError, match="cache_threshold: -0.5 is negative"):
        run(cache="easycache", cache_threshold=-0.5)
    with pytest.raises(NodeInputError, match="cache: 'fastcache' is not one of"):
        run(cache="fastcache")
    with pytest.raises(NodeInputError, match="cache: easycache runs on one GPU; with gpus 2"):
        run(cache="easycache", gpus=2)


def test_each_expert_of_a_pair_keeps_its_own_easycache(headless, monkeypatch):
    """EasyCache in an A14B run: each expert skips on its own cache (the low-noise expert
    measures its own first forwards, with its own guidance); block swap, which only moves
    weights, gives the same latent and calls."""
    high, low, pos, neg, latent, calls = expert_pair(monkeypatch, frames=5)

    def run(cache, block_swap=0):
        calls.clear()
        (out,) = node("Sampler").run(high, pos, neg, latent, seed=1, steps=20, cfg=3.0,
                                     shift=5.0, scheduler="euler", denoise=1.0,
                                     low_noise_model=low, boundary=0.875, cfg_low_noise=1.0,
                                     cache=cache, cache_threshold=3.0, block_swap=block_swap)
        return out["samples"], list(calls)

    full, full_calls = run("off")
    cached, cached_calls = run("easycache")
    for name in ("high", "low"):  # every expert ran some steps in full and skipped some
        assert 0 < cached_calls.count(name) < full_calls.count(name)
    # a fresh cache measures two full forwards before it can skip: the low-noise expert's own
    assert cached_calls.count("low") >= 2
    assert full_calls.count("high") % 2 == 0  # cfg 3: two calls a step; the low expert cfg 1
    assert cached.shape == full.shape and not torch.equal(cached, full)
    swapped, swapped_calls = run("easycache", block_swap=1)
    assert torch.equal(swapped, cached) and swapped_calls == cached_calls
