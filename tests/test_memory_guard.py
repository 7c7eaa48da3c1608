"""The memory guard: a video too large for the machine is refused in validation or before the
stage allocates, with the estimate, what there is, and the largest size that fits."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.pipeline import loading
from wan_enhanced.pipeline import memory_guard as guard
from wan_enhanced.pipeline.memory_guard import VideoSize
from wan_enhanced.runner import cli
from wan_enhanced.wan.configs import KNOWN_DITS

WORKFLOW = Path(__file__).resolve().parent.parent / "api_workflows" / \
    "wan22_ti2v_5b_speed_preview.json"
from tiny_sets import DIT, TE, VAE
GIB = 1 << 30


@pytest.fixture(scope="module")
def models(ti2v_models):
    return ti2v_models


@pytest.fixture
def headless(models, tmp_path):
    host.set_headless_folders(models=models, output=tmp_path / "out")
    yield tmp_path / "out"
    host.set_headless_folders(models="models", output="output")


def workflow_file(tmp_path, **sizes) -> Path:
    workflow = json.loads(WORKFLOW.read_text())
    workflow["1"]["inputs"].update(model_name=DIT, weight_dtype="fp32")
    workflow["2"]["inputs"].update(text_encoder_name=TE, dtype="fp32", device="cpu")
    workflow["3"]["inputs"].update(vae_name=VAE, dtype="fp32")
    workflow["5"]["inputs"].update(sizes)
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(workflow))
    return path


def test_estimates_count_what_a_video_holds():
    size = VideoSize(1280, 704, 121, 2)
    assert guard.frames_bytes(size) == 2 * 121 * 704 * 1280 * 3 * 4
    assert guard.latent_bytes(size, "vae22") == 2 * 48 * 31 * 44 * 80 * 4
    assert guard.latent_bytes(size, "vae21") == 2 * 16 * 31 * 88 * 160 * 4
    assert guard.smallest_latent_bytes(size) == guard.latent_bytes(size, "vae22")


@pytest.mark.parametrize("model, vae, size, measured_gib", [
    # one bf16 forward's peak activations on an H100 (docs/measured.md: eager peaks)
    ("wan2.1-t2v-1.3b", "vae21", VideoSize(832, 480, 81), 0.60),
    ("wan2.2-ti2v-5b", "vae22", VideoSize(1280, 704, 121), 1.05),
    ("wan2.1-t2v-14b", "vae21", VideoSize(1280, 720, 81), 3.63),
])
def test_sampling_estimate_is_a_lower_bound_of_what_was_measured(model, vae, size, measured_gib):
    estimate = guard.sampling_bytes(KNOWN_DITS[model].config, vae, size, compute_itemsize=2)
    assert 0.5 * measured_gib * GIB <= estimate <= measured_gib * GIB


def test_largest_fitting_sizes_fit_and_one_step_more_does_not():
    size = VideoSize(1280, 704, 121)
    available = guard.frames_bytes(VideoSize(1280, 704, 45)) + 1
    text = guard.largest_fitting(size, 16, guard.frames_bytes, available)
    assert text.startswith("1280x704 with up to 45 frames or ")
    width, height = map(int, text.rsplit(" or ", 1)[1].split(" ")[0].split("x"))
    assert width % 16 == 0 and height % 16 == 0
    assert guard.frames_bytes(VideoSize(width, height, 121)) <= available
    assert guard.frames_bytes(VideoSize(width + 16, height + 16, 121)) > available
    assert guard.largest_fitting(size, 16, guard.frames_bytes, 10) == "none at this batch size"


def test_oversized_video_is_refused_in_validation(tmp_path, headless, monkeypatch, capsys):
    loads = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a))
    path = workflow_file(tmp_path, width=8192, height=8192, frames=4097)
    assert cli.main(["run", str(path), "--out", str(headless), "--quiet"]) == 2
    err = capsys.readouterr().err
    needed = guard.frames_bytes(VideoSize(8192, 8192, 4097)) + \
        guard.smallest_latent_bytes(VideoSize(8192, 8192, 4097))
    assert 'node 5 (WanEnhancedEmptyLatent "Wan Empty Latent"), input "frames"' in err
    assert f"needs at least {guard.gib(needed)}" in err
    assert "of memory in all" in err and "free now" in err and "the largest that fits" in err
    assert loads == [] and not headless.exists()


def test_sampling_too_large_for_the_device_is_refused_in_validation(tmp_path, headless,
                                                                    monkeypatch, capsys):
    monkeypatch.setattr(host, "compute_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(guard, "machine_memory", lambda: (1 << 40, "plenty"))
    monkeypatch.setattr(guard, "total_bytes", lambda device: 8 << 10)  # an 8 KiB device
    path = workflow_file(tmp_path, width=64, height=64, frames=5)
    assert cli.main(["run", str(path), "--out", str(headless), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "sampling 'dit.safetensors'" in err and "the CPU (system memory) has 8 KiB in all" in err


def test_each_stage_refuses_before_it_allocates(headless, monkeypatch):
    (model,) = NODES["WanEnhancedModelLoader"]().load(DIT, "fp32", "sdpa")
    (vae,) = NODES["WanEnhancedVAELoader"]().load(VAE, "fp32")
    rows = [[torch.zeros(1, 4, model.config.text_dim), {}]]
    (latent,) = NODES["WanEnhancedEmptyLatent"]().make(model, 64, 64, 9, 1)
    latent_size = guard.latent_bytes(VideoSize(64, 64, 9), "vae22")
    monkeypatch.setattr(guard, "free_bytes", lambda device: latent_size - 1)
    with pytest.raises(NodeInputError, match=r"Wan Empty Latent: 64x64x9: the latent needs at "
                                             r"least .*; the CPU \(system memory\) has .* free; "
                                             r"the largest that fits: 64x64 with up to 5 frames"):
        NODES["WanEnhancedEmptyLatent"]().make(model, 64, 64, 9, 1)
    with pytest.raises(NodeInputError, match="Wan Sampler: 64x64x9: sampling dit.safetensors"):
        NODES["WanEnhancedSampler"]().run(model, rows, rows, latent, 1, 1, 4.0, 5.0, "unipc", 1.0)
    with pytest.raises(NodeInputError, match="Wan Tiled Decode: 64x64x9: the decoded video"):
        NODES["WanEnhancedTiledDecode"]().run(vae, latent, 32, 32, 16, 16, "tiled")
    monkeypatch.undo()
    (images,) = NODES["WanEnhancedTiledDecode"]().run(vae, latent, 32, 32, 16, 16, "tiled")
    assert images.shape == (9, 64, 64, 3)  # the same stages run when there is room


def test_untiled_gpu_decode_is_checked_against_free_device_memory(monkeypatch):
    class Cost:
        def bytes(self, height, width):
            return height * width * 1000

    monkeypatch.setattr(guard, "free_bytes", lambda device: 16 * 16 * 1000)
    size = VideoSize(512, 512, 5)
    with pytest.raises(guard.MemoryRefusal, match="an untiled decode needs at least .* cuda has "
                                                  ".* free; the largest that fits: 256x256 "
                                                  "with 5 frames; or mode auto"):
        guard.check_untiled_decode(Cost(), size, 16, torch.device("cuda"))
    guard.check_untiled_decode(Cost(), size, 16, torch.device("cpu"))  # no device limit


def test_the_size_suggested_before_the_model_is_known_suits_every_model(monkeypatch):
    """Validation does not know the model yet: a suggested frame size is a multiple of 32, which
    TI2V-5B takes too (a multiple of 16 only was refused by it when the run started)."""
    import re

    from wan_enhanced.nodes.checks import video_memory_problem

    need = guard.frames_bytes(guard.VideoSize(640, 640, 121, 1)) + \
        guard.smallest_latent_bytes(guard.VideoSize(640, 640, 121, 1))
    monkeypatch.setattr(guard, "machine_memory", lambda: (need, "a small machine"))
    problem = video_memory_problem(1280, 704, 121, 1)
    sizes = [(int(w), int(h)) for w, h in re.findall(r"(\d+)x(\d+) with 121 frames", problem)]
    assert sizes and all(w % 32 == 0 and h % 32 == 0 for w, h in sizes), problem


def test_block_swap_fit_takes_the_fewest_blocks_that_fit_the_free_memory(headless, monkeypatch):
    """block_swap -1: the host makes room for the resident model first, then the fewest swapped
    blocks whose placement and activations fit what is free; 0 on a CPU; every block when
    nothing less fits (sampling then refuses, naming the largest size that fits). With one
    block prefetched, two device slots hold swapped blocks: a third swapped block is the first
    that saves memory."""
    import types

    from wan_enhanced.pipeline.placement import tensor_bytes

    (handle,) = NODES["WanEnhancedModelLoader"]().load(DIT, "fp32", "sdpa")
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
    model.head = torch.nn.Linear(64, 64)
    model.compute_dtype = torch.float32
    fake = types.SimpleNamespace(model=model, config=handle.config, vae_kind=handle.vae_kind)
    shape = (1, 48, 3, 4, 4)
    block = tensor_bytes(model.blocks[0])
    activations = guard.sampling_bytes(handle.config, handle.vae_kind,
                                       guard.size_of_latent(shape, handle.vae_kind), 4)
    resident = activations + tensor_bytes(model)
    asked = []
    monkeypatch.setattr(host, "make_room", lambda size, device: asked.append(size))
    cuda = torch.device("cuda")
    for free, expected in ((resident, 0), (resident - 1, 3), (resident - 2 * block, 4),
                           (resident - 4 * block, 6), (resident - 4 * block - 1, 6), (0, 6)):
        monkeypatch.setattr(guard, "free_bytes", lambda device, free=free: free)
        assert guard.fitting_block_swap(fake, shape, cuda) == expected, free
    assert set(asked) == {resident}
    assert guard.fitting_block_swap(fake, shape, torch.device("cpu")) == 0


def test_the_sampler_takes_block_swap_fit_and_refuses_less(headless):
    (model,) = NODES["WanEnhancedModelLoader"]().load(DIT, "fp32", "sdpa")
    rows = [[torch.zeros(1, 4, model.config.text_dim), {}]]
    (latent,) = NODES["WanEnhancedEmptyLatent"]().make(model, 64, 64, 5, 1)
    sampler = NODES["WanEnhancedSampler"]()
    (fit,) = sampler.run(model, rows, rows, latent, 1, 2, 4.0, 5.0, "unipc", 1.0, block_swap=-1)
    (none,) = sampler.run(model, rows, rows, latent, 1, 2, 4.0, 5.0, "unipc", 1.0, block_swap=0)
    assert torch.equal(fit["samples"], none["samples"])  # on a CPU nothing is swapped
    with pytest.raises(NodeInputError, match="block_swap -2 .*-1: as few as fit"):
        sampler.run(model, rows, rows, latent, 1, 2, 4.0, 5.0, "unipc", 1.0, block_swap=-2)


@pytest.fixture
def capped_gpu(monkeypatch):
    """A stand-in 80 GiB CUDA device with 70 GiB free to the driver, of which this process has
    reserved 4 GiB and allocated 3 GiB, and a per-process fraction (set by the test)."""
    gib_ = 1 << 30
    state = {"fraction": 1.0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib_, 80 * gib_))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * gib_)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * gib_)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=80 * gib_))
    return state


def test_free_memory_honours_a_per_process_memory_cap(capped_gpu):
    """torch.cuda.set_per_process_memory_fraction (an 8 GiB card on a big one): the allocator
    refuses past fraction x total, so what is free is the cap less what is allocated, however
    much the driver has free; every automatic choice reads it from here."""
    from wan_enhanced.pipeline.decode import FREE_MEMORY_MARGIN, free_device_bytes

    gib_ = 1 << 30
    cuda = torch.device("cuda")
    assert guard.free_bytes(cuda) == 71 * gib_  # driver's free + unused cache
    assert guard.total_bytes(cuda) == 80 * gib_
    capped_gpu["fraction"] = 0.1  # 8 GiB
    assert guard.free_bytes(cuda) == 5 * gib_
    assert guard.total_bytes(cuda) == 8 * gib_
    assert free_device_bytes(cuda) == int(FREE_MEMORY_MARGIN * 5 * gib_)
    capped_gpu["fraction"] = 0.03  # below what is allocated already: nothing
    assert guard.free_bytes(cuda) == 0


def test_the_lora_merge_leaves_a_capped_gpu_that_cannot_hold_it(capped_gpu, monkeypatch):
    from wan_enhanced.pipeline import work_device

    monkeypatch.setattr(host, "compute_device", lambda: torch.device("cuda"))
    capped_gpu["fraction"] = 0.1  # 5 GiB free under the cap
    assert work_device.merge_work_device() == torch.device("cuda")
    capped_gpu["fraction"] = 0.05  # 4 GiB cap, 3 allocated: 1 GiB, less than a merge needs
    assert guard.free_bytes(torch.device("cuda")) < work_device.NEEDED_FREE_BYTES
    assert work_device.merge_work_device() is None
