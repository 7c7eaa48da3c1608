"""The DiT on each rank, built from a ModelSpec and kept between requests.

A rank keeps the models of its latest request (the two A14B experts, or one model) in its cache;
a request for other models drops those first, so a rank never holds more than one request's
weights. Each model sits whole on the rank's device, or sharded with FSDP2 (fsdp.py).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import torch

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
    """Seeded random weights drawn on `device` (the same on every rank and on one GPU: each
    tensor from its own generator), stored as the loader stores them: norms and modulation in
    float32, the rest in `dtype`. With fsdp each block is sharded as soon as it is drawn, so a
    rank never holds more than one whole block."""
    with torch.device("meta"):
        model = WanDiT(config, compute_dtype=dtype)
    model.requires_grad_(False)
    mesh = None
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        mesh = world_mesh(device)
    for index, block in enumerate(model.blocks):
        _draw(block, f"blocks.{index}.", seed, device, dtype)
        if mesh is not None:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
    rest = [(n, m) for n, m in model.named_children() if n != "blocks"]
    for name, module in rest:
        _draw(module, f"{name}.", seed, device, dtype)
    if mesh is not None:
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _draw(module: torch.nn.Module, prefix: str, seed: int, device, dtype) -> None:
    module.to_empty(device=device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            key = prefix + name
            gen = torch.Generator(device=device).manual_seed(seed + _stable_hash(key))
            value = torch.randn(param.shape, generator=gen, device=device)
            if name.endswith("modulation"):
                value /= param.shape[-1] ** 0.5
            elif param.dim() == 1:
                value = (1.0 + 0.1 * value) if "norm" in name else 0.02 * value
            else:
                value /= max(1, math.prod(param.shape[1:])) ** 0.5
            param.data = value.to(torch.float32 if keeps_float32(key) else dtype)


def _stable_hash(text: str) -> int:
    """A hash of a parameter's name that is the same in every process (str hashes are not)."""
    value = 0
    for byte in text.encode():
        value = (value * 131 + byte) % (1 << 31)
    return value
