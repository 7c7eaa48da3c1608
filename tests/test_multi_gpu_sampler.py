"""The sampler node's `gpus` input, run by the warm worker group on gloo processes
(WAN_ENHANCED_DEVICE=cpu): the same latent as one process (sequence parallel, CFG parallel,
both at 4 ranks, sharded blocks (fsdp), LoRAs, the A14B expert switch), interrupts, a rank
killed mid-run, and every refusal before anything starts."""

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.checkpoints import tiny
from wan_enhanced.distributed import group as group_module
from wan_enhanced.lora.tiny import random_lora, write_lora
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError, NodeRunError
from wan_enhanced.profiling.events import start_run

DIT, VAE, TE = "tiny_t2v.safetensors", "tiny_vae21.safetensors", "tiny_umt5.safetensors"
TI2V, VAE22 = "tiny_ti2v.safetensors", "tiny_vae22.safetensors"
LORA = "tiny_lora.safetensors"
TOLERANCE = 2e-6  # relative to max |latent|: float32 rounding

from test_sharded_blocks import held_with_sharded_blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny.write_models_folder(root, dit_name=DIT, vae_name=VAE, text_encoder_name=TE, kind="t2v")
    tiny.write_models_folder(root, dit_name=TI2V, vae_name=VAE22, text_encoder_name=TE,
                             kind="ti2v")
    write_lora(root / "loras" / LORA, random_lora(tiny.TINY_DIT["t2v"], seed=3, alpha=4.0),
               "kohya")
    return root


@pytest.fixture
def cpu_ranks(models, tmp_path, monkeypatch):
    monkeypatch.setenv("WAN_ENHANCED_DEVICE", "cpu")
    host.set_headless_folders(models=models, output=tmp_path / "out")
    host.clear_interrupt()
    yield
    host.clear_interrupt()
    host.set_headless_folders(models="models", output="output")


@pytest.fixture(scope="module", autouse=True)
def no_group_left():
    yield
    group_module.shutdown_worker_group()


@pytest.fixture(autouse=True)
def runs_time_out(monkeypatch):
    """A hung collective fails the test (the product waits as long as a run takes)."""
    run = group_module.WorkerGroup.run

    def bounded(self, *args, timeout_s=None, **kwargs):
        return run(self, *args, timeout_s=timeout_s or 300, **kwargs)

    monkeypatch.setattr(group_module.WorkerGroup, "run", bounded)


def node(name):
    return NODES[f"WanEnhanced{name}"]()


