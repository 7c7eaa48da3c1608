"""Key layouts on disk mapped onto our module names (which are the official Wan names).

DiT: official, ComfyUI (`model.diffusion_model.` prefix), diffusers. VAE: official (ComfyUI files
use it too), diffusers. Text encoder: official Wan T5, HF/ComfyUI UMT5 (delegated to wan/t5.py).
Each map returns {our_key: file_key}; keys the map cannot place are reported by the loader.
"""

from __future__ import annotations

import re

from ..wan.t5 import hf_key_to_wan

# ComfyUI and other tools save the DiT under a prefix; the names below it are official.
DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")

# ---------------------------------------------------------------------------------------------
# DiT

_DIT_DIFFUSERS_TOP = {
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",
    "patch_embedding": "patch_embedding",
}

_DIT_DIFFUSERS_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q",
    "attn1.norm_k": "self_attn.norm_k",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q",
    "attn2.norm_k": "cross_attn.norm_k", "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img", "attn2.norm_added_k": "cross_attn.norm_k_img",
    "norm2": "norm3",  # diffusers calls the cross-attention norm norm2
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
    "scale_shift_table": "modulation",
}


def _split_module(key: str) -> tuple[str, str]:
    """'a.b.weight' -> ('a.b', 'weight'); parameters without a suffix map whole."""
    module, _, leaf = key.rpartition(".")
    return (module, leaf) if leaf in ("weight", "bias", "gamma") else (key, "")


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if leaf else module


def dit_diffusers_to_ours(key: str) -> str | None:
    block = re.match(r"blocks\.(\d+)\.(.+)$", key)
    if block:
        module, leaf = _split_module(block.group(2))
        mapped = _DIT_DIFFUSERS_BLOCK.get(module)
        return None if mapped is None else f"blocks.{block.group(1)}.{_join(mapped, leaf)}"
    module, leaf = _split_module(key)
    mapped = _DIT_DIFFUSERS_TOP.get(module)
    return None if mapped is None else _join(mapped, leaf)


_DIT_OURS_TOP = {v: k for k, v in _DIT_DIFFUSERS_TOP.items()}
_DIT_OURS_BLOCK = {v: k for k, v in _DIT_DIFFUSERS_BLOCK.items()}


def dit_ours_to_diffusers(key: str) -> str | None:
    """diffusers' name of one of our DiT keys (None for a key diffusers has no name for)."""
    block = re.match(r"blocks\.(\d+)\.(.+)$", key)
    table, rest = (_DIT_OURS_BLOCK, block.group(2)) if block else (_DIT_OURS_TOP, key)
    module, leaf = _split_module(rest)
    if module not in table:
        return None
    mapped = _join(table[module], leaf)
    return f"blocks.{block.group(1)}.{mapped}" if block else mapped


def strip_prefix(keys: list[str]) -> str:
    """The DiT prefix most keys carry ('' if none)."""
    for prefix in DIT_PREFIXES:
        if sum(k.startswith(prefix) for k in keys) > len(keys) // 2:
            return prefix
    return ""


# ---------------------------------------------------------------------------------------------
# VAE

_VAE_DIFFUSERS_RESNET = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3",
                         "conv2": "residual.6", "conv_shortcut": "shortcut"}


def _vae_inner(rest: str) -> str | None:
    """Names inside a residual block, resample or attention block."""
    module, leaf = _split_module(rest)
    if module in _VAE_DIFFUSERS_RESNET:
        return _join(_VAE_DIFFUSERS_RESNET[module], leaf)
    if module.split(".")[0] in ("resample", "time_conv", "norm", "to_qkv", "proj"):
        return rest
    return None


def vae_diffusers_map(keys: list[str], nested: bool) -> dict[str, str]:
    """{our_key: file_key} for a diffusers AutoencoderKLWan state dict.

    nested=False: Wan2.1 (flat encoder list; decoder stages flattened in order).
    nested=True: Wan2.2 (encoder.downsamples.i.downsamples.j / decoder.upsamples.i.upsamples.j).
    """
    out: dict[str, str] = {}
    # residual blocks per stage, so the stage's resample lands after them
    resnets: dict[tuple[str, int], int] = {}
    for key in keys:
        m = re.match(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.", key)
        if m:
            stage = (m.group(1), int(m.group(3)))
            resnets[stage] = max(resnets.get(stage, 0), int(m.group(4)) + 1)
    decoder_offsets, offset = {}, 0
    for stage in sorted(s for s in resnets if s[0] == "decoder"):
        decoder_offsets[stage[1]] = offset
        offset += resnets[stage] + 1

    simple = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    for key in keys:
        ours = None
        part, _, rest = key.partition(".")
        if part in simple:
            ours = f"{simple[part]}.{rest}"
        elif part in ("encoder", "decoder"):
            ours = _vae_side(part, rest, nested, resnets, decoder_offsets)
        if ours is not None:
            out[ours] = key
    return out


def _vae_side(side, rest, nested, resnets, decoder_offsets) -> str | None:
    m = re.match(r"conv_in\.(.+)$", rest)
    if m:
        return f"{side}.conv1.{m.group(1)}"
    m = re.match(r"conv_out\.(.+)$", rest)
    if m:
        return f"{side}.head.2.{m.group(1)}"
    m = re.match(r"norm_out\.(.+)$", rest)
    if m:
        return f"{side}.head.0.{m.group(1)}"
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", rest)
    if m:
        index = {("resnets", 0): 0, ("attentions", 0): 1, ("resnets", 1): 2}.get(
            (m.group(1), int(m.group(2))))
        inner = _vae_inner(m.group(3))
        return None if index is None or inner is None else f"{side}.middle.{index}.{inner}"
    if side == "encoder":
        m = re.match(r"down_blocks\.(\d+)\.(.+)$", rest)
        if not m:
            return None
        stage, tail = int(m.group(1)), m.group(2)
        if not nested:  # Wan2.1: the diffusers list is already flat
            inner = _vae_inner(tail)
            return None if inner is None else f"encoder.downsamples.{stage}.{inner}"
        r = re.match(r"resnets\.(\d+)\.(.+)$", tail)
        if r:
            inner = _vae_inner(r.group(2))
            return None if inner is None else \
                f"encoder.downsamples.{stage}.downsamples.{r.group(1)}.{inner}"
        r = re.match(r"downsampler\.(.+)$", tail)
        if r:
            inner = _vae_inner(r.group(1))
            j = resnets[("encoder", stage)]
            return None if inner is None else f"encoder.downsamples.{stage}.downsamples.{j}.{inner}"
        return None
    m = re.match(r"up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0|upsampler)\.(.+)$", rest)
    if not m:
        return None
    stage = int(m.group(1))
    inner = _vae_inner(m.group(4))
    if inner is None:
        return None
    j = int(m.group(3)) if m.group(3) is not None else resnets[("decoder", stage)]
    if nested:
        return f"decoder.upsamples.{stage}.upsamples.{j}.{inner}"
    return f"decoder.upsamples.{decoder_offsets[stage] + j}.{inner}"


# ---------------------------------------------------------------------------------------------
# Text encoder

def t5_hf_map(keys: list[str]) -> dict[str, str]:
    """{our_key: file_key} for HF/ComfyUI UMT5 names; the tied embedding is read once."""
    out: dict[str, str] = {}
    for key in keys:
        ours = hf_key_to_wan(key)
        if ours is not None and ours not in out:
            out[ours] = key
    # prefer shared.weight when both copies of the tied embedding are stored
    if "shared.weight" in keys:
        out["token_embedding.weight"] = "shared.weight"
    return out
