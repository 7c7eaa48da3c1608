"""What one rank of a several-GPU run needs, estimated before anything loads, and the refusal
of a model, video and GPU count that cannot fit even sharded.

Per rank: the weights it holds (every expert whole, or with fsdp the blocks' shards plus the
rest of the model and two whole blocks being gathered), and the sampling memory of
pipeline/memory_guard.py for its share of the tokens (the latent copies stay whole on every
rank; the activations are for its rows, twice the attention's q, k and v for the exchange).
Checked against the smallest GPU's total memory: a refusal is certain, not a guess about what is
free at the moment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pipeline import memory_guard as guard
from ..pipeline.errors import InputError
from ..pipeline.placement import tensor_bytes


@dataclass(frozen=True)
class RankEstimate:
    weights: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.activations


def rank_weights(handles, world: int, fsdp: bool) -> int:
    total = 0
    for handle in handles:
        blocks = list(handle.model.blocks)
        block_bytes = [tensor_bytes(b) for b in blocks]
        whole = tensor_bytes(handle.model)
        if not fsdp:
            total += whole
            continue
        rest = whole - sum(block_bytes)
        total += rest + -(-sum(block_bytes) // world) + 2 * max(block_bytes, default=0)
    return total


def rank_activations(handle, latent_shape, sequence_ranks: int) -> int:
    """The latent copies (whole on every rank), and one forward's residual stream and
    self-attention keys and values for this rank's rows, with Ulysses' q, k and v sent and
    received."""
    batch, _, frames, height, width = latent_shape
    config = handle.config
    _, patch_h, patch_w = config.patch_size
    rows = -(-frames * (height // patch_h) * (width // patch_w) // sequence_ranks)
    itemsize = getattr(handle.model, "compute_dtype", torch.bfloat16).itemsize
    size = guard.size_of_latent(latent_shape, handle.vae_kind)
    latents = guard.SAMPLING_LATENT_COPIES * guard.latent_bytes(size, handle.vae_kind)
    stream = batch * rows * config.dim * (4 + 2 * itemsize)
    exchange = 2 * 3 * batch * rows * config.dim * itemsize
    return latents + stream + exchange


def estimate(handles, latent_shape, world: int, fsdp: bool, cfg_parallel: bool) -> RankEstimate:
    sequence_ranks = world // 2 if cfg_parallel and world % 2 == 0 else world
    return RankEstimate(rank_weights(handles, world, fsdp),
                        rank_activations(handles[0], latent_shape, sequence_ranks))


def check_fits_group(handles, latent_shape, world: int, fsdp: bool, cfg_parallel: bool,
                     device_type: str) -> RankEstimate:
    """Refuse (InputError naming `gpus`) a run whose per-rank estimate exceeds the smallest
    GPU's memory (on the CPU: all ranks together against the machine's memory)."""
    need = estimate(handles, latent_shape, world, fsdp, cfg_parallel)
    if device_type == "cuda":
        have = min(torch.cuda.get_device_properties(i).total_memory for i in range(world))
        what, amount = "per GPU", need.total
    else:
        have, _ = guard.machine_memory()
        what, amount = f"for {world} CPU processes together", need.total * world
    if amount <= have:
        return need
    size = guard.size_of_latent(latent_shape, handles[0].vae_kind)
    names = " and ".join(h.name for h in handles)
    advice = _advice(handles, latent_shape, world, fsdp, cfg_parallel, have, device_type)
    ranks = f"{world} GPUs" if device_type == "cuda" else f"{world} CPU processes"
    raise InputError(
        f"gpus: sampling {names} at {size} over {ranks}{' with fsdp' if fsdp else ''} needs "
        f"about {guard.gib(amount)} {what} (weights "
        f"{guard.gib(need.weights)}, latents and one forward's activations "
        f"{guard.gib(need.activations)} per rank); "
        f"{'the smallest GPU has' if device_type == 'cuda' else 'this machine has'} "
        f"{guard.gib(have)} in all; {advice}")


def _advice(handles, latent_shape, world, fsdp, cfg_parallel, have, device_type) -> str:
    if device_type != "cuda":
        return "use fewer processes or a smaller video"
    if not fsdp and estimate(handles, latent_shape, world, True, cfg_parallel).total <= have:
        return "with fsdp on it fits"
    return "use more GPUs or a smaller video"
