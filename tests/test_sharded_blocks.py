"""Blocks sharded over a group of gloo processes (distributed/sharded_blocks.py, the `fsdp`
setting): each rank keeps 1/world of every packed block, a forward gathers each block into a
ring slot just before it computes, and the output is the whole model's to the bit."""

import shutil

import pytest
import torch

from wan_enhanced.distributed.sharded_blocks import ShardStore, padded_size
from wan_enhanced.offload.packed_blocks import ALIGNMENT, BlockLayout, block_tensors

from test_block_swap import BLOCKS, tiny_model

TIMEOUT = 180


def held_with_sharded_blocks(model, whole: int, world: int) -> int:
    """The weight bytes a rank holds with `model`'s blocks sharded over `world` ranks: everything
    but the blocks whole, and its chunk of each packed block."""
    unit = world * ALIGNMENT
    chunks = raw = 0
    for block in model.blocks:
        tensors = block_tensors(block)
        raw += sum(t.numel() * t.element_size() for t in tensors)
        chunks += -(-BlockLayout.of(tensors).total // unit) * unit // world
    return whole - raw + chunks


@pytest.mark.parametrize("world,dtype", [(2, torch.bfloat16), (3, torch.float32)])
def test_sharded_forwards_equal_the_whole_model(gloo_group, world, dtype):
    group = gloo_group(world)
    results = group.run("dist_tasks:sharded_blocks", {"dtype": dtype}, timeout_s=TIMEOUT)
    facts = results if isinstance(results, dict) else results[0]
    # three forwards: the ring's prefetch crosses from one forward into the next (5 blocks, 2
    # slots), and every one is the whole model's output
    assert facts["equal"] == [True, True, True]
    # between forwards a block holds nothing of its own, and a rank its chunk of each block
    assert facts["after_numel"] == 0 and not facts["peer_copies"]  # the CPU: all-gathers
    assert facts["released"]  # closing the ring let the chunks go
    unit = world * ALIGNMENT
    assert facts["whole"] / world <= facts["held"] <= facts["whole"] / world + BLOCKS * ALIGNMENT
    assert facts["slots"] == 2 * (-(-facts["max_block"] // unit) * unit)


def test_one_rank_without_peer_copies_takes_every_rank_to_all_gathers(gloo_group):
    group = gloo_group(2)
    assert group.run("dist_tasks:fsdp_vote", 1, timeout_s=TIMEOUT) is False
    assert group.run("dist_tasks:fsdp_vote", -1, timeout_s=TIMEOUT) is True


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_run_on_the_gathered_weights(gloo_group):
    results = gloo_group(2).run("dist_tasks:sharded_blocks",
                                {"dtype": torch.float32, "compiled": True, "forwards": 2},
                                timeout_s=600)
    facts = results if isinstance(results, dict) else results[0]
    assert facts["equal"] == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("all_gather", [False, True])
def test_on_gpus_with_peer_copies_or_all_gathers(monkeypatch, all_gather):
    """On GPUs the fills copy the peers' chunks through symmetric memory (or, forced, NCCL
    all-gathers on a side stream): the whole model's output to the bit either way."""
    from wan_enhanced.distributed.group import WorkerGroup

    if all_gather:
        monkeypatch.setenv("WAN_ENHANCED_FSDP_ALL_GATHER", "1")
    group = WorkerGroup(2, "cuda").start()
    try:
        results = group.run("dist_tasks:sharded_blocks", {"dtype": torch.bfloat16},
                            timeout_s=TIMEOUT)
    finally:
        group.shutdown()
    facts = results if isinstance(results, dict) else results[0]
    assert facts["equal"] == [True, True, True] and facts["after_numel"] == 0
    assert facts["peer_copies"] is not all_gather and facts["released"]


def test_a_rank_keeps_its_chunk_of_the_packed_block():
    """The chunks of every rank, end to end, are the block's packed bytes (padded with zeros);
    the block's tensors are left as empty placeholders of their dtypes."""
    world = 3
    reference = tiny_model(seed=0)
    layouts = [BlockLayout.of(block_tensors(b)) for b in reference.blocks]
    # the same weights on every rank (seed 0), as the ranks of a group have them
    stores, models = [], []
    for rank in range(world):
        models.append(tiny_model(seed=0))
        stores.append(ShardStore(layouts, "cpu", rank, world))
        for index, block in enumerate(models[-1].blocks):
            idle = stores[-1].put(index, block)
            assert all(t.numel() == 0 for t in idle)
    for index, block in enumerate(reference.blocks):
        tensors = block_tensors(block)
        packed = torch.zeros(layouts[index].total, dtype=torch.uint8)
        for tensor, view in zip(tensors, layouts[index].views(packed)):
            view.copy_(tensor)
        joined = torch.cat([store.chunk(index) for store in stores])
        assert joined.numel() == padded_size(layouts[index], world)
        assert joined.numel() % (world * ALIGNMENT) == 0
        assert torch.equal(joined[:packed.numel()], packed)
        assert not joined[packed.numel():].any()
        assert all(t.numel() == 0 and t.dtype == r.dtype
                   for t, r in zip(block_tensors(models[0].blocks[index]), tensors))
    assert stores[0].nbytes() == sum(padded_size(x, world) for x in layouts) // world
    with pytest.raises(ValueError, match="fsdp: rank 3 outside a group of 3"):
        ShardStore(layouts, "cpu", 3, 3)
    with pytest.raises(ValueError, match="fsdp: block 1 is not laid out as the store expects"):
        ShardStore(layouts, "cpu", 0, world).put(1, tiny_model(dtype=torch.bfloat16).blocks[1])
