"""Opt-in FSDP2 sharding of a DiT over the worker group (torch.distributed.fsdp.fully_shard).

Each transformer block is its own FSDP unit: between forwards a rank holds 1/world of every
block's parameters, and a block's whole parameters exist only while it computes (gathered just
before, freed right after). The embeddings, the head and the norms outside the blocks form the
root unit. Mixed dtypes in a unit (the blocks' bf16 matrices beside their float32 norms and
modulation) are fine for inference: FSDP2 demands one dtype only of parameters that take
gradients, so the parameters are frozen first.

The blocks must run through their module call (FSDP's hooks gather the parameters there):
the DiT's compiled path calls WanBlock.forward directly, so compile is refused with fsdp.
"""

from __future__ import annotations

import torch


def fsdp_problem(compile: bool) -> str | None:
    if compile:
        return ("fsdp: the compiled blocks bypass FSDP's parameter gathering; turn compile off "
                "in the model loader to shard")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"fsdp: this PyTorch ({torch.__version__}) has no FSDP2 (torch >= 2.6 has it)"
    return None


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shard `model` (its parameters on `device` or the CPU) block by block over every rank."""
    from torch.distributed.fsdp import fully_shard

    mesh = world_mesh(device)
    model.requires_grad_(False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def world_mesh(device: torch.device):
    """A one-dimensional device mesh over every rank of the group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def sharded_bytes(model: torch.nn.Module) -> int:
    """The bytes of parameters and buffers this rank holds (its shards, for FSDP parameters)."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total
