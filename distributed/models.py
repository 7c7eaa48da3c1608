"""The DiT on each rank, built from a ModelSpec and kept between requests.

A rank keeps the models of its latest request (the two A14B experts, or one model) in its cache;
a request for other models drops those first, so a rank never holds more than one request's
weights. Each model sits whole on the rank's device, or with its blocks sharded over the group
(fsdp: sharded_blocks.py).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..checkpoints.tiny import randomize
from ..offload.packed_blocks import BlockLayout, block_tensors
from ..wan.configs import DiTConfig
from ..wan.dit import WanDiT, keeps_float32
from .contracts import ModelSpec
from .sharded_blocks import ShardedBlocks, ShardStore, pack_chunk, to_placeholders

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankModel:
    """A model on this rank and, with fsdp, the ring that gathers its sharded blocks."""
    model: WanDiT
    shards: ShardedBlocks | None = None

    def blocks(self) -> Iterator[torch.nn.Module] | None:
        """The block sequence for one forward (None: the model's own, resident blocks)."""
        return None if self.shards is None else self.shards.blocks()

    def weight_bytes(self) -> int:
        """The bytes of weights this rank holds: the model's resident tensors and, with fsdp,
        its chunks of the blocks (not the ring's slots, which are working memory)."""
        total = sum(t.numel() * t.element_size()
                    for t in [*self.model.parameters(), *self.model.buffers()])
        return total + (0 if self.shards is None else self.shards.shard_bytes())

    def fsdp_fill(self) -> str | None:
        """How a block's chunks come together ("peer copies", "all-gathers"); None unsharded."""
        if self.shards is None:
            return None
        return "peer copies" if self.shards.store.peer_copies else "all-gathers"

    def outside_allocator_bytes(self) -> int:
        """Device memory this model holds outside the torch allocator: the fsdp store, when it
        is in symmetric memory."""
        if self.shards is None or not self.shards.store.peer_copies:
            return 0
        return self.shards.store.nbytes()

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()


def rank_models(state, specs: list[ModelSpec]) -> list[RankModel]:
    """The models of `specs` on this rank (loaded now, or kept from the previous request)."""
    cache: dict = state.cache.setdefault("models", {})
    wanted = {spec.key() for spec in specs}
    for key in [k for k in cache if k not in wanted]:
        cache.pop(key).close()
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


def build(spec: ModelSpec, device: torch.device) -> RankModel:
    if spec.seed is not None:
        return random_model(DiTConfig.from_dict(spec.config), spec.seed, device,
                            DTYPES[spec.dtype], spec.fsdp)
    load = _in_turns if spec.load_in_turns else (lambda loader: loader())
    if not spec.fsdp:
        return RankModel(load(lambda: _cpu_model(spec).eval().requires_grad_(False).to(device)))
    # this rank's chunks of the blocks wait in host memory (1/world of them) until the store,
    # which every rank creates together, exists
    model, layouts, chunks, idle = load(lambda: _chunks_on_host(spec, device))
    store = _store(layouts, device)
    for index, chunk in enumerate(chunks):
        store.keep(index, chunk)
    del chunks
    _place_rest(model, device)
    return RankModel(model, ShardedBlocks(list(model.blocks), store.sealed(), idle))


def _in_turns(load):
    """load() on one rank after another (a barrier between turns): the host holds one rank's
    freshly loaded copy of the model at a time, not one per rank."""
    import torch.distributed as dist

    result = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            result = load()
            gc.collect()
        dist.barrier()
    return result


def _chunks_on_host(spec: ModelSpec, device: torch.device):
    """The model loaded on the CPU, its blocks' layouts, this rank's chunk of each (host
    memory) and the placeholders its block tensors became."""
    import torch.distributed as dist

    model = _cpu_model(spec).eval().requires_grad_(False)
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts = [BlockLayout.of(block_tensors(b)) for b in model.blocks]
    chunks, idle = [], []
    for index, (block, layout) in enumerate(zip(model.blocks, layouts)):
        chunks.append(pack_chunk(block, index, layout, rank, world))
        idle.append(to_placeholders(block, device))
    return model, layouts, chunks, idle


def _store(layouts: list[BlockLayout], device: torch.device) -> ShardStore:
    import torch.distributed as dist

    return ShardStore(layouts, device, dist.get_rank(), dist.get_world_size())


def _place_rest(model: WanDiT, device: torch.device) -> None:
    """Everything but the (sharded) blocks on `device`."""
    for name, child in model.named_children():
        if name != "blocks":
            child.to(device)
    for name, tensor in [*model.named_parameters(recurse=False),
                         *model.named_buffers(recurse=False)]:
        tensor.data = tensor.data.to(device)


def _cpu_model(spec: ModelSpec) -> WanDiT:
    if spec.golden is not None:
        from ..conformance.golden_file import read_golden
        from ..conformance.run_dit import build as build_golden
        return build_golden(read_golden(spec.golden))
    if spec.checkpoint is not None:
        from ..pipeline.loading import load_model
        handle = load_model(Path(spec.checkpoint), spec.weight_dtype, spec.attention)
        if spec.loras:
            from ..lora.apply import LoraChoice, bring_to
            bring_to(handle.model, Path(handle.info.path), handle.quantization,
                     tuple(LoraChoice(Path(path), strength, mode)
                           for path, strength, mode, _ in spec.loras))
        return handle.model
    if spec.loras:
        raise ValueError("a model spec's loras apply to a checkpoint only")
    if spec.state is not None:
        dtype = DTYPES[spec.dtype]
        model = WanDiT(DiTConfig.from_dict(spec.config), compute_dtype=dtype)
        model.load_state_dict(spec.state, strict=True)
        return model
    raise ValueError("a model spec needs a checkpoint, a golden file, a state dict or a seed")


def random_model(config: DiTConfig, seed: int, device: torch.device, dtype: torch.dtype,
                 fsdp: bool = False) -> RankModel:
    """Seeded random weights drawn on `device` by checkpoints/tiny.randomize (the same on every
    rank and on one GPU: each block and each other part from a seed of its own), stored as the
    loader stores them: norms and modulation in float32, the rest in `dtype`. With fsdp each
    block is sharded as soon as it is drawn, so a rank never holds more than one whole block."""
    with torch.device("meta"):
        model = WanDiT(config, compute_dtype=dtype)
    store = None
    if fsdp:
        store = _store([_stored_layout(block, f"blocks.{index}.", dtype)
                        for index, block in enumerate(model.blocks)], device)
    idle = []
    for index, block in enumerate(model.blocks):
        _fill(block, f"blocks.{index}.", seed + 1 + index, device, dtype)
        if store is not None:
            idle.append(store.put(index, block))
    others = [(name, child) for name, child in model.named_children() if name != "blocks"]
    for offset, (name, child) in enumerate(others):
        _fill(child, f"{name}.", seed + 10_000 + offset, device, dtype)
    model.eval()
    if store is None:
        return RankModel(model)
    return RankModel(model, ShardedBlocks(list(model.blocks), store.sealed(), idle))


def _stored_layout(block: torch.nn.Module, prefix: str, dtype: torch.dtype) -> BlockLayout:
    """The packed layout `block` (on the meta device) will have once _fill has stored it."""
    names = {id(t): n for n, t in [*block.named_parameters(), *block.named_buffers()]}
    return BlockLayout.of([
        torch.empty(t.shape, device="meta",
                    dtype=torch.float32 if keeps_float32(prefix + names[id(t)]) else dtype)
        for t in block_tensors(block)])


def _fill(module: torch.nn.Module, prefix: str, seed: int, device, dtype) -> None:
    state = randomize(module, seed, device, dtype, keep_on_device=True)
    module.load_state_dict({k: v.float() if keeps_float32(prefix + k) else v
                            for k, v in state.items()}, strict=True, assign=True)
    module.requires_grad_(False)
