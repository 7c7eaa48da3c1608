"""The Wan2.2 video VAE (TI2V-5B): 16x spatial and 4x temporal compression to 48 channels.

Pixels are first folded into 2x2 patches (3 -> 12 channels), then an 8x causal encoder runs.
Each encoder stage adds a parameter-free shortcut that averages space-time neighbours and
channels into the stage's output shape; each upsampling decoder stage adds one that repeats
channels and spreads them over the upsampled grid. Parameter names are the official checkpoint
keys (encoder.*, conv1.*, conv2.*, decoder.*).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .vae_blocks import (CausalCache, CausalConv3d, CausalVideoVAE, Downsample, MiddleStack,
                         OutputHead, ResidualBlock, Upsample)


def fold_pixels(video: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C*p*p, T, H/p, W/p]; channel c*p*p + col_offset*p + row_offset."""
    b, c, t, h, w = video.shape
    if h % patch or w % patch:
        raise ValueError(f"height and width must be multiples of {patch}, got {h}x{w}")
    x = video.reshape(b, c, t, h // patch, patch, w // patch, patch)
    return x.permute(0, 1, 6, 4, 2, 3, 5).reshape(b, c * patch * patch, t, h // patch, w // patch)


def unfold_pixels(x: torch.Tensor, patch: int, channels_last: bool = False) -> torch.Tensor:
    """Inverse of fold_pixels; with `channels_last`, x and the result are channels_last_3d."""
    b, cpp, t, h, w = x.shape
    c = cpp // (patch * patch)
    if channels_last:
        rows = x.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, c, patch, patch)
        rows = rows.permute(0, 1, 2, 6, 3, 5, 4)  # (row_offset, col_offset)
        return rows.contiguous().view(b, t, h * patch, w * patch, c).permute(0, 4, 1, 2, 3)
    x = x.reshape(b, c, patch, patch, t, h, w)  # (col_offset, row_offset)
    return x.permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c, t, h * patch, w * patch)


