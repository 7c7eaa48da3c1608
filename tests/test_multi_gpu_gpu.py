"""Several GPUs over NCCL (opt-in: --gpu on a machine with 2+ CUDA GPUs; bench/run_multi_gpu.sh
runs these first): the split DiT equals one GPU's forward, through Ulysses and through ring (whose
fused CUDA attention returns the log-sum-exp), and the sampler node's gpus input gives the
one-GPU latent (with a LoRA too)."""

import pytest
import torch

from wan_enhanced.distributed.contracts import ForwardCase, ForwardRequest, ModelSpec
from wan_enhanced.distributed.group import WorkerGroup, shutdown_worker_group
from wan_enhanced.distributed.lse_attention import _fused, _plain
from wan_enhanced.wan.configs import DiTConfig
from wan_enhanced.wan.dit import WanDiT

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lse_attention_on_cuda(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 64, device="cuda", dtype=dtype) for n in (300, 517, 517))
    fused = _fused(q, k, v)
    assert fused is not None, "the CUDA kernel with log-sum-exp did not run"
    out, lse = _plain(q, k, v)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fused[0].float() - out).abs().max() / out.abs().max() < tolerance
    assert (fused[1][..., :300].float() - lse).abs().max() < 1e-3


@needs_two
@pytest.mark.parametrize("heads,mode", [(4, "auto"), (3, "auto"), (4, "ring")])
def test_split_forward_equals_one_gpu(heads, mode, monkeypatch):
    # exact float32 convolutions here and, through the task's settings, on the ranks
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(heads)
    config = DiTConfig(dim=64 * heads, ffn_dim=256, num_heads=heads, num_layers=2)
    model = WanDiT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    case = ForwardCase(torch.randn(1, 16, 3, 10, 14), torch.tensor([600.0]),
                       torch.randn(1, 9, 4096))
    with torch.no_grad():
        reference = model.cuda()(case.x.cuda(), case.t.cuda(), case.context.cuda()).cpu()
    group = WorkerGroup(2, "cuda").start()
    try:
        result = group.run(".distributed.tasks:forward", ForwardRequest(
            ModelSpec(config=config.to_dict(), state={k: v.cpu() for k, v in
                                                      model.state_dict().items()}),
            (case,), mode=mode), timeout_s=600)
    finally:
        group.shutdown()
    out = result.outputs[0]
    assert (out - reference).abs().max() / reference.abs().max() < 1e-4
    assert all(m["reserved_peak_bytes"] > 0 for m in result.metrics)


@needs_two
def test_sampler_node_gpus_on_cuda(tmp_path):
    from wan_enhanced import host
    from wan_enhanced.checkpoints import tiny
    from wan_enhanced.lora.tiny import random_lora, write_lora
    from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES

    tiny.write_models_folder(tmp_path, dit_name="d.safetensors", vae_name="v.safetensors",
                             text_encoder_name="t.safetensors", kind="t2v")
    host.set_headless_folders(models=tmp_path, output=tmp_path / "out")
    node = lambda name: NODES[f"WanEnhanced{name}"]()  # noqa: E731
    (model,) = node("ModelLoader").load("d.safetensors", "fp32", "sdpa")
    (encoder,) = node("TextEncoderLoader").load("t.safetensors", "fp32", "cpu")
    positive, negative = node("TextEncode").encode(encoder, "a fox", "")
    (latent,) = node("EmptyLatent").make(model, 64, 48, 9, 1)
    write_lora(tmp_path / "loras" / "l.safetensors",
               random_lora(tiny.TINY_DIT["t2v"], seed=3, alpha=4.0), "kohya")
    (with_lora,) = node("LoRALoader").load(model, "l.safetensors", 0.8, "unmerged")
    settings = dict(seed=3, steps=3, cfg=4.0, shift=5.0, scheduler="unipc", denoise=1.0)
    try:
        (one,) = node("Sampler").run(model, positive, negative, latent, **settings)
        (two,) = node("Sampler").run(model, positive, negative, latent, gpus=2, **settings)
        (sharded,) = node("Sampler").run(model, positive, negative, latent, gpus=2, fsdp=True,
                                         **settings)
        (one_lora,) = node("Sampler").run(with_lora, positive, negative, latent, **settings)
        (sharded_lora,) = node("Sampler").run(with_lora, positive, negative, latent, gpus=2,
                                              fsdp=True, **settings)
    finally:
        shutdown_worker_group()
        host.set_headless_folders(models="models", output="output")
    for out, reference in ((two, one), (sharded, one), (sharded_lora, one_lora)):
        a, b = out["samples"], reference["samples"]
        assert (a - b).abs().max() / b.abs().max() < 1e-4
    assert not torch.allclose(one_lora["samples"], one["samples"], rtol=1e-3, atol=1e-3)