@pytest.fixture
def inputs(cpu_ranks):
    (model,) = node("ModelLoader").load(DIT, "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    positive, negative = node("TextEncode").encode(encoder, "a red fox in the snow", "blurry")
    (latent,) = node("EmptyLatent").make(model, 48, 32, 5, 1)  # 2 x 2 x 3 = 12 token rows
    return model, positive, negative, latent


def sample(inputs, **kwargs):
    model, positive, negative, latent = inputs
    settings = dict(seed=7, steps=3, cfg=4.0, shift=5.0, scheduler="unipc", denoise=1.0)
    settings.update(kwargs)
    (out,) = node("Sampler").run(model, positive, negative, latent, **settings)
    return out["samples"]


def _close(a, b):
    return ((a - b).abs().max() / b.abs().max()).item() <= TOLERANCE


@pytest.mark.parametrize("gpus,fsdp", [(2, False), (3, False), (4, False), (2, True)])
def test_gpus_give_the_one_process_latent(inputs, gpus, fsdp):
    """2: CFG parallel (one rank per half); 3: no halves, both forwards split over 3 ranks (ring:
    the 2 heads do not divide); 4: CFG parallel with each half split over 2 (Ulysses)."""
    log = start_run()
    reference = sample(inputs)
    out = sample(inputs, gpus=gpus, fsdp=fsdp)
    assert _close(out, reference)
    ranks = [e for e in log.events if e["stage"] == "ranks"]
    assert [e["extra"]["rank"] for e in ranks] == list(range(gpus))
    extra = ranks[0]["extra"]
    assert extra["gpus"] == gpus and extra["fsdp"] == fsdp
    assert extra["cfg_parallel"] == (gpus % 2 == 0)
    assert extra["forwards"] == (3 if gpus % 2 == 0 else 6)  # 3 steps, one or two forwards
    assert (extra["cfg_calls"] > 0) == (gpus % 2 == 0)
    assert (extra["ring_calls"] > 0) == (gpus == 3)
    assert (extra["all_to_all_calls"] > 0) == (gpus == 4)
    steps = [e for e in log.events if (e.get("extra") or {}).get("step")]
    assert [e["extra"]["step"] for e in steps][-3:] == [1, 2, 3]


def test_fsdp_shards_quantized_weights(cpu_ranks):
    """int8 block matrices beside float32 norms in one packed block: the same latent, and each
    of 2 ranks holds its half of every block and the rest of the model whole."""
    (model,) = node("ModelLoader").load(DIT, "int8", "sdpa")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    positive, negative = node("TextEncode").encode(encoder, "a fox", "")
    (latent,) = node("EmptyLatent").make(model, 48, 32, 5, 1)
    inputs = (model, positive, negative, latent)
    log = start_run()
    reference = sample(inputs, steps=2)
    whole_run = sample(inputs, steps=2, gpus=2)
    sharded_run = sample(inputs, steps=2, gpus=2, fsdp=True)
    assert _close(whole_run, reference) and _close(sharded_run, reference)
    held = [e["extra"]["weight_bytes"] for e in log.events if e["stage"] == "ranks"]
    whole = sum(t.numel() * t.element_size() for t in model.model.state_dict().values())
    assert held[:2] == [whole, whole]
    assert held[2:] == [held_with_sharded_blocks(model.model, whole, world=2)] * 2


def test_start_image_with_per_frame_timesteps(cpu_ranks):
    """TI2V-5B image to video: frame 0 fixed at t = 0 (one timestep per latent frame, each
    rank's modulation by the global frame of its rows), batch 2, 3 ranks (ring, uneven rows)."""
    (model,) = node("ModelLoader").load(TI2V, "fp32", "sdpa")
    (vae,) = node("VAELoader").load(VAE22, "fp32")
    (encoder,) = node("TextEncoderLoader").load(TE, "fp32", "cpu")
    positive, negative = node("TextEncode").encode(encoder, "a red fox", "blurry")
    image = torch.rand(1, 40, 70, 3, generator=torch.Generator().manual_seed(5))
    (latent,) = node("ImageToVideoLatent").make(model, vae, image, 96, 32, 9, 2)
    inputs = (model, positive, negative, latent)
    reference = sample(inputs)
    out = sample(inputs, gpus=3)
    assert _close(out, reference)
    assert torch.allclose(out[:, :, :1], latent["first_frame"], atol=1e-5)


@pytest.mark.parametrize("mode,fsdp", [("merge", False), ("unmerged", True)])
def test_loras_are_applied_by_every_rank(inputs, models, mode, fsdp):
    """A LoRA chained on the model: every rank brings its copy (or its shards) to the same
    LoRA, so the split run gives the one-process latent with the LoRA, not without it."""
    model, positive, negative, latent = inputs
    (with_lora,) = node("LoRALoader").load(model, LORA, 0.8, mode)
    lora_inputs = (with_lora, positive, negative, latent)
    plain = sample(inputs, steps=2)
    reference = sample(lora_inputs, steps=2)
    split = sample(lora_inputs, steps=2, gpus=2, fsdp=fsdp)
    assert _close(split, reference)
    assert not _close(plain, reference)
    # the file changed after the run was checked: refused by name before the ranks start
    (models / "loras" / LORA).rename(models / "loras" / "gone.safetensors")
    try:
        with pytest.raises(NodeInputError, match=f"model: its LoRA {LORA} cannot be read"):
            sample(lora_inputs, steps=2, gpus=2)
    finally:
        (models / "loras" / "gone.safetensors").rename(models / "loras" / LORA)


def test_ranks_load_in_turns_one_after_another(gloo_group):
    spans = gloo_group(3).run("dist_tasks:loads_in_turns", 0.2)
    assert [rank for rank, _, _ in spans] == [0, 1, 2]
    assert all(spans[i][2] <= spans[i + 1][1] for i in range(2))  # no two loads at once


def test_turns_are_asked_for_when_a_copy_per_rank_does_not_fit_the_host(inputs, monkeypatch):
    from wan_enhanced.distributed import sampler as driver
    from wan_enhanced.pipeline import memory_guard
    from wan_enhanced.pipeline.placement import tensor_bytes

    model = inputs[0]
    size = tensor_bytes(model.model)
    monkeypatch.setattr(memory_guard, "free_bytes", lambda device: 3 * size)
    assert not driver.load_in_turns(model, 3) and driver.load_in_turns(model, 4)


@pytest.mark.parametrize("fsdp", [False, True])
def test_models_loaded_in_turns_give_the_same_latent(inputs, monkeypatch, fsdp):
    from wan_enhanced.distributed import sampler as driver

    reference = sample(inputs, steps=2)
    group_module.shutdown_worker_group()  # fresh ranks: nothing cached, every model loads
    asked = []
    monkeypatch.setattr(driver, "load_in_turns",
                        lambda handle, ranks: asked.append(ranks) or True)
    assert _close(sample(inputs, steps=2, gpus=3, fsdp=fsdp), reference)
    assert asked == [3]


def test_a14b_experts_switch_under_fsdp(inputs):
    """The high-noise expert with guidance, the low-noise one without (its steps run one
    forward over all ranks), both sharded."""
    model, positive, negative, latent = inputs
    (low,) = node("ModelLoader").load(DIT, "fp32", "sdpa")
    with torch.no_grad():  # a different second expert, so that the switch shows
        for p in low.model.parameters():
            p.mul_(0.9)
    pair = dict(low_noise_model=low, boundary=0.9, cfg_low_noise=1.0, steps=4)
    reference = sample(inputs, **pair)
    # the ranks load the experts from their files: a second file for the changed expert
    path = host.resolve_model("diffusion_models", DIT).with_name("tiny_t2v_low.safetensors")
    tiny.write_dit(path, low.config, "comfy", state={k: v.clone() for k, v in
                                                     low.model.state_dict().items()},
                   dtype=torch.float32)
    (low_file,) = node("ModelLoader").load(path.name, "fp32", "sdpa")
    pair["low_noise_model"] = low_file
    out = sample(inputs, gpus=2, fsdp=True, **pair)
    assert _close(out, reference)
    only_high = sample(inputs, gpus=2, fsdp=True, **{**pair, "boundary": 0.0})
    assert not _close(only_high, reference)  # the switch matters


def test_interrupt_stops_every_rank_and_the_group_runs_again(inputs):
    sample(inputs, gpus=2)  # the group is warm
    group = group_module._GROUP
    pids = [p.pid for p in group.context.processes]

    def interrupt_after_first_step(label, value, total):
        if value == 1:
            host.request_interrupt()

    host.add_progress_listener(interrupt_after_first_step)
    try:
        with pytest.raises(host.Interrupted):
            sample(inputs, gpus=2, steps=50)
    finally:
        host.remove_progress_listener(interrupt_after_first_step)
    assert group_module._GROUP is group and group.alive  # the same warm ranks
    assert [p.pid for p in group.context.processes] == pids
    sample(inputs, gpus=2, steps=1)


def test_a_rank_killed_mid_run_is_named_and_the_next_run_starts_fresh(inputs):
    reference = sample(inputs)
    sample(inputs, gpus=2)
    old = group_module._GROUP
    processes = list(old.context.processes)

    def kill_rank_1(label, value, total):
        if value == 1 and old.alive:
            old.context.processes[1].kill()

    host.add_progress_listener(kill_rank_1)
    try:
        with pytest.raises(NodeRunError) as caught:
            sample(inputs, gpus=2, steps=50)
    finally:
        host.remove_progress_listener(kill_rank_1)
    assert str(caught.value).startswith(
        "Wan Sampler: rank 1 (CPU process 1) failed: its process was killed by SIGKILL")
    assert "the next run starts a fresh one" in str(caught.value)
    assert not old.alive and not any(p.is_alive() for p in processes)
    out = sample(inputs, gpus=2)
    assert group_module._GROUP is not old and _close(out, reference)


def test_more_gpus_than_exist_is_refused_by_name(inputs, monkeypatch):
    sampler = NODES["WanEnhancedSampler"]
    verdict = sampler.VALIDATE_INPUTS(cfg=4.0, shift=5.0, denoise=1.0, gpus=9)
    assert verdict == "gpus: 9 asked for; this machine has room for 8 CPU processes " \
                      "(WAN_ENHANCED_DEVICE=cpu: the ranks are CPU processes)"
    assert sampler.VALIDATE_INPUTS(cfg=4.0, shift=5.0, denoise=1.0, gpus=2) is True
    monkeypatch.delenv("WAN_ENHANCED_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sampler.VALIDATE_INPUTS(cfg=4.0, shift=5.0, denoise=1.0, gpus=2) == \
        "gpus: 2 asked for; this machine has no CUDA GPU"
    with pytest.raises(NodeInputError, match="^Wan Sampler: gpus: 2 asked for; this machine "
                                             "has no CUDA GPU$"):
        sample(inputs, gpus=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert sampler.VALIDATE_INPUTS(cfg=4.0, shift=5.0, denoise=1.0, gpus=4) == \
        "gpus: 4 asked for; this machine has 1 CUDA GPU"


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpus=2, block_swap=4), "block_swap: 4 with gpus 2"),
    (dict(fsdp=True), "gpus 1 / fsdp True: expected gpus >= 1, and fsdp only with gpus > 1"),
])
def test_settings_that_cannot_be_split_are_refused(inputs, kwargs, message):
    with pytest.raises(NodeInputError, match=message):
        sample(inputs, **kwargs)
    assert group_module._GROUP is None or group_module._GROUP.alive


