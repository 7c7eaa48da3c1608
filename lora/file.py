"""A LoRA file read against one model: every key placed on a parameter of the model and its
shape checked, from the file's header alone, before any weight is touched.

Reading goes through the checkpoint reader (checkpoints/reader.py), so a missing, truncated or
corrupt file gets the same errors as a model file, and a .pth is opened only with
weights_only=True. The tensors themselves are read when they are used (LoraFile.tensor).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ..checkpoints.reader import CheckpointError, TensorSource, open_checkpoint
from .formats import LoraKey, refusal, split_key
from .keymap import ModelNames

UNMATCHED_SHOWN = 5


class LoraError(CheckpointError):
    """A LoRA file that cannot be applied; the message names the file and the key."""


@dataclass(frozen=True)
class LowRank:
    """delta = scale * up @ down (flattened to the weight's shape)."""
    up: str  # file keys
    down: str
    rank: int
    scale: float  # alpha / rank, or 1 without an alpha


@dataclass(frozen=True)
class Difference:
    """delta = the tensor itself (a weight or bias difference)."""
    key: str


Patch = LowRank | Difference


@dataclass
class LoraFile:
    path: Path
    source: TensorSource
    patches: dict[str, Patch]  # our parameter name -> its patch
    unmatched: list[str] = field(default_factory=list)  # module names that fit nothing
    styles: tuple[str, ...] = ()  # naming styles found: kohya, generic, diffusers

    def tensor(self, key: str) -> torch.Tensor:
        return self.source.read(key)

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "LoraFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> str:
        pairs = sum(isinstance(p, LowRank) for p in self.patches.values())
        ranks = sorted({p.rank for p in self.patches.values() if isinstance(p, LowRank)})
        parts = [f"{pairs} low-rank pairs" + (f" (rank {_ranks(ranks)})" if ranks else "")]
        if len(self.patches) > pairs:
            parts.append(f"{len(self.patches) - pairs} full differences")
        return f"{self.path.name}: {', '.join(parts)}; {'/'.join(self.styles)} names"


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}..{ranks[-1]}"


def check_lora_keys(path: str | Path) -> None:
    """Raise LoraError (CheckpointError for an unreadable file) unless every key of the file
    is one of a LoRA format we read; reads the header only."""
    with open_checkpoint(path) as source:
        keys = source.keys()
        if not keys:
            raise LoraError(f"{source.path}: the file holds no tensors")
        for key in keys:
            if split_key(key) is None:
                raise LoraError(refusal(source.path, key))


