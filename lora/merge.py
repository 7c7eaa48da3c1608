"""The merge: patches added into a float32 weight, in place, one after another in the order
the LoRAs were chained, as ComfyUI's calculate_weight does (the arithmetic of each kind of
patch: lora/patches.py; a low-rank pair is added by one `addmm_`, the product never a second
matrix in memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .build import LoraError
from .file import LoraFile
from .patches import Patch, add_, file_keys


def add_patch_(weight: torch.Tensor, lora: LoraFile, patch: Patch, strength: float) -> None:
    """weight (float32, contiguous, on any device) changed by the patch at `strength`."""
    add_(weight, patch, lora.tensor, strength)


@dataclass(frozen=True)
class Contribution:
    lora: LoraFile
    strength: float


class Merge:
    """What the checkpoint loader asks while it streams weights (checkpoints.loader.WeightMerge):
    which parameters change, and their change added into a float32 copy."""

    def __init__(self, contributions: dict[str, list[Contribution]]):
        self.contributions = contributions

    @classmethod
    def of(cls, loras: list[tuple[LoraFile, float]], keep=lambda key: True) -> "Merge":
        """Every patch of `loras` (file, strength), in order, on the parameters `keep` takes."""
        found: dict[str, list[Contribution]] = {}
        for lora, strength in loras:
            for key in lora.patches:
                if keep(key):
                    found.setdefault(key, []).append(Contribution(lora, strength))
        return cls(found)

    def touches(self, key: str) -> bool:
        return key in self.contributions

    def apply_(self, key: str, weight: torch.Tensor) -> None:
        """Every contribution to `key` added into `weight`; LoraError naming the file and its
        keys when one leaves a NaN or an infinity in it (a NaN stored in the file, an alpha or
        strength that overflows float32): a black video otherwise, with no word said."""
        for c in self.contributions.get(key, ()):
            patch = c.lora.patches[key]
            add_patch_(weight, c.lora, patch, c.strength)
            if not bool(torch.isfinite(weight).all()):
                raise LoraError(f"{c.lora.path}: merging {', '.join(map(repr, file_keys(patch)))}"
                                f" at strength {c.strength:g} into {key} gives NaN or "
                                f"infinite values (a NaN or infinity stored in the file, or a "
                                f"scale too large); refused")
