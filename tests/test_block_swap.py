"""Block swap: blocks streamed through a ring of slot buffers compute exactly what resident
blocks do, leave the model as they found it, and allocate nothing new on later runs.

On the CPU the slots are host buffers and copies are synchronous, which exercises the ring, the
binding of each block's tensors to slot views and the cyclic prefetch order; the stream/event
path runs in the GPU test at the end (skipped without CUDA) and in bench/block_swap_gpu.py.
"""

from dataclasses import replace

import pytest
import torch

from wan_enhanced.checkpoints.tiny import TINY_DIT, randomize
from wan_enhanced.offload.block_swap import BlockSwap
from wan_enhanced.offload.packed_blocks import ALIGNMENT, block_tensors, pack_block
from wan_enhanced.wan.dit import WanDiT, keeps_float32


BLOCKS = 5  # odd, so the ring's cycle and the slot count do not line up


def tiny_model(kind="t2v", seed=0, dtype=torch.float32) -> WanDiT:
    config = replace(TINY_DIT[kind], num_layers=BLOCKS)
    with torch.device("meta"):
        model = WanDiT(config, compute_dtype=dtype)
    # stored as the loader stores it: block matrices in `dtype`, norms and modulation float32
    state = {k: v if keeps_float32(k) else v.to(dtype)
             for k, v in randomize(model, seed).items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def inputs(model: WanDiT, seed=1):
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = torch.randn(1, cfg.in_dim, 3, 4, 6, generator=gen)
    context = torch.randn(1, 7, cfg.text_dim, generator=gen)
    return x, torch.tensor([637.0]), context


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("swapped,slots", [(range(5), 2), (range(3), 2), ([0, 2, 3], 1),
                                           (range(4), 3), ([1], 4), (range(5), 5)])
def test_swapped_forward_equals_resident(swapped, slots):
    model = tiny_model(dtype=torch.bfloat16)
    assert len(model.blocks) == BLOCKS
    x, t, context = inputs(model)
    expected = model(x, t, context)
    before = snapshot(model)
    with BlockSwap(model.blocks, swapped, "cpu", slots) as swap:
        # several forwards: the ring's cyclic prefetch crosses from one forward into the next
        for _ in range(3):
            assert torch.equal(model(x, t, context, blocks=swap.blocks()), expected)
    after = snapshot(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype
               for k in before)


def test_blocks_are_bound_to_slots_only_while_they_compute():
    model = tiny_model()
    swap = BlockSwap(model.blocks, range(BLOCKS), "cpu", slots=2)
    slot_ptrs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in swap.slots]

    def in_slot(block):
        ptr = block.ffn[0].weight.data_ptr()
        return any(lo <= ptr < hi for lo, hi in slot_ptrs)

    seen = []
    for i, block in enumerate(swap.blocks()):
        seen.append(in_slot(block))
        assert not any(in_slot(b) for j, b in enumerate(model.blocks) if j != i)
    assert seen == [True] * BLOCKS
    assert not any(in_slot(b) for b in model.blocks)
    swap.close()
    assert swap.slots == []


def test_packing_keeps_values_and_is_found_again():
    model = tiny_model(dtype=torch.bfloat16)
    block = model.blocks[1]
    values = [t.clone() for t in block_tensors(block)]
    first = pack_block(block, pinned=False)
    assert [t.dtype for t in block_tensors(block)] == [v.dtype for v in values]
    assert all(torch.equal(t, v) for t, v in zip(block_tensors(block), values))
    assert all(off % ALIGNMENT == 0 for off in first.layout.offsets)
    # one buffer, not much larger than the tensors it holds
    payload = sum(v.numel() * v.element_size() for v in values)
    assert payload <= first.buffer.numel() <= payload + ALIGNMENT * len(values)
    assert all(t.untyped_storage().data_ptr() == first.buffer.data_ptr()
               for t in block_tensors(block))
    second = pack_block(block, pinned=False)
    assert second.buffer.data_ptr() == first.buffer.data_ptr()  # found, not copied again


def test_a_second_run_allocates_no_new_host_memory():
    model = tiny_model()
    x, t, context = inputs(model)
    with BlockSwap(model.blocks, range(BLOCKS), "cpu") as swap:
        model(x, t, context, blocks=swap.blocks())
        buffers = [p.buffer.data_ptr() for p in swap.packs]
    with BlockSwap(model.blocks, range(BLOCKS), "cpu") as swap:
        model(x, t, context, blocks=swap.blocks())
        assert [p.buffer.data_ptr() for p in swap.packs] == buffers