class AverageDown(nn.Module):
    """Shortcut of an encoder stage: space-time-to-channel folding, then a mean over channel groups.

    A chunk whose frame count is not a multiple of the time factor gets zero frames in front
    (the one-frame first chunk).
    """

    def __init__(self, in_channels: int, out_channels: int, time_factor: int,
                 space_factor: int) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.time_factor = time_factor
        self.space_factor = space_factor
        folded = in_channels * time_factor * space_factor ** 2
        if folded % out_channels:
            raise ValueError(f"cannot average {folded} folded channels into {out_channels}")
        self.group = folded // out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.time_factor, self.space_factor
        short = -x.shape[2] % ft
        if short:
            x = F.pad(x, (0, 0, 0, 0, short, 0))
        b, c, t, h, w = x.shape
        x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        x = x.reshape(b, self.out_channels, self.group, t // ft, h // fs, w // fs)
        return x.mean(dim=2)


class DuplicateUp(nn.Module):
    """Shortcut of a decoder stage: repeat channels, then spread them into space and time.

    On the first decoder chunk only the last of the temporal copies is kept, matching the
    main path, which does not upsample that chunk in time.
    """

    def __init__(self, in_channels: int, out_channels: int, time_factor: int,
                 space_factor: int) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.time_factor = time_factor
        self.space_factor = space_factor
        spread = out_channels * time_factor * space_factor ** 2
        if spread % in_channels:
            raise ValueError(f"cannot spread {in_channels} channels into {spread}")
        self.repeats = spread // in_channels

    def forward(self, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        ft, fs = self.time_factor, self.space_factor
        b, c, t, h, w = x.shape
        # Channel c*repeats + r carries input channel c; expanding instead of copying lets the
        # regrouping below stay a view whenever the channel counts allow it.
        x = x[:, :, None].expand(b, c, self.repeats, t, h, w)
        x = x.reshape(b, self.out_channels, ft, fs, fs, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        x = x.reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1:] if first_chunk else x

    def add_to(self, out: torch.Tensor, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        """out += forward(x, first_chunk), for a channels-last `out`: the repeated values are
        read through a broadcast view of x, in out's order, not copied out first."""
        ft, fs = self.time_factor, self.space_factor
        b, c, t, h, w = x.shape
        frames = t * ft - (ft - 1 if first_chunk else 0)
        rows = out.permute(0, 2, 3, 4, 1)
        if (first_chunk and t > 1) or not rows.is_contiguous() or \
                rows.shape != (b, frames, h * fs, w * fs, self.out_channels):
            return out.add_(self.forward(x, first_chunk))
        spread = x.permute(0, 2, 3, 4, 1)[..., None].expand(b, t, h, w, c, self.repeats)
        spread = spread.reshape(b, t, h, w, self.out_channels, ft, fs, fs)
        spread = spread.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [b, t, ft, h, fs, w, fs, out]
        if first_chunk:
            spread = spread[:, :, ft - 1:]
        rows.view(b, t, spread.shape[2], h, fs, w, fs, self.out_channels).add_(spread)
        return out


class DownStage(nn.Module):
    """Residual blocks and an optional downsample, plus the averaging shortcut."""

    def __init__(self, in_channels: int, out_channels: int, num_res_blocks: int,
                 temporal: bool, downsample: bool, dropout: float) -> None:
        super().__init__()
        self.avg_shortcut = AverageDown(in_channels, out_channels, time_factor=2 if temporal else 1,
                                        space_factor=2 if downsample else 1)
        layers: list[nn.Module] = []
        for _ in range(num_res_blocks):
            layers.append(ResidualBlock(in_channels, out_channels, dropout))
            in_channels = out_channels
        if downsample:
            layers.append(Downsample(out_channels, temporal=temporal))
        self.downsamples = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        shortcut = self.avg_shortcut(x)
        for layer in self.downsamples:
            x = layer(x, cache)
        return x + shortcut


class UpStage(nn.Module):
    """Residual blocks and an optional upsample; an upsampling stage adds the duplicating shortcut."""

    def __init__(self, in_channels: int, out_channels: int, num_res_blocks: int,
                 temporal: bool, upsample: bool, dropout: float) -> None:
        super().__init__()
        self.avg_shortcut = (DuplicateUp(in_channels, out_channels,
                                         time_factor=2 if temporal else 1, space_factor=2)
                             if upsample else None)
        layers: list[nn.Module] = []
        for _ in range(num_res_blocks):
            layers.append(ResidualBlock(in_channels, out_channels, dropout))
            in_channels = out_channels
        if upsample:
            layers.append(Upsample(out_channels, out_channels, temporal=temporal))
        self.upsamples = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        h = x
        for layer in self.upsamples:
            h = layer(h, cache)
        if self.avg_shortcut is None:
            return h
        if cache.channels_last:
            return self.avg_shortcut.add_to(h, x, first_chunk=cache.is_first_chunk)
        return h.add_(self.avg_shortcut(x, first_chunk=cache.is_first_chunk))


class Encoder22(nn.Module):
    """RGB chunk -> 2*z_dim moments per latent frame (pixels folded into patches first)."""

    def __init__(self, dim: int, out_channels: int, dim_mult: Sequence[int], num_res_blocks: int,
                 temporal_downsample: Sequence[bool], dropout: float, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        widths = [dim * m for m in (1, *dim_mult)]
        self.conv1 = CausalConv3d(3 * patch_size ** 2, widths[0], 3)
        last_stage = len(dim_mult) - 1
        self.downsamples = nn.ModuleList(
            DownStage(width_in, width_out, num_res_blocks,
                      temporal=stage < len(temporal_downsample) and temporal_downsample[stage],
                      downsample=stage != last_stage, dropout=dropout)
            for stage, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:])))
        self.middle = MiddleStack(widths[-1], dropout)
        self.head = OutputHead(widths[-1], out_channels)

    def forward(self, video: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv1(fold_pixels(video, self.patch_size), cache)
        for stage in self.downsamples:
            x = stage(x, cache)
        x = self.middle(x, cache)
        return self.head(x, cache)


class Decoder22(nn.Module):
    """One latent frame -> RGB frames (1 for the first latent frame, 4 for each later one)."""

    def __init__(self, dim: int, z_dim: int, dim_mult: Sequence[int], num_res_blocks: int,
                 temporal_upsample: Sequence[bool], dropout: float, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        widths = [dim * m for m in (dim_mult[-1], *reversed(dim_mult))]
        self.conv1 = CausalConv3d(z_dim, widths[0], 3)
        self.middle = MiddleStack(widths[0], dropout)
        last_stage = len(dim_mult) - 1
        self.upsamples = nn.ModuleList(
            UpStage(width_in, width_out, num_res_blocks + 1,
                    temporal=stage < len(temporal_upsample) and temporal_upsample[stage],
                    upsample=stage != last_stage, dropout=dropout)
            for stage, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:])))
        self.head = OutputHead(widths[-1], 3 * patch_size ** 2)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.conv1(x, cache)
        x = self.middle(x, cache)
        for stage in self.upsamples:
            x = stage(x, cache)
        return unfold_pixels(self.head(x, cache), self.patch_size, cache.channels_last)


class WanVAE22(CausalVideoVAE):
    """Wan2.2 VAE. Defaults are the released model (Wan2.2_VAE.pth): encoder width 160,
    decoder width 256.

    encode(video) -> raw mu, decode(mu) -> video, decode_frames(mu) -> per-latent-frame chunks;
    see CausalVideoVAE. `attn_scales` is accepted for config compatibility but, as in the
    released architecture, the stages have no attention blocks. Latent normalisation lives in
    latent_format.py.
    """

    def __init__(self, dim: int = 160, dec_dim: int = 256, z_dim: int = 48,
                 dim_mult: Sequence[int] = (1, 2, 4, 4), num_res_blocks: int = 2,
                 attn_scales: Sequence[float] = (),
                 temperal_downsample: Sequence[bool] = (False, True, True),
                 dropout: float = 0.0, patch_size: int = 2) -> None:
        temporal_down = tuple(temperal_downsample)
        encoder = Encoder22(dim, z_dim * 2, dim_mult, num_res_blocks, temporal_down, dropout,
                            patch_size)
        decoder = Decoder22(dec_dim, z_dim, dim_mult, num_res_blocks, temporal_down[::-1],
                            dropout, patch_size)
        super().__init__(encoder, decoder, z_dim,
                         spatial_stride=patch_size * 2 ** (len(dim_mult) - 1),
                         temporal_stride=2 ** sum(temporal_down[: len(dim_mult) - 1]))
