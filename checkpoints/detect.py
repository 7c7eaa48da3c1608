"""What a checkpoint holds, from its keys and shapes alone.

`identify` names the component (DiT, Wan2.1 VAE, Wan2.2 VAE, umT5 text encoder) and the key
layout; the `infer_*` functions read the configuration from tensor shapes. Nothing is read but
the header.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..wan.configs import HEAD_DIM, DiTConfig, T5Config

COMPONENT_NAMES = {
    "dit": "Wan diffusion model (DiT)",
    "vae21": "Wan2.1 VAE",
    "vae22": "Wan2.2 VAE",
    "t5": "umT5 text encoder",
}


@dataclass(frozen=True)
class Identity:
    component: str  # "dit" | "vae21" | "vae22" | "t5"
    layout: str  # "official" | "comfy" | "diffusers" | "hf"
    prefix: str = ""  # stripped from every DiT key

    @property
    def description(self) -> str:
        return f"{COMPONENT_NAMES[self.component]} ({self.layout} layout)"


def identify(keys: list[str]) -> Identity | None:
    """The component and layout of a key set, or None when it is none of ours."""
    from .keymaps import strip_prefix

    keyset = set(keys)
    prefix = strip_prefix(keys)
    bare = {k[len(prefix):] for k in keys if k.startswith(prefix)} if prefix else keyset
    if "head.modulation" in bare and "patch_embedding.weight" in bare:
        return Identity("dit", "comfy" if prefix == "model.diffusion_model." else
                        ("official" if not prefix else "prefixed"), prefix)
    if "scale_shift_table" in keyset and "condition_embedder.time_proj.weight" in keyset:
        return Identity("dit", "diffusers")
    if "decoder.middle.0.residual.0.gamma" in keyset:
        nested = any(k.startswith("decoder.upsamples.0.upsamples.") for k in keyset)
        return Identity("vae22" if nested else "vae21", "official")
    if "decoder.mid_block.resnets.0.norm1.gamma" in keyset:
        nested = any(re.match(r"decoder\.up_blocks\.\d+\.upsampler\.", k) for k in keyset)
        return Identity("vae22" if nested else "vae21", "diffusers")
    if "token_embedding.weight" in keyset and "blocks.0.attn.q.weight" in keyset:
        return Identity("t5", "official")
    if "encoder.block.0.layer.0.SelfAttention.q.weight" in keyset:
        return Identity("t5", "hf")
    return None


def _count_blocks(shapes: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
    if found and found != set(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - found)
        raise ValueError(f"block numbering has gaps: blocks {missing} are missing")
    return len(found)


def infer_dit_config(shapes: dict[str, tuple], num_heads: int | None = None) -> DiTConfig:
    """DiT hyper-parameters from official-name shapes. The head count is not stored in the
    weights: it comes from a declared config or from head_dim 128, as in every released size."""
    def shape(key):
        if key not in shapes:
            raise ValueError(f"missing tensor {key!r}")
        return shapes[key]

    dim = shape("head.modulation")[-1]
    patch = tuple(shape("patch_embedding.weight")[2:])
    if len(patch) != 3:
        raise ValueError(f"patch_embedding.weight has shape {list(shape('patch_embedding.weight'))}"
                         f"; expected a 3D convolution kernel")
    head_rows = shape("head.head.weight")[0]
    if head_rows % math.prod(patch):
        raise ValueError(f"head.head.weight has {head_rows} rows, not a multiple of the patch "
                         f"volume {math.prod(patch)}")
    if num_heads is None:
        if dim % HEAD_DIM:
            raise ValueError(f"model width {dim} is not a multiple of the head size {HEAD_DIM} "
                             f"and the checkpoint declares no head count")
        num_heads = dim // HEAD_DIM
    return DiTConfig(
        in_dim=shape("patch_embedding.weight")[1],
        out_dim=head_rows // math.prod(patch),
        dim=dim,
        ffn_dim=shape("blocks.0.ffn.0.weight")[0],
        num_heads=num_heads,
        num_layers=_count_blocks(shapes, r"blocks\.(\d+)\."),
        freq_dim=shape("time_embedding.0.weight")[1],
        text_dim=shape("text_embedding.0.weight")[1],
        patch_size=patch,
        image_embedding="img_emb.proj.0.weight" in shapes,
        image_pos_embedding="img_emb.emb_pos" in shapes,
        image_dim=shapes["img_emb.proj.0.weight"][0] if "img_emb.proj.0.weight" in shapes
        else 1280,
    )


def infer_vae_config(component: str, shapes: dict[str, tuple]) -> dict:
    """Widths of a VAE in official names; the block structure is the released one."""
    z_dim = shapes["conv2.weight"][0]
    dim = shapes["encoder.conv1.weight"][0]
    config = {"dim": dim, "z_dim": z_dim}
    if component == "vae22":
        # the decoder's first conv widens to dec_dim * the last channel multiplier (4)
        config["dec_dim"] = shapes["decoder.conv1.weight"][0] // 4
    return config


def infer_t5_config(shapes: dict[str, tuple]) -> T5Config:
    """umT5 encoder hyper-parameters (official names), as far as the shapes show them."""
    vocab, dim = shapes["token_embedding.weight"]
    buckets, heads = shapes["blocks.0.pos_embedding.embedding.weight"]
    return T5Config(
        vocab_size=vocab,
        dim=dim,
        dim_attn=shapes["blocks.0.attn.q.weight"][0],
        dim_ffn=shapes["blocks.0.ffn.fc1.weight"][0],
        num_heads=heads,
        num_layers=_count_blocks(shapes, r"blocks\.(\d+)\."),
        num_buckets=buckets,
    )
