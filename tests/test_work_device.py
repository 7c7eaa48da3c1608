"""Loading's arithmetic on the GPU: a block matrix quantized there gets the codes the CPU gives
(the same elementwise operations); a LoRA merged there differs from a CPU merge by float32
rounding at most. Without CUDA, loading stays on the CPU."""

import pytest
import torch

from wan_enhanced.checkpoints.loader import load_dit
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit
from wan_enhanced.lora.file import open_lora
from wan_enhanced.lora.keymap import dit_shapes
from wan_enhanced.lora.merge import Merge
from wan_enhanced.lora.tiny import lightx2v_lora, write_lora
from wan_enhanced.pipeline import work_device

CONFIG = TINY_DIT["t2v"]


def test_no_cuda_no_work_device(monkeypatch):
    monkeypatch.setattr(work_device.host, "compute_device", lambda: torch.device("cpu"))
    assert work_device.load_work_device() is None


def test_the_cpu_as_work_device_changes_nothing(tmp_path):
    path = write_dit(tmp_path / "dit.safetensors", CONFIG, "comfy", dtype=torch.float16)
    plain = load_dit(path, torch.bfloat16, "fp8_e4m3fn")[0].state_dict()
    on_cpu = load_dit(path, torch.bfloat16, "fp8_e4m3fn", device=torch.device("cpu"))[0]
    assert all(torch.equal(v, plain[k]) for k, v in on_cpu.state_dict().items())


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8_e4m3fn", "int8"])
def test_quantizing_on_the_gpu_gives_the_cpus_codes(tmp_path, quantization):
    path = write_dit(tmp_path / "dit.safetensors", CONFIG, "comfy", dtype=torch.float16)
    cpu = load_dit(path, torch.bfloat16, quantization)[0].state_dict()
    gpu = load_dit(path, torch.bfloat16, quantization, device=torch.device("cuda"))[0]
    for key, value in gpu.state_dict().items():
        assert value.device.type == "cpu", key
        assert torch.equal(value, cpu[key]), key
    lora = write_lora(tmp_path / "l.safetensors", lightx2v_lora(CONFIG, 1, rank=8,
                                                                 pair_min=60_000), "lightx2v")
    merged = {}
    for device in (None, torch.device("cuda")):
        with open_lora(lora, dit_shapes(CONFIG)) as opened:
            model = load_dit(path, torch.bfloat16, quantization, Merge.of([(opened, 1.0)]),
                             device=device)[0]
        merged[device] = model
    a, b = (m.blocks[0].ffn[0] for m in merged.values())
    da = a.weight.float() * a.weight_scale[:, None]
    db = b.weight.float() * b.weight_scale[:, None]
    step = a.weight_scale[:, None].expand_as(da)  # one code apart at most
    assert torch.all((da - db).abs() <= step * 1.0001)
    assert (a.weight != b.weight).float().mean() < 0.01
