"""Latent to IMAGE frames with a Wan VAE, tiled or not, streamed to the CPU."""

from __future__ import annotations

import torch

from .. import host
from ..vae_tiling.decode import decode_to_images
from .handles import WanVAEHandle
from .placement import DevicePlacement
from .sample import InputError

VAE_NAMES = {"vae21": "Wan2.1 VAE", "vae22": "Wan2.2 VAE"}


def check_latent_for_vae(vae: WanVAEHandle, latent, field: str = "latent") -> torch.Tensor:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.dim() != 5:
        raise InputError(f"{field}: expected a video LATENT {{'samples': [B, C, T, H, W]}}")
    z_dim = vae.model.z_dim
    if samples.shape[1] != z_dim:
        other = "Wan2.2 (TI2V-5B)" if samples.shape[1] == 48 else (
            "Wan2.1 / Wan2.2 A14B" if samples.shape[1] == 16 else "another")
        raise InputError(f"{field}: a {samples.shape[1]}-channel latent of a {other} model "
                         f"cannot be decoded by {vae.name}, a {VAE_NAMES[vae.kind]} "
                         f"({z_dim} channels)")
    return samples


def decode(vae: WanVAEHandle, latent: dict, *, tiled: bool = True, tile=(272, 272),
           stride=(144, 128), device=None, progress=None) -> torch.Tensor:
    """IMAGE frames [B*F, H, W, 3] float32 in 0..1 on the CPU."""
    samples = check_latent_for_vae(vae, latent)
    device = torch.device(device) if device is not None else host.compute_device()
    with DevicePlacement(device) as placement:
        placement.place(vae.model)
        return decode_to_images(vae.model, samples, tiled=tiled, tile=tile, stride=stride,
                                device=device, progress=progress,
                                check_interrupt=host.check_interrupt)