def test_a_block_failing_half_way_leaves_the_model_usable():
    model = tiny_model()
    x, t, context = inputs(model)
    expected = model(x, t, context)
    swap = BlockSwap(model.blocks, range(BLOCKS), "cpu", slots=2)
    original = type(model.blocks[2]).forward

    def failing(self, *args, **kwargs):
        if self is model.blocks[2]:
            raise RuntimeError("out of memory (simulated)")
        return original(self, *args, **kwargs)

    type(model.blocks[2]).forward = failing
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            model(x, t, context, blocks=swap.blocks())
    finally:
        type(model.blocks[2]).forward = original
        swap.close()
    assert all(p.data_ptr() != 0 and p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model(x, t, context), expected)


def test_bad_arguments_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="outside 0..4"):
        BlockSwap(model.blocks, [5], "cpu")
    with pytest.raises(ValueError, match="at least one device slot"):
        BlockSwap(model.blocks, [0], "cpu", slots=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_gpu_swapped_forward_equals_resident(slots):
    model = tiny_model(dtype=torch.bfloat16)
    x, t, context = inputs(model)
    resident = tiny_model(dtype=torch.bfloat16).cuda()
    expected = resident(x.cuda(), t.cuda(), context.cuda())
    non_block = [m for name, m in model.named_children() if name != "blocks"]
    for m in non_block:
        m.cuda()
    with BlockSwap(model.blocks, range(BLOCKS), "cuda", slots) as swap:
        assert all(p.buffer.is_pinned() for p in swap.packs)
        for _ in range(3):
            out = model(x.cuda(), t.cuda(), context.cuda(), blocks=swap.blocks())
            assert torch.equal(out, expected)
    assert all(p.device.type == "cpu" for p in model.blocks.parameters())


def test_benchmark_script_runs_and_checks_equality(tmp_path):
    """bench/block_swap_gpu.py --quick on the CPU: every swapped row equals the resident one."""
    import json

    from wan_enhanced.bench import block_swap_gpu

    code = block_swap_gpu.main(["--out", str(tmp_path), "--quick", "--repeats", "1",
                                "--case", "dit_1_3b", "--mode", "eager"])
    data = json.loads((tmp_path / "block_swap.json").read_text())
    assert code == 0
    assert [(r["blocks_swapped"], r["prefetch"]) for r in data["rows"]] == [
        (0, 0), (2, 1), (2, 2), (1, 1)]
    assert all(r["equal_to_resident"] for r in data["rows"])
    assert "| dit_1_3b |" in (tmp_path / "block_swap.md").read_text()


@pytest.mark.skipif(not (__import__("shutil").which("c++") or __import__("shutil").which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_read_the_slot_weights():
    """Compiled blocks take their weights as graph inputs, so a block bound to slot views runs
    on the weights in the slot (not on whatever the graph saw when it was compiled)."""
    model = tiny_model()
    x, t, context = inputs(model)
    expected = model(x, t, context)
    compiled_resident = model(x, t, context, compiled=True)
    with BlockSwap(model.blocks, range(BLOCKS), "cpu", slots=2) as swap:
        swapped = model(x, t, context, compiled=True, blocks=swap.blocks())
    scale = float(expected.abs().max())
    assert float((compiled_resident - expected).abs().max()) <= 1e-5 * scale
    assert float((swapped - expected).abs().max()) <= 1e-5 * scale
    # every video size, timestep form and weight format is a graph of its own: room for many
    config = torch._dynamo.config
    assert getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 0)) >= 64


def test_pinning_asks_the_host_to_make_room_for_what_it_pins_anew(monkeypatch):
    """A host with a pinned-memory budget (ComfyUI 0.30's ensure_pin_budget) is asked, before
    block swap packs its blocks into pinned memory, for the bytes not pinned already; a host
    without one (0.3.64, headless) is not asked."""
    import types

    from wan_enhanced import host
    from wan_enhanced.offload.packed_blocks import BlockLayout, bytes_to_pin

    model = WanDiT(TINY_DIT["t2v"])
    blocks = list(model.blocks[:2])
    sizes = [BlockLayout.of(block_tensors(b)).total for b in blocks]
    assert bytes_to_pin(blocks) == sum(sizes)
    pack_block(blocks[0], pinned=False)  # packed, not pinned: still to pin
    assert bytes_to_pin(blocks) == sum(sizes)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    assert bytes_to_pin(blocks) == sizes[1]  # the first is packed in pinned memory now

    asked = []
    mm = types.SimpleNamespace(ensure_pin_budget=lambda size: asked.append(size))
    monkeypatch.setattr(host, "_comfy", lambda name: mm if name == "comfy.model_management"
                        else None)
    host.make_room_for_pinned(sizes[1])
    host.make_room_for_pinned(0)
    assert asked == [sizes[1]]
    monkeypatch.setattr(host, "_comfy", lambda name: types.SimpleNamespace())  # 0.3.64
    host.make_room_for_pinned(sizes[1])
    monkeypatch.setattr(host, "_comfy", lambda name: None)  # headless
    host.make_room_for_pinned(sizes[1])
    assert asked == [sizes[1]]
