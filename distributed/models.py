"""The DiT on each rank, built from a ModelSpec and kept between requests.

A rank keeps the models of its latest request (the two A14B experts, or one model) in its cache;
a request for other models drops those first, so a rank never holds more than one request's
weights. Each model sits whole on the rank's device, or sharded with FSDP2 (fsdp.py).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ..checkpoints.tiny import randomize
from ..wan.configs import DiTConfig
from ..wan.dit import WanDiT, keeps_float32
from .contracts import ModelSpec
from .fsdp import shard_model, world_mesh

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rank_models(state, specs: list[ModelSpec]) -> list[WanDiT]:
    """The models of `specs` on this rank (loaded now, or kept from the previous request)."""
    cache: dict = state.cache.setdefault("models", {})
    wanted = {spec.key() for spec in specs}
    for key in [k for k in cache if k not in wanted]:
        del cache[key]
    gc.collect()
    if state.device.type == "cuda":
        torch.cuda.empty_cache()
    models = []
    for spec in specs:
        key = spec.key()
        model = cache.get(key) if key is not None else None
        if model is None:
            model = build(spec, state.device)
            if key is not None:
                cache[key] = model
        models.append(model)
    return models


def build(spec: ModelSpec, device: torch.device) -> WanDiT:
    if spec.seed is not None:
        model = random_model(DiTConfig.from_dict(spec.config), spec.seed, device,
                             DTYPES[spec.dtype], spec.fsdp)
        return model.eval()
    model = _cpu_model(spec)
    if spec.fsdp:
        return shard_model(model, device).eval()
    return model.to(device).eval()


def _cpu_model(spec: ModelSpec) -> WanDiT:
    if spec.golden is not None:
        from ..conformance.golden_file import read_golden
        from ..conformance.run_dit import build as build_golden
        return build_golden(read_golden(spec.golden))
    if spec.checkpoint is not None:
        from ..pipeline.loading import load_model
        return load_model(Path(spec.checkpoint), spec.weight_dtype, spec.attention).model
    if spec.state is not None:
        dtype = DTYPES[spec.dtype]
        model = WanDiT(DiTConfig.from_dict(spec.config), compute_dtype=dtype)
        model.load_state_dict(spec.state, strict=True)
        return model
    raise ValueError("a model spec needs a checkpoint, a golden file, a state dict or a seed")


def random_model(config: DiTConfig, seed: int, device: torch.device, dtype: torch.dtype,
                 fsdp: bool = False) -> WanDiT:
    """Seeded random weights drawn on `device` by checkpoints/tiny.randomize (the same on every
    rank and on one GPU: each block and each other part from a seed of its own), stored as the
    loader stores them: norms and modulation in float32, the rest in `dtype`. With fsdp each
    block is sharded as soon as it is drawn, so a rank never holds more than one whole block."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = WanDiT(config, compute_dtype=dtype)
    mesh = world_mesh(device) if fsdp else None
    for index, block in enumerate(model.blocks):
        _fill(block, f"blocks.{index}.", seed + 1 + index, device, dtype)
        if mesh is not None:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
    others = [(name, child) for name, child in model.named_children() if name != "blocks"]
    for offset, (name, child) in enumerate(others):
        _fill(child, f"{name}.", seed + 10_000 + offset, device, dtype)
    if mesh is not None:
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _fill(module: torch.nn.Module, prefix: str, seed: int, device, dtype) -> None:
    state = randomize(module, seed, device, dtype, keep_on_device=True)
    module.load_state_dict({k: v.float() if keeps_float32(prefix + k) else v
                            for k, v in state.items()}, strict=True, assign=True)
    module.requires_grad_(False)
