"""Bringing a model to the LoRAs a handle asks for.

A loaded DiT is one module, shared by every handle made from it: the model loader's and those
of LoRA loaders chained on it, in any number of chains. A handle only records its LoRAs
(LoraChoice: file, strength, mode); `bring_to` makes the module hold exactly those, just before
the module computes, and remembers what it holds:

- merge: the LoRA's changes are added into the weights in float32 and then converted or
  quantized as the loader does (checkpoints/reload.py reads the changed weights again from the
  model's file, so taking a LoRA out or changing its strength is exact: nothing is subtracted);
- unmerged: the block matrices' low-rank pairs and differences stay apart in wrappers
  (lora/layers.py); a strength change only changes their scales, another LoRA only swaps
  factors. LoHa and LoKr patches are formed into their full difference once (per version of the
  file) and kept apart as such. The changes outside the blocks' matrices (norms, modulation,
  embeddings, head) are small and merged as above. So is every change of a layer a DoRA of the
  chain rescales (DoRA is not a term added to the weight: it rescales the weight the LoRAs
  before it in the chain have made, so that layer's changes are merged in the chain's order).

So a LoRA is never applied twice, a second chain on the same base needs no second copy of the
model, and whatever another handle did to the module is undone when this one computes. All
LoRA files are read and checked before any weight changes; if reading the model's file fails
half way, the weights it was rewriting are marked and rewritten next time.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoints.reload import reload_tensors
from ..wan.dit import is_block_linear
from .file import LoraFile, open_lora
from .keymap import dit_shapes
from .layers import official_tensors, unwrap_all, wrap, wrappers
from .merge import Merge
from .build import LoraError
from .patches import NOT_ADDITIVE, Difference, LowRank, Patch, file_keys, unscaled_delta

MODES = ("merge", "unmerged")


def file_stamp(path: Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


@dataclass
class _Factors:
    """An unmerged LoRA's tensors for the wrappers, read once (per version of the file)."""
    stamp: tuple[int, int] | None = None
    dtype: torch.dtype | None = None
    terms: dict[str, list[tuple[str, tuple[torch.Tensor, ...], float]]] = field(
        default_factory=dict)  # module -> [(kind, tensors, scale at strength 1)]


