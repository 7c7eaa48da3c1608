"""What travels between nodes for the models: light handles around CPU-resident modules.

A handle carries the module (its weights on the CPU between uses), what the checkpoint is and the
options chosen at load time. Run state never lives on a handle or its module: placement on the
GPU happens inside the node that computes (pipeline/placement.py) and is undone before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoints.loader import CheckpointInfo
from ..wan.configs import VAES, pixel_stride, vae_kind, vae_spec
from ..wan.latent_format import LatentFormat

if TYPE_CHECKING:
    from ..lora.apply import LoraChoice


@dataclass(eq=False)
class WanModelHandle:
    model: torch.nn.Module  # WanDiT
    info: CheckpointInfo
    attention: str = "sdpa_cudnn"
    compile: bool = False  # run the transformer blocks through torch.compile
    # the loader's weight_dtype: what the worker processes of a several-GPU run load the file
    # with (None: a model not loaded from a file, which they cannot load)
    weight_dtype: str | None = None
    # the LoRAs this handle's model computes with, in order (Wan LoRA Loader): handles of one
    # loaded model share its module, which is brought to a handle's LoRAs when it computes
    loras: tuple["LoraChoice", ...] = ()

    @property
    def name(self) -> str:
        return Path(self.info.path).name

    @property
    def config(self):
        return self.model.config

    @property
    def quantization(self) -> str | None:
        """The weight_dtype that quantized the block matrices (fp8_e4m3fn, fp8_e4m3fn_fast,
        int8, int8_dynamic), or None for float weights; info.quantization_detail says what was
        kept as stored and what quantized on load."""
        return self.info.quantization

    @property
    def vae_kind(self) -> str:
        """The VAE this model's latents belong to."""
        return vae_kind(self.config)

    @property
    def latent_format(self) -> LatentFormat:
        return vae_spec(self.config).latent_format

    @property
    def keeps_first_frames(self) -> bool:
        """Whether a start image is given as clean first latent frames (VAESpec)."""
        return vae_spec(self.config).keeps_first_frames

    @property
    def latent_channels(self) -> int:
        return self.config.out_dim

    @property
    def spatial_stride(self) -> int:
        """Pixels per latent-grid step times the DiT's patch: what width/height must divide by."""
        return pixel_stride(self.config)


@dataclass(eq=False)
class WanTextEncoderHandle:
    model: torch.nn.Module  # UMT5Encoder
    tokenizer: object  # UMT5Tokenizer
    info: CheckpointInfo
    device: str = "gpu"  # "gpu" or "cpu": where the encoder runs

    @property
    def name(self) -> str:
        return Path(self.info.path).name


@dataclass(eq=False)
class WanVAEHandle:
    model: torch.nn.Module  # WanVAE21 / WanVAE22
    info: CheckpointInfo
    kind: str = field(default="vae21")  # "vae21" | "vae22"

    @property
    def name(self) -> str:
        return Path(self.info.path).name

    @property
    def latent_format(self) -> LatentFormat:
        return VAES[self.kind].latent_format


@dataclass(eq=False)
class WanCLIPVisionHandle:
    model: torch.nn.Module  # CLIPVisionEncoder
    path: Path

    @property
    def name(self) -> str:
        return Path(self.path).name
