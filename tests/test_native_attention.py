"""Wan Enhanced Attention: ComfyUI's own Wan models' attention calls routed to our kernels where
they take a call exactly, handed back to ComfyUI's function otherwise (on a CPU: every call),
each reason said once; the node clones the MODEL and refuses anything but a native Wan model."""

import copy
import logging
import types

import pytest
import torch
import torch.nn.functional as F

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.pipeline.native_attention import NativeAttention


def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    """ComfyUI's attention_pytorch, restated: [B, L, heads * d] in and out (or [B, heads, L, d]
    with skip_reshape / skip_output_reshape)."""
    if skip_reshape:
        b, _, _, d = q.shape
    else:
        b, _, inner = q.shape
        d = inner // heads
        q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * d)


def our_layout_reference(q, k, v):
    """A kernel of ours: [B, L, heads, d] in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def qkv(skip_reshape=False, length=1024, heads=2, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, heads, length, 128) if skip_reshape else (1, length, heads * 128)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]


def test_on_a_cpu_every_call_goes_to_comfyuis_function_unchanged(caplog):
    override = NativeAttention("auto")
    calls = []

    def func(*args, **kwargs):
        calls.append((args, kwargs))
        return comfy_attention(*args, **kwargs)

    q, k, v = qkv()
    with caplog.at_level(logging.INFO, logger="wan_enhanced"):
        for _ in range(3):
            out = override(func, q, k, v, 2, transformer_options={"x": 1})
    assert torch.equal(out, comfy_attention(q, k, v, 2))
    assert len(calls) == 3 and calls[0][1]["transformer_options"] == {"x": 1}
    assert calls[0][1]["mask"] is None and calls[0][1]["skip_reshape"] is False
    (reason,) = override.handed_back
    assert "our kernels cannot run here" in reason and override.handed_back[reason] == 3
    said = [r.getMessage() for r in caplog.records if "Wan Enhanced Attention" in r.getMessage()]
    assert len(said) == 1 and reason in said[0]  # once, not per call
    assert not override.ours


@pytest.mark.parametrize("skip_reshape, skip_output_reshape",
                         [(False, False), (True, True), (True, False), (False, True)])
def test_a_call_our_kernel_takes_gives_comfyuis_layout_and_values(monkeypatch, skip_reshape,
                                                                  skip_output_reshape):
    """The layouts ComfyUI's Wan models call with, through a stand-in for our kernel: the
    result has the layout ComfyUI's function returns and its values."""
    override = NativeAttention("auto")
    monkeypatch.setattr(override, "kernel_for",
                        lambda *a: (("stand-in", our_layout_reference), None))
    q, k, v = qkv(skip_reshape, dtype=torch.float32)
    out = override(comfy_attention, q, k, v, 2, skip_reshape=skip_reshape,
                   skip_output_reshape=skip_output_reshape)
    expected = comfy_attention(q, k, v, 2, skip_reshape=skip_reshape,
                               skip_output_reshape=skip_output_reshape)
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, atol=1e-5)
    assert override.ours == {"stand-in": 1}


def test_a_cuda_graph_capture_gets_our_kernel_only_after_it_ran_uncaptured(monkeypatch):
    """Newer ComfyUIs run a block once, then capture it into a CUDA graph: a kernel's first
    launch at a shape cannot be captured, so a capture before an uncaptured run at the same
    shapes hands the call back; after one, captured calls are ours."""
    from wan_enhanced.pipeline import native_attention

    capturing = [True]
    monkeypatch.setattr(native_attention, "_capturing", lambda tensor: capturing[0])
    monkeypatch.setattr(native_attention, "_RAN_UNCAPTURED", set())
    override = NativeAttention("auto")
    monkeypatch.setattr(override, "kernel_for",
                        lambda *a: (("stand-in", our_layout_reference), None))
    q, k, v = qkv(dtype=torch.float32)
    expected = comfy_attention(q, k, v, 2)
    for capture, ours in ((True, 0), (False, 1), (True, 2)):
        capturing[0] = capture
        assert torch.allclose(override(comfy_attention, q, k, v, 2), expected, atol=1e-5)
        assert override.ours.get("stand-in", 0) == ours
    reason = "a CUDA graph capture before the kernel ran uncaptured at these shapes"
    assert override.handed_back == {reason: 1}
    other = qkv(length=2048, dtype=torch.float32)  # new shapes: handed back again
    override(comfy_attention, *other, 2)
    assert override.handed_back == {reason: 2} and override.ours["stand-in"] == 2


def fake_cuda(monkeypatch, fp8=None, exact=None):
    """Our kernels' availability as on a GPU (None: it runs)."""
    from wan_enhanced.wan import attention as backends

    monkeypatch.setattr(backends, "fp8_attention_unavailable", lambda device, head_dim: fp8)
    monkeypatch.setattr(backends, "bf16_hopper_unavailable", lambda *a: exact)


