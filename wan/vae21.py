"""The Wan2.1 video VAE: 8x spatial and 4x temporal compression to 16 latent channels.

Also used by Wan2.2 A14B. Parameter names are the official checkpoint keys (encoder.*, conv1.*,
conv2.*, decoder.*).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from .vae_blocks import (CausalCache, CausalConv3d, CausalVideoVAE, Downsample, FrameAttention,
                         MiddleStack, OutputHead, ResidualBlock, Upsample)


class Encoder21(nn.Module):
    """RGB chunk -> 2*z_dim moments (mu, log-variance) per latent frame."""

    def __init__(self, dim: int, out_channels: int, dim_mult: Sequence[int], num_res_blocks: int,
                 attn_scales: Sequence[float], temporal_downsample: Sequence[bool],
                 dropout: float) -> None:
        super().__init__()
        widths = [dim * m for m in (1, *dim_mult)]
        self.conv1 = CausalConv3d(3, widths[0], 3)

        layers: list[nn.Module] = []
        scale = 1.0  # resolution relative to the input, which selects the attention stages
        last_stage = len(dim_mult) - 1
        for stage, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:])):
            for _ in range(num_res_blocks):
                layers.append(ResidualBlock(width_in, width_out, dropout))
                if scale in attn_scales:
                    layers.append(FrameAttention(width_out))
                width_in = width_out
            if stage != last_stage:
                layers.append(Downsample(width_out, temporal=temporal_downsample[stage]))
                scale /= 2.0
        self.downsamples = nn.ModuleList(layers)

        self.middle = MiddleStack(widths[-1], dropout)
        self.head = OutputHead(widths[-1], out_channels)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv1(x, cache)
        for layer in self.downsamples:
            x = layer(x, cache)
        x = self.middle(x, cache)
        return self.head(x, cache)


class Decoder21(nn.Module):
    """One latent frame -> RGB frames (1 for the first latent frame, 4 for each later one)."""

    def __init__(self, dim: int, z_dim: int, dim_mult: Sequence[int], num_res_blocks: int,
                 attn_scales: Sequence[float], temporal_upsample: Sequence[bool],
                 dropout: float) -> None:
        super().__init__()
        widths = [dim * m for m in (dim_mult[-1], *reversed(dim_mult))]
        self.conv1 = CausalConv3d(z_dim, widths[0], 3)
        self.middle = MiddleStack(widths[0], dropout)

        layers: list[nn.Module] = []
        scale = 1.0 / 2 ** (len(dim_mult) - 2)
        last_stage = len(dim_mult) - 1
        for stage, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:])):
            if stage > 0:
                width_in //= 2  # the upsample that ends the previous stage halves the channels
            for _ in range(num_res_blocks + 1):
                layers.append(ResidualBlock(width_in, width_out, dropout))
                if scale in attn_scales:
                    layers.append(FrameAttention(width_out))
                width_in = width_out
            if stage != last_stage:
                layers.append(Upsample(width_out, width_out // 2,
                                       temporal=temporal_upsample[stage]))
                scale *= 2.0
        self.upsamples = nn.ModuleList(layers)

        self.head = OutputHead(widths[-1], 3)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv1(x, cache)
        x = self.middle(x, cache)
        for layer in self.upsamples:
            x = layer(x, cache)
        return self.head(x, cache)


class WanVAE21(CausalVideoVAE):
    """Wan2.1 VAE. Defaults are the released model (Wan2.1_VAE.pth, 127 M parameters).

    encode(video) -> raw mu, decode(mu) -> video, decode_frames(mu) -> per-latent-frame chunks;
    see CausalVideoVAE. Latent normalisation lives in latent_format.py.
    """

    def __init__(self, dim: int = 96, z_dim: int = 16, dim_mult: Sequence[int] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, attn_scales: Sequence[float] = (),
                 temperal_downsample: Sequence[bool] = (False, True, True),
                 dropout: float = 0.0) -> None:
        temporal_down = tuple(temperal_downsample)
        encoder = Encoder21(dim, z_dim * 2, dim_mult, num_res_blocks, attn_scales,
                            temporal_down, dropout)
        decoder = Decoder21(dim, z_dim, dim_mult, num_res_blocks, attn_scales,
                            temporal_down[::-1], dropout)
        super().__init__(encoder, decoder, z_dim,
                         spatial_stride=2 ** (len(dim_mult) - 1),
                         temporal_stride=2 ** sum(temporal_down[: len(dim_mult) - 1]))
