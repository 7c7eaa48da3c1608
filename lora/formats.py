"""What each key of a LoRA file is, from its name alone.

A LoRA file is a flat set of tensors. Every key we read ends in one of the suffixes below (its
role) after a module name; the module name is resolved against the model's own names by
lora/keymap.py. A key with any other ending belongs to a format we do not read (LyCORIS LoHa /
LoKr, DoRA, Tucker-decomposed LoCon, ...) or is not a LoRA at all (a full model's weights): the
whole file is refused, naming the first such key.
"""

from __future__ import annotations

from dataclasses import dataclass

# suffix -> role. up/down: the low-rank pair (delta = up @ down, up [out, rank], down [rank, in]);
# alpha: its scale numerator (scale = alpha / rank); diff / diff_b: a full weight / bias difference.
ROLES = {
    ".lora_up.weight": "up", ".lora_down.weight": "down",  # kohya / musubi, lightx2v
    ".lora_B.weight": "up", ".lora_A.weight": "down",  # PEFT / diffusers
    ".lora_B.default.weight": "up", ".lora_A.default.weight": "down",  # PEFT, named adapter
    ".alpha": "alpha",
    ".diff": "diff",
    ".diff_b": "diff_b",
}

FORMATS_READ = ("kohya/musubi (lora_unet_blocks_0_self_attn_q.lora_down.weight / .lora_up.weight "
                "/ .alpha), generic/PEFT on the official Wan names with or without the "
                "diffusion_model. prefix (blocks.0.self_attn.q.lora_A.weight / .lora_B.weight, or "
                ".lora_down / .lora_up, optional .alpha), diffusers (transformer.blocks.0.attn1."
                "to_q.lora_A.weight ...) and full differences (.diff, .diff_b)")

# Endings of formats we know of but do not read, to say which one a refused file is.
_KNOWN_OTHERS = {
    "hada_w1_a": "LyCORIS LoHa", "hada_w2_a": "LyCORIS LoHa", "hada_t1": "LyCORIS LoHa",
    "lokr_w1": "LyCORIS LoKr", "lokr_w2": "LyCORIS LoKr", "lokr_w1_a": "LyCORIS LoKr",
    "lokr_t2": "LyCORIS LoKr", "lora_mid.weight": "LoCon with a Tucker middle factor",
    "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA (PEFT)", "oft_blocks": "OFT",
    "oft_diag": "OFT", "w_norm": "a norm patch", "b_norm": "a norm patch",
    "set_weight": "a weight replacement", "reshape_weight": "a reshaping patch",
}


@dataclass(frozen=True)
class LoraKey:
    """One key of a LoRA file: the module name as written and the key's role."""
    key: str
    module: str
    role: str


def split_key(key: str) -> LoraKey | None:
    """The module name and role of a key we read, or None."""
    for suffix, role in ROLES.items():
        if key.endswith(suffix) and len(key) > len(suffix):
            return LoraKey(key, key[:-len(suffix)], role)
    return None


def unknown_key_message(key: str) -> str:
    """Why a key is not one we read, in words: the format it belongs to when we know it."""
    for ending, name in _KNOWN_OTHERS.items():
        if key.endswith(ending) or f".{ending}." in key:
            return f"key {key!r} is {name}, a format this package does not read"
    if key.endswith((".weight", ".bias")) or "." not in key:
        return (f"key {key!r} is not a LoRA key (it looks like a model's own weight: is this a "
                f"full model rather than a LoRA?)")
    return f"key {key!r} is of no LoRA format this package reads"


def refusal(path, key: str) -> str:
    return (f"{path}: not a LoRA file we can read: {unknown_key_message(key)}; we read "
            f"{FORMATS_READ}")
