"""A LoRA's merge on the GPU: a merged block matrix's codes lie within a code step of a CPU
merge's; matrices no merge touches keep the codes a load gives (so taking the LoRA out restores
them exactly). Without CUDA, everything stays on the CPU."""

import pytest
import torch

from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit
from wan_enhanced.lora.file import open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.merge import Merge
from wan_enhanced.lora.tiny import block_modules, random_lora, write_lora
from wan_enhanced.pipeline import work_device

CONFIG = TINY_DIT["t2v"]


def test_no_cuda_no_work_device(monkeypatch):
    monkeypatch.setattr(work_device.host, "compute_device", lambda: torch.device("cpu"))
    assert work_device.merge_work_device() is None


def loaded(path, quantization, lora=None, device=None):
    if lora is None:
        return load_dit(path, torch.bfloat16, quantization, device=device)[0]
    with open_lora(lora, dit_shapes(CONFIG)) as opened:
        return load_dit(path, torch.bfloat16, quantization, Merge.of([(opened, 1.0)]),
                        device=device)[0]


def test_the_cpu_as_work_device_changes_nothing(tmp_path):
    path = write_dit(tmp_path / "dit.safetensors", CONFIG, "comfy", dtype=torch.float16)
    lora = write_lora(tmp_path / "l.safetensors", random_lora(CONFIG, 1, rank=4), "generic")
    plain = loaded(path, "fp8_e4m3fn", lora).state_dict()
    on_cpu = loaded(path, "fp8_e4m3fn", lora, torch.device("cpu")).state_dict()
    assert all(torch.equal(v, plain[k]) for k, v in on_cpu.items())


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8_e4m3fn", "int8"])
def test_a_merge_on_the_gpu_lies_within_a_code_of_the_cpus(tmp_path, quantization):
    path = write_dit(tmp_path / "dit.safetensors", CONFIG, "comfy", dtype=torch.float16)
    # pairs on block 0's matrices only: block 1's are untouched
    lora = write_lora(tmp_path / "l.safetensors",
                      random_lora(CONFIG, 1, block_modules(CONFIG, blocks=[0]), rank=8), "kohya")
    cpu = loaded(path, quantization, lora)
    gpu = loaded(path, quantization, lora, torch.device("cuda"))
    plain = loaded(path, quantization).state_dict()
    assert all(v.device.type == "cpu" for v in gpu.state_dict().values())
    a, b = cpu.blocks[0].ffn[0], gpu.blocks[0].ffn[0]
    da = a.weight.float() * a.weight_scale[:, None]
    db = b.weight.float() * b.weight_scale[:, None]
    step = torch.maximum(a.weight_scale, b.weight_scale)[:, None].expand_as(da)
    assert torch.all((da - db).abs() <= step * 1.0001)
    assert (a.weight != b.weight).float().mean() < 0.01
    assert not torch.equal(db, plain["blocks.0.ffn.0.weight"].float())  # it did merge
    # what no merge touched is the load's, bit for bit
    for key in ("blocks.1.ffn.0.weight", "blocks.1.ffn.0.weight_scale",
                "blocks.1.self_attn.q.weight"):
        assert torch.equal(gpu.state_dict()[key], plain[key]), key
