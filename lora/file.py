"""A LoRA file read against one model: every key placed on a parameter of the model and its
shape checked (lora/build.py), from the file's header alone, before any weight is touched.

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

from ..checkpoints.reader import TensorSource, open_checkpoint
from .build import LoraError, module_patches
from .formats import FILE_SETTINGS, LoraKey, is_file_setting, refusal, split_key, unknown_keys
from .keymap import ModelNames
from .patches import (Butterfly, Decomposed, Difference, Generalized, Hadamard, Kronecker,
                      LowRank, Orthogonal, Patch, Replacement)

UNMATCHED_SHOWN = 5


KINDS = ((LowRank, "low-rank pairs"), (Hadamard, "LoHa"), (Kronecker, "LoKr"),
         (Decomposed, "DoRA"), (Orthogonal, "OFT"), (Butterfly, "BOFT"),
         (Generalized, "GLoRA"), (Difference, "full differences"),
         (Replacement, "weight replacements (the strength does not apply)"))


@dataclass
class LoraFile:
    path: Path
    source: TensorSource
    patches: dict[str, Patch]  # our parameter name -> its patch
    unmatched: list[str] = field(default_factory=list)  # module names that fit nothing
    styles: tuple[str, ...] = ()  # naming styles found: kohya, lycoris, generic, diffusers
    settings: dict[str, float] = field(default_factory=dict)  # file-level settings read

    def tensor(self, key: str) -> torch.Tensor:
        return self.source.read(key)

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "LoraFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> str:
        parts = []
        for kind, name in KINDS:
            found = [p for p in self.patches.values() if isinstance(p, kind)]
            if not found:
                continue
            ranks = sorted({p.rank for p in found if isinstance(p, (LowRank, Hadamard))})
            parts.append(f"{len(found)} {name}" + (f" (rank {_ranks(ranks)})" if ranks else ""))
        settings = "".join(f"; {k}={v:g} ({FILE_SETTINGS[k]})" for k, v in self.settings.items())
        return (f"{self.path.name}: {', '.join(parts)}; {'/'.join(self.styles)} names"
                f"{settings}")


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}..{ranks[-1]}"


def check_lora_keys(path: str | Path) -> None:
    """Raise LoraError (CheckpointError for an unreadable file) unless every key of the file
    is one of a LoRA format we read; reads the header only."""
    with open_checkpoint(path) as source:
        _check_keys(source)


def _check_keys(source: TensorSource) -> list[str]:
    keys = source.keys()
    if not keys:
        raise LoraError(f"{source.path}: the file holds no tensors")
    unknown = unknown_keys(keys)
    if unknown:
        raise LoraError(refusal(source.path, keys, unknown))
    return keys


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
    keys = _check_keys(source)
    lora = LoraFile(Path(path), source, {})
    modules: dict[str, dict[str, LoraKey]] = {}
    for key in keys:
        if is_file_setting(key):
            lora.settings[key] = _setting(source, key)
            continue
        found = split_key(key)
        roles = modules.setdefault(found.module, {})
        if found.role in roles:
            raise LoraError(f"{path}: {roles[found.role].key!r} and {key!r} are the same "
                            f"{found.role} of module {found.module!r}; which one applies is "
                            f"ambiguous")
        roles[found.role] = found
    names = ModelNames(shapes)
    styles = []
    for module, roles in modules.items():
        resolved = names.module(module)
        if resolved is None:
            lora.unmatched.append(module)
            continue
        ours, style = resolved
        if style not in styles:
            styles.append(style)
        for target, patch in module_patches(source, names, shapes, module, ours, roles):
            if target is None:
                lora.unmatched.append(module)
                continue
            if target in lora.patches:
                raise LoraError(f"{path}: two patches for {target} (module {module!r}); the "
                                f"file names it twice under different spellings")
            lora.patches[target] = patch
    if not lora.patches:
        shown = ", ".join(lora.unmatched[:UNMATCHED_SHOWN])
        raise LoraError(f"{path}: no key of this LoRA fits the model (is it a LoRA for another "
                        f"model?); its modules: {shown}")
    if lora.settings.get("dora") and not any(isinstance(p, Decomposed)
                                             for p in lora.patches.values()):
        raise LoraError(f"{path}: the file says dora={lora.settings['dora']:g} but holds no "
                        f"dora_scale key: its DoRA magnitudes are missing")
    lora.styles = tuple(styles)
    return lora


def _setting(source: TensorSource, key: str) -> float:
    if math.prod(source.shape(key)) != 1:
        raise LoraError(f"{source.path}: {key!r} has shape {list(source.shape(key))}; the "
                        f"file-level setting {key} is one number")
    value = float(source.read(key).reshape(()).item())
    if not math.isfinite(value):
        raise LoraError(f"{source.path}: {key!r} is {value}, not a finite number")
    return value
