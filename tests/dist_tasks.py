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