def test_a_model_not_from_a_file_is_refused(inputs):
    model, positive, negative, latent = inputs
    from dataclasses import replace
    loose = replace(model, weight_dtype=None)
    with pytest.raises(NodeInputError, match="model: .* was not loaded from a file"):
        sample((loose, positive, negative, latent), gpus=2)


def test_a_run_that_cannot_fit_even_sharded_is_refused_with_the_estimate(inputs, monkeypatch):
    from wan_enhanced.pipeline import memory_guard

    started = []
    monkeypatch.setattr(group_module.WorkerGroup, "start", lambda self: started.append(self))
    monkeypatch.setattr(memory_guard, "machine_memory", lambda: (1 << 20, "1 MiB"))
    with pytest.raises(NodeInputError) as caught:
        sample(inputs, gpus=2, fsdp=True)
    message = str(caught.value)
    assert message.startswith("Wan Sampler: gpus: sampling tiny_t2v.safetensors at 48x32x5 over "
                              "2 CPU processes with fsdp needs about ")
    assert "(weights " in message and "this machine has 1 MiB in all" in message
    assert message.endswith("use fewer processes or a smaller video")
    assert not started


def test_report_shows_each_rank(inputs, tmp_path):
    from wan_enhanced.profiling.report import build_report

    log = start_run(tmp_path / "events.json")
    sample(inputs, gpus=2)
    sample(inputs, gpus=2, fsdp=True)
    log.save()
    text = build_report(log.path).read_text()
    assert "## Several GPUs: per rank" in text
    assert "Run 1 (2 ranks, CFG parallel):" in text
    assert "Run 2 (2 ranks, fsdp, CFG parallel):" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0 | cpu |")
            or line.startswith("| 1 | cpu |")]
    assert len(rows) == 4
    cells = rows[1].split(" | ")
    assert float(cells[2]) > 0 and cells[4] == "3"  # request seconds, forwards


