"""Per-channel latent statistics of the Wan VAEs and the normalisation the diffusion models expect.

The DiT works on latent = (mu - mean) * (1 / std); decoding inverts it as mu = latent / (1 / std)
+ mean. Both are written exactly this way (a multiply by the float32 reciprocal, and a divide by
it) because that is how the released pipelines compute them, so results match to the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WAN21_LATENT_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENT_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)

WAN22_LATENT_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENT_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)


def _per_channel(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[C] float32 statistics shaped to broadcast over a [B, C, T, H, W] latent."""
    return values.to(device=like.device, dtype=torch.float32).view(1, -1, 1, 1, 1)


def normalise_latent(mu: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Raw VAE mu -> diffusion latent, (mu - mean) * (1 / std), computed in float32."""
    inv_std = 1.0 / std.to(torch.float32)
    return (mu.float() - _per_channel(mean, mu)) * _per_channel(inv_std, mu)


def denormalise_latent(latent: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Diffusion latent -> raw VAE mu, latent / (1 / std) + mean, computed in float32."""
    inv_std = 1.0 / std.to(torch.float32)
    return latent.float() / _per_channel(inv_std, latent) + _per_channel(mean, latent)


@dataclass(frozen=True)
class LatentFormat:
    """The latent statistics of one VAE."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def channels(self) -> int:
        return len(self.mean)

    def mean_tensor(self) -> torch.Tensor:
        return torch.tensor(self.mean, dtype=torch.float32)

    def std_tensor(self) -> torch.Tensor:
        return torch.tensor(self.std, dtype=torch.float32)

    def normalise(self, mu: torch.Tensor) -> torch.Tensor:
        return normalise_latent(mu, self.mean_tensor(), self.std_tensor())

    def denormalise(self, latent: torch.Tensor) -> torch.Tensor:
        return denormalise_latent(latent, self.mean_tensor(), self.std_tensor())


WAN21_LATENT = LatentFormat(WAN21_LATENT_MEAN, WAN21_LATENT_STD)
WAN22_LATENT = LatentFormat(WAN22_LATENT_MEAN, WAN22_LATENT_STD)
