"""Blocks sharded over a group of gloo processes (distributed/sharded_blocks.py, the `fsdp`
setting): each rank keeps 1/world of every packed block, a forward gathers each block into a
ring slot just before it computes, and the output is the whole model's to the bit."""

import shutil

import pytest
import torch

from wan_enhanced.distributed.sharded_blocks import shard_block
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
    assert facts["idle_numel"] == 0 and facts["after_numel"] == 0
    unit = world * ALIGNMENT
    assert facts["whole"] / world <= facts["held"] <= facts["whole"] / world + BLOCKS * ALIGNMENT
    assert facts["slots"] == 2 * (-(-facts["max_block"] // unit) * unit)


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_run_on_the_gathered_weights(gloo_group):
    results = gloo_group(2).run("dist_tasks:sharded_blocks",
                                {"dtype": torch.float32, "compiled": True, "forwards": 2},
                                timeout_s=600)
    facts = results if isinstance(results, dict) else results[0]
    assert facts["equal"] == [True, True]


def test_a_rank_keeps_its_chunk_of_the_packed_block():
    """The chunks of every rank, end to end, are the block's packed bytes (padded with zeros);
    the block's tensors are left as empty placeholders of their dtypes."""
    world = 3
    reference_block = tiny_model(seed=0).blocks[0]
    tensors = block_tensors(reference_block)
    layout = BlockLayout.of(tensors)
    packed = torch.zeros(layout.total, dtype=torch.uint8)
    for tensor, view in zip(tensors, layout.views(packed)):
        view.copy_(tensor)
    # the same weights on every rank (seed 0), as the ranks of a group have them
    blocks = [tiny_model(seed=0).blocks[0] for _ in range(world)]
    shards = [shard_block(b, torch.device("cpu"), r, world) for r, b in enumerate(blocks)]
    joined = torch.cat([s.shard for s in shards])
    assert joined.numel() % (world * ALIGNMENT) == 0 and joined.numel() >= layout.total
    assert torch.equal(joined[:layout.total], packed)
    assert not joined[layout.total:].any()
    assert all(t.numel() == 0 and t.dtype == r.dtype
               for t, r in zip(block_tensors(blocks[0]), tensors))
    with pytest.raises(ValueError, match="fsdp: rank 3 outside a group of 3"):
        shard_block(tiny_model().blocks[0], torch.device("cpu"), 3, 3)
