"""The merge arithmetic: patches added into a float32 weight, in place.

For a low-rank pair: W += strength * scale * (up @ down), the product flattened to W's shape;
for a full difference: W += strength * diff; in float32, one patch after another in the order
the LoRAs were chained, as ComfyUI's calculate_weight does. `addmm_` adds the product straight
into W (the product is never a second matrix in memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .file import LoraFile, LowRank, Patch


def add_patch_(weight: torch.Tensor, lora: LoraFile, patch: Patch, strength: float) -> None:
    """weight (float32, contiguous, on any device) += strength * the patch's delta."""
    where = dict(device=weight.device, dtype=torch.float32)
    if isinstance(patch, LowRank):
        up = lora.tensor(patch.up).to(**where).flatten(1)
        down = lora.tensor(patch.down).to(**where).flatten(1)
        weight.view(weight.shape[0], -1).addmm_(up, down, alpha=strength * patch.scale)
    else:
        weight.add_(lora.tensor(patch.key).to(**where).reshape(weight.shape), alpha=strength)


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
        for c in self.contributions.get(key, ()):
            add_patch_(weight, c.lora, c.lora.patches[key], c.strength)
