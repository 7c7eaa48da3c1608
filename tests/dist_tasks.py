"""Tasks for the worker-group tests (run inside the gloo worker processes)."""

import os
import time

import torch
import torch.distributed as dist


def rank_sum(state, payload):
    value = torch.tensor([float(state.rank + 1)])
    dist.all_reduce(value)
    return {"sum": value.item(), "pid": os.getpid(), "payload": payload,
            "cached": state.cache.setdefault("calls", 0)}


def count_calls(state, payload):
    state.cache["calls"] = state.cache.get("calls", 0) + 1
    return state.cache["calls"]


def fail_on(state, rank):
    if state.rank == rank:
        raise ValueError("this rank was told to fail")
    dist.barrier()  # the others wait in a collective, as in a real run


def exit_on(state, rank):
    if state.rank == rank:
        os._exit(3)
    dist.barrier()


def steps(state, payload):
    """payload: (steps, seconds per step); every rank checks the stop flag before each step."""
    count, pause = payload
    done = 0
    for index in range(count):
        state.check_stop()
        time.sleep(pause)
        done += 1
        state.progress({"step": index + 1})
    return done


def ignore_stop(state, seconds):
    time.sleep(seconds)
    return "finished"


def float32_settings(state, payload):
    """What this rank computes float32 products with during a task."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


def sharded_blocks(state, payload):
    """The tiny DiT whole and with its blocks sharded over the group (the same seed on every
    rank): the outputs of several forwards, and what a rank holds between them."""
    from test_block_swap import inputs, tiny_model
    from wan_enhanced.distributed.sharded_blocks import ShardedBlocks, ShardStore
    from wan_enhanced.offload.packed_blocks import BlockLayout, block_tensors

    device = state.device
    model = tiny_model(dtype=payload["dtype"]).to(device)
    x, t, context = (v.to(device) for v in inputs(model))
    compiled = payload.get("compiled", False)
    expected = model(x, t, context, compiled=compiled)
    layouts = [BlockLayout.of(block_tensors(b)) for b in model.blocks]
    store = ShardStore(layouts, device, state.rank, state.world)
    idle = [store.put(i, b) for i, b in enumerate(model.blocks)]
    with ShardedBlocks(list(model.blocks), store.sealed(), idle) as ring:
        outs = [model(x, t, context, compiled=compiled, blocks=ring.blocks())
                for _ in range(payload.get("forwards", 3))]
        held, slots, peers = ring.shard_bytes(), ring.device_bytes(), store.peer_copies
    return {"equal": [torch.equal(o, expected) for o in outs],
            "after_numel": sum(t.numel() for b in model.blocks for t in block_tensors(b)),
            "held": held, "slots": slots, "whole": sum(x.total for x in layouts),
            "max_block": max(x.total for x in layouts), "peer_copies": peers,
            "released": store.nbytes() == 0 and not store.peer_copies}


def fsdp_vote(state, against):
    """Whether every rank agrees to peer copies when rank `against` cannot have them."""
    from wan_enhanced.distributed.sharded_blocks import _everyone

    return _everyone(state.rank != against, state.device, None)


def loads_in_turns(state, seconds):
    """distributed.models._in_turns with a load that takes `seconds`: each rank's (start, end),
    gathered to every rank."""
    from wan_enhanced.distributed.models import _in_turns

    def load():
        began = time.time()
        time.sleep(seconds)
        return (state.rank, began, time.time())

    mine = _in_turns(load)
    everyone = [None] * state.world
    dist.all_gather_object(everyone, mine)
    return everyone