def open_lora(path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> LoraFile:
    """Read a LoRA file's header and place every key on the model whose parameter shapes are
    `shapes` (our names). Raises LoraError (or CheckpointError for an unreadable file); warns
    with the first few module names that fit nothing in the model."""
    source = open_checkpoint(path)
    try:
        lora = _parse(source, shapes)
    except BaseException:
        source.close()
        raise
    if lora.unmatched:
        shown = ", ".join(lora.unmatched[:UNMATCHED_SHOWN])
        more = len(lora.unmatched) - UNMATCHED_SHOWN
        warnings.warn(f"{source.path}: {len(lora.unmatched)} LoRA modules fit nothing in this "
                      f"model and are left out: {shown}" + (f" and {more} more" if more > 0
                                                            else ""), RuntimeWarning)
    return lora


def _parse(source: TensorSource, shapes: Mapping[str, tuple[int, ...]]) -> LoraFile:
    path = source.path
    keys = source.keys()
    if not keys:
        raise LoraError(f"{path}: the file holds no tensors")
    modules: dict[str, dict[str, LoraKey]] = {}
    for key in keys:
        found = split_key(key)
        if found is None:
            raise LoraError(refusal(path, key))
        modules.setdefault(found.module, {})[found.role] = found
    names = ModelNames(shapes)
    lora = LoraFile(Path(path), source, {})
    styles = []
    for module, roles in modules.items():
        resolved = names.module(module)
        if resolved is None:
            lora.unmatched.append(module)
            continue
        ours, style = resolved
        if style not in styles:
            styles.append(style)
        for target, patch in _module_patches(source, names, module, ours, roles):
            if target is None:
                lora.unmatched.append(module)
                continue
            _check_shape(source, shapes, target, patch)
            if target in lora.patches:
                raise LoraError(f"{path}: two patches for {target} (module {module!r}); the "
                                f"file names it twice under different spellings")
            lora.patches[target] = patch
    if not lora.patches:
        shown = ", ".join(lora.unmatched[:UNMATCHED_SHOWN])
        raise LoraError(f"{path}: no key of this LoRA fits the model (is it a LoRA for another "
                        f"model?); its modules: {shown}")
    lora.styles = tuple(styles)
    return lora


def _module_patches(source, names: ModelNames, module: str, ours: str,
                    roles: dict[str, LoraKey]):
    """(target parameter or None, patch) for each patch the keys of one module make."""
    path = source.path
    pair = {"up", "down"} & set(roles)
    if pair and pair != {"up", "down"}:
        have = roles["up" if "up" in roles else "down"].key
        partner = "lora_down / lora_A" if "up" in roles else "lora_up / lora_B"
        raise LoraError(f"{path}: {have!r} has no partner (the {partner} of the same module)")
    if "alpha" in roles and not pair:
        raise LoraError(f"{path}: {roles['alpha'].key!r} is an alpha without its lora_down / "
                        f"lora_up pair")
    if pair and "diff" in roles:
        raise LoraError(f"{path}: module {module!r} has both a low-rank pair and a full "
                        f"difference ({roles['diff'].key!r}); which one applies is ambiguous")
    if pair:
        up, down = roles["up"].key, roles["down"].key
        rank = source.shape(down)[0] if source.shape(down) else 0
        alpha = _alpha(source, roles["alpha"].key) if "alpha" in roles else None
        scale = 1.0 if alpha is None or rank == 0 else alpha / rank
        yield names.target(ours, "up"), LowRank(up, down, rank, scale)
    if "diff" in roles:
        yield names.target(ours, "diff"), Difference(roles["diff"].key)
    if "diff_b" in roles:
        yield names.target(ours, "diff_b"), Difference(roles["diff_b"].key)


def _alpha(source: TensorSource, key: str) -> float:
    if math.prod(source.shape(key)) != 1:
        raise LoraError(f"{source.path}: {key!r} has shape {list(source.shape(key))}; an alpha "
                        f"is one number")
    _check_float(source, key)
    value = float(source.read(key).reshape(()).item())
    if not math.isfinite(value):
        raise LoraError(f"{source.path}: {key!r} is {value}, not a finite number")
    return value


def _check_float(source: TensorSource, key: str) -> None:
    dtype = source.dtype(key)
    if not dtype.is_floating_point:
        raise LoraError(f"{source.path}: {key!r} is {str(dtype).removeprefix('torch.')}; LoRA "
                        f"tensors are floating point")


def _check_shape(source, shapes, target: str, patch: Patch) -> None:
    """The patch's tensors fit the parameter: a mismatch names the file, key and both shapes."""
    expected = tuple(shapes[target])
    path = source.path
    if isinstance(patch, Difference):
        _check_float(source, patch.key)
        have = tuple(source.shape(patch.key))
        if have != expected:
            raise LoraError(f"{path}: {patch.key!r} has shape {list(have)} but the model's "
                            f"{target} is {list(expected)} (a LoRA for another model size?)")
        return
    _check_float(source, patch.up)
    _check_float(source, patch.down)
    up, down = tuple(source.shape(patch.up)), tuple(source.shape(patch.down))
    rows, per_row = expected[0], math.prod(expected[1:])
    if len(up) < 2 or up[0] != rows:
        raise LoraError(f"{path}: {patch.up!r} has shape {list(up)} but the model's {target} "
                        f"is {list(expected)}: expected [{rows}, rank] (a LoRA for another model "
                        f"size?)")
    if len(down) < 2 or math.prod(down[1:]) != per_row:
        raise LoraError(f"{path}: {patch.down!r} has shape {list(down)} but the model's {target} "
                        f"is {list(expected)}: expected [rank, {per_row}] (a LoRA for another "
                        f"model size?)")
    if math.prod(up[1:]) != down[0]:
        raise LoraError(f"{path}: {patch.up!r} {list(up)} and {patch.down!r} {list(down)} "
                        f"disagree on the rank")