def test_run_command_with_gpus(tmp_path, monkeypatch):
    """`wan-enhanced run` in this process with --set 6.gpus=2 / 6.fsdp=true: the same video as
    with one process."""
    from wan_enhanced.pipeline.video_io import read_mp4
    from wan_enhanced.runner.cli import main
    from wan_enhanced.runner.demo_command import DEMO_SETTINGS, WORKFLOW

    monkeypatch.setenv("WAN_ENHANCED_DEVICE", "cpu")
    models = tiny.write_models_folder(tmp_path / "models",
                                      dit_name="wan2.2_ti2v_5B_fp16.safetensors",
                                      vae_name="wan2.2_vae.safetensors",
                                      text_encoder_name="umt5_xxl_fp16.safetensors", kind="ti2v")
    frames = []
    for name, extra in (("one", []), ("two", ["6.gpus=2", "6.fsdp=true"])):
        argv = ["run", str(WORKFLOW), "--models", str(models), "--out", str(tmp_path / name),
                "--quiet"]
        for setting in [*DEMO_SETTINGS, "5.width=160", "5.height=96", "5.frames=9",
                        "6.steps=2", *extra]:
            argv += ["--set", setting]
        assert main(argv) == 0
        (video,) = (tmp_path / name).glob("*.mp4")
        frames.append(read_mp4(video)[0])
    assert frames[0].shape == frames[1].shape and (frames[0] == frames[1]).all()