@dataclass(frozen=True)
class LoraChoice:
    """One LoRA a handle asks for."""
    path: Path
    strength: float
    mode: str = "merge"
    factors: _Factors = field(default_factory=_Factors, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.path.name


# what each module holds: weakly keyed, so nothing keeps a dropped model alive
_HELD: "weakref.WeakKeyDictionary[torch.nn.Module, _Held]" = weakref.WeakKeyDictionary()
_DIRTY = ("rewritten only in part",)


@dataclass(frozen=True)
class _Held:
    merged: dict  # our key -> ((path, stamp, strength), ...) of the LoRAs merged into it
    unmerged: tuple  # ((path, stamp, strength), ...) in the wrappers, in order
    choices: tuple = ()  # ((path, stamp, strength, mode), ...): what was asked for
    rescaled: frozenset = frozenset()  # block layers a DoRA rescales: merged in either mode


def held(model: torch.nn.Module) -> _Held:
    return _HELD.get(model, _Held({}, ()))


def _signature(choices, stamps) -> tuple:
    return tuple((str(c.path), s, c.strength, c.mode) for c, s in zip(choices, stamps))


def bring_to(model: torch.nn.Module, base_path: Path, quantization: str | None,
             choices: tuple[LoraChoice, ...], work_device: torch.device | None = None) -> None:
    """Make `model` (loaded from `base_path`, its block matrices quantized as `quantization`
    or not) hold exactly the LoRAs `choices`. Its tensors must be where they wait between runs
    (not placed on a device for a run). Raises LoraError / CheckpointError for a file that
    cannot be read or does not fit, before any weight changes. `work_device`: where the
    rewritten block matrices are merged and quantized (checkpoints.loader.read_quantized)."""
    now = held(model)
    stamps = [file_stamp(c.path) if c.path.is_file() else None for c in choices]
    if now.choices == _signature(choices, stamps) and _DIRTY not in now.merged.values():
        return
    files: list[LoraFile] = []
    try:
        for choice in choices:
            files.append(open_lora(choice.path, dit_shapes(model.config)))
        rescaled = _rescaled_layers(files)
        wanted = _wanted(choices, files, stamps, rescaled)
        unmerged = [(c, f, s) for c, f, s in zip(choices, files, stamps) if c.mode == "unmerged"]
        shapes = dit_shapes(model.config)
        for choice, lora, stamp in unmerged:
            _read_factors(choice, lora, stamp, model.compute_dtype, shapes)  # may fail: nothing
            # has changed yet
        rewrite = sorted(k for k in set(now.merged) | set(wanted.merged)
                         if now.merged.get(k) != wanted.merged.get(k))
        if rewrite:
            _rewrite(model, base_path, quantization, choices, files, rewrite, now, rescaled,
                     work_device)
        if ([sig[:2] for sig in now.unmerged] == [sig[:2] for sig in wanted.unmerged]
                and now.rescaled == rescaled):
            _rescale(model, [c for c, _, _ in unmerged], rescaled)
        else:
            _install(model, [c for c, _, _ in unmerged], rescaled)
        _HELD[model] = wanted
    finally:
        for lora in files:
            lora.close()


def _layer(key: str) -> str:
    return key.rsplit(".", 1)[0]


def _rescaled_layers(files: list[LoraFile]) -> frozenset:
    """The block layers some LoRA of the chain changes by DoRA or OFT (a function of the
    weight, not a term added to it)."""
    return frozenset(_layer(k) for lora in files for k, p in lora.patches.items()
                     if isinstance(p, NOT_ADDITIVE) and is_block_linear(k))


def _kept_apart(key: str, patch: Patch) -> bool:
    """Whether an unmerged LoRA can keep its patch of `key` apart from the weights: a term on
    a block matrix (not DoRA's rescaling or OFT's rotation)."""
    return is_block_linear(key) and not isinstance(patch, NOT_ADDITIVE)


def _contributes(choice: LoraChoice, key: str, patch: Patch, rescaled: frozenset) -> bool:
    """Whether `choice` merges its patch of `key`: all of a merged LoRA's; of an unmerged one,
    those it cannot keep apart and those on a layer a DoRA of the chain rescales."""
    return (choice.mode == "merge" or not _kept_apart(key, patch)
            or _layer(key) in rescaled)


def _wanted(choices, files, stamps, rescaled: frozenset) -> _Held:
    merged: dict[str, tuple] = {}
    for choice, lora, stamp in zip(choices, files, stamps):
        for key, patch in lora.patches.items():
            if _contributes(choice, key, patch, rescaled):
                merged[key] = merged.get(key, ()) + ((str(choice.path), stamp, choice.strength),)
    unmerged = tuple((str(c.path), s, c.strength) for c, s in zip(choices, stamps)
                     if c.mode == "unmerged")
    return _Held(merged, unmerged, _signature(choices, stamps), rescaled)


def _rewrite(model, base_path, quantization, choices, files, keys, now: _Held,
             rescaled: frozenset, work_device: torch.device | None = None) -> None:
    """Read `keys` again from the model's file with the merged LoRAs added."""
    merge = Merge({})
    for choice, lora in zip(choices, files):
        part = Merge.of([(lora, choice.strength)],
                        lambda k, c=choice, f=lora: _contributes(c, k, f.patches[k], rescaled))
        for key, contributions in part.contributions.items():
            merge.contributions.setdefault(key, []).extend(contributions)
    wrapped = bool(wrappers(model))
    # until the rewrite completes, these weights are neither the old nor the new ones
    _HELD[model] = _Held({**now.merged, **{k: _DIRTY for k in keys}},
                         now.unmerged if wrapped else (), ("rewriting",), now.rescaled)
    reload_tensors(base_path, official_tensors(model), model.config, keys, quantization, merge,
                   work_device)


# factors already read, by (file, stamp, dtype): another strength of the same LoRA (a new
# choice) takes them instead of reading the file again
_READ: "weakref.WeakValueDictionary[tuple, _Factors]" = weakref.WeakValueDictionary()


def _read_factors(choice: LoraChoice, lora: LoraFile, stamp, dtype: torch.dtype,
                  shapes: dict[str, tuple[int, ...]]) -> None:
    cache = choice.factors
    if cache.stamp == stamp and cache.dtype == dtype:
        return
    known = _READ.get((str(choice.path), stamp, dtype))
    if known is not None:
        cache.terms, cache.stamp, cache.dtype = known.terms, stamp, dtype
        return
    terms: dict[str, list] = {}
    for key, patch in lora.patches.items():
        if not _kept_apart(key, patch):
            continue
        module, leaf = key.rsplit(".", 1)
        if isinstance(patch, LowRank):
            down = lora.tensor(patch.down).to(dtype, copy=True).flatten(1).contiguous()
            up = lora.tensor(patch.up).to(dtype, copy=True).flatten(1).contiguous()
            terms.setdefault(module, []).append(("low_rank", (down, up), patch.scale))
        elif isinstance(patch, Difference):
            kind = "bias_diff" if leaf == "bias" else "weight_diff"
            tensor = lora.tensor(patch.key).to(dtype, copy=True).contiguous()
            terms.setdefault(module, []).append((kind, (tensor,), patch.scale))
        else:  # LoHa, LoKr: their full difference, formed once in float32
            delta = unscaled_delta(patch, lora.tensor, shapes[key]).to(dtype).contiguous()
            terms.setdefault(module, []).append(("weight_diff", (delta,), patch.scale))
        _, tensors, scale = terms[module][-1]
        if not all(bool(torch.isfinite(t).all()) for t in tensors) or \
                not math.isfinite(scale * choice.strength):
            raise LoraError(f"{lora.path}: {', '.join(map(repr, file_keys(patch)))} hold NaN or "
                            f"infinite values in {dtype} at strength {choice.strength:g} (stored "
                            f"so, or too large for the compute dtype); refused")
    cache.terms, cache.stamp, cache.dtype = terms, stamp, dtype
    _READ[(str(choice.path), stamp, dtype)] = cache


def _install(model: torch.nn.Module, choices: list[LoraChoice], rescaled: frozenset) -> None:
    unwrap_all(model)
    device = next(model.blocks[0].parameters()).device if len(model.blocks) else None
    for choice in choices:
        for module, terms in _apart(choice, rescaled):
            wrapper = wrap(model, module)
            for kind, tensors, scale in terms:
                if device is not None and tensors[0].device != device:
                    tensors = tuple(t.to(device) for t in tensors)
                wrapper.add(kind, tensors, scale * choice.strength)


def _apart(choice: LoraChoice, rescaled: frozenset):
    """(module, terms) of an unmerged LoRA kept apart in wrappers: all but those of the layers
    a DoRA of the chain rescales."""
    return [(m, t) for m, t in choice.factors.terms.items() if m not in rescaled]


def _rescale(model: torch.nn.Module, choices: list[LoraChoice], rescaled: frozenset) -> None:
    """The same factors at the strengths of `choices` (in the order they were installed)."""
    found = wrappers(model)
    for choice_index, choice in enumerate(choices):
        for module, terms in _apart(choice, rescaled):
            wrapper = found[module]
            first = sum(len(dict(_apart(c, rescaled)).get(module, ()))
                        for c in choices[:choice_index])
            for offset, (_, _, scale) in enumerate(terms):
                wrapper.adapters[first + offset].scale = scale * choice.strength