@pytest.mark.parametrize("mode, fp8, exact, length, expected", [
    ("auto", None, None, 1024, "fp8"),
    ("auto", "no fp8 here", None, 1024, "bf16"),
    ("bf16", None, None, 1024, "bf16"),
    ("fp8", None, None, 1024, "fp8"),
    ("auto", None, None, 512, "short key sequences"),
    ("fp8", "no fp8 here", None, 1024, "our fp8 kernel cannot run here: no fp8 here"),
    ("auto", "no fp8 here", "not Hopper", 1024, "our kernels cannot run here: not Hopper"),
])
def test_which_kernel_takes_a_call(monkeypatch, mode, fp8, exact, length, expected):
    fake_cuda(monkeypatch, fp8, exact)
    override = NativeAttention(mode)
    q, k, v = qkv(length=length)
    kernel, reason = override.kernel_for(q, k, v, 2, None, False)
    if kernel is not None:
        assert kernel[0] == expected and reason is None
    else:
        assert expected in reason


@pytest.mark.parametrize("change, reason", [
    ("mask", "a mask"),
    ("head", "head size 64"),
    ("float32", "torch.float32 inputs"),
    ("keys", "keys and values shaped unlike the queries"),
])
def test_calls_our_kernels_cannot_take_exactly_are_handed_back(monkeypatch, change, reason):
    fake_cuda(monkeypatch)
    q, k, v = qkv()
    mask, heads = None, 2
    if change == "mask":
        mask = torch.zeros(1, 1, q.shape[1], k.shape[1])
    elif change == "head":
        heads = 4
    elif change == "float32":
        q, k, v = (t.float() for t in (q, k, v))
    else:
        v = v[:, :512]
    kernel, why = NativeAttention("auto").kernel_for(q, k, v, heads, mask, False)
    assert kernel is None and reason in why


def test_an_override_installed_before_ours_takes_the_calls_we_hand_back():
    seen = []

    def earlier(func, *args, **kwargs):
        seen.append(kwargs.get("mask"))
        return func(*args, **kwargs)

    override = NativeAttention("bf16", inner=earlier)
    q, k, v = qkv()
    mask = torch.zeros(1, 1, q.shape[1], k.shape[1])
    out = override(comfy_attention, q, k, v, 2, mask=mask)
    assert seen and seen[0] is mask
    assert torch.equal(out, comfy_attention(q, k, v, 2, mask=mask))


class FakePatcher:
    """What the node needs of ComfyUI's ModelPatcher: clone(), model_options, model."""

    def __init__(self, inner_module: str):
        kind = type("WanModel", (), {"__module__": inner_module})
        self.model = types.SimpleNamespace(diffusion_model=kind())
        self.model_options = {"transformer_options": {}}

    def clone(self):
        twin = copy.copy(self)
        twin.model_options = copy.deepcopy(self.model_options)
        return twin


def test_the_node_clones_the_model_and_installs_the_override():
    node = NODE_CLASS_MAPPINGS["WanEnhancedAttentionPatch"]()
    model = FakePatcher("comfy.ldm.wan.model")
    (patched,) = node.patch(model, "bf16")
    assert patched is not model and model.model_options == {"transformer_options": {}}
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(override, NativeAttention) and override.mode == "bf16"
    assert override.inner is None
    (twice,) = node.patch(patched, "fp8")  # chained: ours hands back to the first one
    assert twice.model_options["transformer_options"][
        "optimized_attention_override"].inner is override
    assert copy.deepcopy(patched.model_options)["transformer_options"][
        "optimized_attention_override"] is override  # clones share it


def test_a_model_that_is_not_a_native_wan_model_is_refused_by_name():
    node = NODE_CLASS_MAPPINGS["WanEnhancedAttentionPatch"]()
    with pytest.raises(NodeInputError, match=r"Wan Enhanced Attention: model: expected one of "
                                             r"ComfyUI's Wan models, got a WanModel "
                                             r"\(comfy.ldm.flux.model\)"):
        node.patch(FakePatcher("comfy.ldm.flux.model"), "auto")
    with pytest.raises(NodeInputError, match="not a ComfyUI MODEL"):
        node.patch(object(), "auto")
    assert host.native_wan_problem(FakePatcher("comfy.ldm.wan.model_animate")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode, cosine, largest", [("bf16", 0.99999, 0.02), ("fp8", 0.999, 0.08)])
def test_on_a_gpu_our_kernels_take_the_calls_within_their_bounds(mode, cosine, largest):
    """A self-attention call as ComfyUI's Wan model makes it (5B: 24 heads of 128, a 720p
    frame's worth of tokens): ours against ComfyUI's own function, per head's cosine and the
    largest difference (the fp8 kernel's bound of tests/test_fp8_attention.py)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3520, 24 * 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    override = NativeAttention(mode)
    out = override(comfy_attention, q, k, v, 24).float()
    exact = comfy_attention(q.float(), k.float(), v.float(), 24)
    assert override.ours == {mode: 1} and not override.handed_back
    per_head = F.cosine_similarity(out.view(1, -1, 24, 128), exact.view(1, -1, 24, 128), dim=-1)
    assert float(per_head.min()) >= cosine
    assert float((out - exact).abs().max() / exact.abs().max()) < largest
