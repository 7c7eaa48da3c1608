"""The LoRA stage: a model handle with one more LoRA, checked against the model first.

The new handle shares the model (its weights are not copied); it records the LoRA, its strength
and mode after those of the handle it came from. The weights change only when a node computes
with the handle (DiTPlacement.place brings the model to the handle's LoRAs: lora/apply.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ..lora.apply import MODES, LoraChoice
from ..lora.file import open_lora
from ..lora.keymap import dit_shapes
from .errors import InputError
from .handles import WanModelHandle


def with_lora(handle: WanModelHandle, path: Path, strength: float,
              mode: str = "merge") -> WanModelHandle:
    """`handle` with the LoRA file `path` at `strength` added (strength 0: `handle` itself)."""
    if not isinstance(handle, WanModelHandle):
        raise InputError(f"model: expected a WANMODEL from Wan Model Loader, got "
                         f"{type(handle).__name__}")
    if mode not in MODES:
        raise InputError(f"mode: {mode!r} is not one of {list(MODES)}")
    if not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise InputError(f"strength: {strength!r} is not a finite number")
    if strength == 0:
        return handle
    path = Path(path)
    for earlier in handle.loras:
        if earlier.path.resolve() == path.resolve():
            raise InputError(f"lora_name: {path.name} is already applied to this model at "
                             f"strength {earlier.strength} by an earlier LoRA loader of this "
                             f"chain; use one loader per LoRA file (with the strength wanted)")
    with open_lora(path, dit_shapes(handle.config)):
        pass  # every key placed and every shape checked; the weights change when it computes
    return replace(handle, loras=handle.loras + (LoraChoice(path, float(strength), mode),))
