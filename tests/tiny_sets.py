"""The tiny model folders several test files share (written once per session by the fixtures in
conftest.py): one Wan2.2 TI2V-5B set, and one set holding every model kind; and one DiT block
with its inputs (tiny_block)."""

from pathlib import Path
from typing import NamedTuple

import torch

from wan_enhanced.checkpoints import tiny

# the TI2V-5B set: file names in its folders
DIT, VAE, TE = "dit.safetensors", "vae.safetensors", "te.safetensors"

# the set of every kind: (DiT, VAE) per kind, the text encoder and the CLIP vision encoder
NAMES = {"ti2v": ("tiny_ti2v.safetensors", "tiny_vae22.safetensors"),
         "t2v": ("tiny_t2v.safetensors", "tiny_vae21.safetensors"),
         "i2v_a14b": ("tiny_i2v_a14b.safetensors", "tiny_vae21.safetensors"),
         "i2v": ("tiny_i2v.safetensors", "tiny_vae21.safetensors")}
ALL_TE = "tiny_umt5.safetensors"
CLIP = "tiny_clip_vision_h.safetensors"
# the tiny Wan2.1 I2V DiT takes 64-wide image tokens
TINY_CLIP = dict(hidden=64, layers=2, heads=1, intermediate=128, image_size=28, patch=14)


def write_ti2v_set(root: Path) -> Path:
    return tiny.write_models_folder(root, dit_name=DIT, vae_name=VAE, text_encoder_name=TE,
                                    kind="ti2v")


def write_all_kinds(root: Path) -> Path:
    for kind, (dit, vae) in NAMES.items():
        tiny.write_models_folder(root, dit_name=dit, vae_name=vae, text_encoder_name=ALL_TE,
                                 kind=kind)
    (root / "clip_vision").mkdir()
    tiny.write_clip_vision(root / "clip_vision" / CLIP, TINY_CLIP)
    return root


class TinyBlock(NamedTuple):
    block: torch.nn.Module  # dit_block.WanBlock of 2 heads of 128, random weights
    x: torch.Tensor  # float32 [1, 45, 256]: 45 rows, a grid of 3 x 3 x 5 tokens
    e0: torch.Tensor  # [1, 1, 6, 256] time projection (one timestep group)
    text: torch.Tensor  # [1, 5, 256] text rows
    rope: object  # the grid's RotaryTable


def tiny_block() -> TinyBlock:
    """One DiT block on the CPU and its inputs, the same on every call (seed 0)."""
    from wan_enhanced.wan.configs import DiTConfig
    from wan_enhanced.wan.dit_block import WanBlock
    from wan_enhanced.wan.rope import RotaryTable

    cfg = DiTConfig(dim=256, num_heads=2, ffn_dim=512, num_layers=1)
    torch.manual_seed(0)
    block = WanBlock(cfg)
    x = torch.randn(1, 45, 256)
    e0 = torch.randn(1, 1, 6, 256) * 0.1
    text = torch.randn(1, 5, 256)
    return TinyBlock(block, x, e0, text, RotaryTable((3, 3, 5), cfg.rope_pairs))

