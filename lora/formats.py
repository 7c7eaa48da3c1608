"""What each key of a LoRA file is, from its name alone.

A LoRA file is a flat set of tensors. Every key we read ends in one of the suffixes below (its
role) after a module name; the module name is resolved against the model's own names by
lora/keymap.py. A few keys without a module are settings of the file as a whole (FILE_SETTINGS).
A key with any other ending belongs to a format we do not read (LoCon's Tucker middle factor, a
reshaping patch, ...) or is not a LoRA at all (a full model's weights): the file is refused, the
refusal decided over all its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

# suffix -> role. up/down: a low-rank pair (delta = up @ down); alpha: the scale numerator;
# diff / diff_b: a full weight / bias difference; up_bias: PEFT's bias of lora_B (a bias
# difference scaled as its pair); hada_*: LoHa; lokr_*: LoKr; dora_scale / magnitude: DoRA.
ROLES = {
    ".lora_up.weight": "up", ".lora_down.weight": "down",  # kohya / musubi, lightx2v
    ".lora_B.weight": "up", ".lora_A.weight": "down",  # PEFT / diffusers
    ".lora_B.default.weight": "up", ".lora_A.default.weight": "down",  # PEFT, named adapter
    ".lora.up.weight": "up", ".lora.down.weight": "down",  # diffusers' older LoRA layers
    "_lora.up.weight": "up", "_lora.down.weight": "down",  # diffusers' attention processors
    ".lora_linear_layer.up.weight": "up", ".lora_linear_layer.down.weight": "down",
    ".lora_B": "up", ".lora_A": "down",  # PEFT state without the weight leaf
    ".lora_B.bias": "up_bias", ".lora_B.default.bias": "up_bias",  # PEFT lora_bias=True
    ".alpha": "alpha",
    ".diff": "diff", ".w_norm": "diff",  # a full weight difference (LyCORIS norms: w_norm)
    ".diff_b": "diff_b", ".b_norm": "diff_b",
    ".set_weight": "set_weight",  # the weight replaced (ComfyUI's "set" patch)
    ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b", ".hada_w2_a": "hada_w2_a",
    ".hada_w2_b": "hada_w2_b", ".hada_t1": "hada_t1", ".hada_t2": "hada_t2",
    ".lokr_w1": "lokr_w1", ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b",
    ".lokr_w2": "lokr_w2", ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b",
    ".lokr_t2": "lokr_t2",
    ".oft_blocks": "oft_blocks",  # LyCORIS OFT [k, n, n] or BOFT [m, k, n, n]
    ".a1.weight": "glora_a1", ".a2.weight": "glora_a2",  # LyCORIS GLoRA
    ".b1.weight": "glora_b1", ".b2.weight": "glora_b2",
    ".rescale": "oft_rescale",  # OFT's output rescaling (refused: see lora/build.py)
    ".dora_scale": "dora_scale",  # kohya / LyCORIS DoRA
    ".lora_magnitude_vector": "magnitude", ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector.default": "magnitude",
    ".lora_magnitude_vector.default.weight": "magnitude",  # PEFT DoRA
}
# LightX2V's extractor writes a block's (or the head's) modulation difference as
# `blocks.N.diff_m`: the full difference of the parameter `blocks.N.modulation`.
MODULATION_DIFF = ".diff_m"

# Keys without a module: settings of the whole file written by LyCORIS trainers. They describe
# how the file was trained, not a change of the model: read (one number each) and reported.
FILE_SETTINGS = {
    "lokr_factor": "LoKr's factorization factor (the factors' own shapes decide the product)",
    "dora": "whether DoRA was trained (the dora_scale keys are what is applied)",
}

FORMATS_READ = ("low-rank pairs under kohya/musubi (lora_unet_...), LyCORIS (lycoris_...), "
                "generic/PEFT official names with or without a prefix (diffusion_model., "
                "transformer., base_model.model.) and diffusers names (lora_up/lora_down, "
                "lora_A/lora_B, optional alpha, PEFT lora_B.bias); full differences (.diff, "
                ".diff_b, LightX2V's .diff_m, LyCORIS .w_norm/.b_norm); LyCORIS LoHa "
                "(hada_*), LoKr (lokr_*), OFT and BOFT (oft_blocks), GLoRA (a1/a2/b1/b2); DoRA "
                "(dora_scale, PEFT lora_magnitude_vector); weight replacements (.set_weight)")

# Endings of formats we know of but do not read, to say which one a refused file is.
_KNOWN_OTHERS = {
    "oft_diag": "LyCORIS OFT in its first layout (oft_diag)",
    "oft_R": "BOFT in its first layout (oft_R)",
    "lora_mid.weight": "LoCon with a Tucker middle factor",
    "reshape_weight": "a reshaping patch (it changes the model's shapes)",
}


@dataclass(frozen=True)
class LoraKey:
    """One key of a LoRA file: the module name as written and the key's role."""
    key: str
    module: str
    role: str


def split_key(key: str) -> LoraKey | None:
    """The module name and role of a key we read (the longest suffix that fits), or None."""
    if key.endswith(MODULATION_DIFF) and len(key) > len(MODULATION_DIFF):
        return LoraKey(key, key[:-len(MODULATION_DIFF)] + ".modulation", "diff")
    best = None
    for suffix, role in ROLES.items():
        if key.endswith(suffix) and len(key) > len(suffix) and (
                best is None or len(suffix) > len(best[0])):
            best = (suffix, role)
    return None if best is None else LoraKey(key, key[:-len(best[0])], best[1])


def is_file_setting(key: str) -> bool:
    return key in FILE_SETTINGS


def format_of_unknown(key: str) -> str | None:
    """The name of the format an unread key belongs to, when we know it."""
    for ending, name in _KNOWN_OTHERS.items():
        if key.endswith("." + ending) or f".{ending}." in key:
            return name
    return None


def unknown_keys(keys: list[str]) -> list[str]:
    """The keys of a file that are neither of a role we read nor a file setting, in order."""
    return [k for k in keys if split_key(k) is None and not is_file_setting(k)]


def refusal(path, keys: list[str], unknown: list[str]) -> str:
    """Why a file whose keys `unknown` (of all its `keys`) we cannot read is refused: the
    format decided over every key, naming the first key of a format we know of, else the
    first unknown key."""
    named = [(k, format_of_unknown(k)) for k in unknown]
    known = [(k, name) for k, name in named if name is not None]
    count = (f"{len(unknown)} of its {len(keys)} keys are" if len(unknown) > 1
             else f"1 of its {len(keys)} keys is")
    if known:
        key, name = known[0]
        formats = sorted({name for _, name in known})
        why = (f"{count} of no format we read; the first of a known format, {key!r}, is "
               f"{name}" + (f" (also found: {', '.join(f for f in formats if f != name)})"
                            if len(formats) > 1 else "") + ", a format this package does not read")
    elif len(unknown) == len(keys) and any(_looks_like_model_weight(k) for k in unknown):
        why = (f"none of its {len(keys)} keys is a LoRA key (the first, {unknown[0]!r}, looks "
               f"like a model's own weight: is this a full model rather than a LoRA?)")
    else:
        why = (f"{count} of no LoRA format this package reads; the first is {unknown[0]!r}"
               + (" (it looks like a model's own weight)" if _looks_like_model_weight(unknown[0])
                  else ""))
    return f"{path}: not a LoRA file we can read: {why}; we read {FORMATS_READ}"


def _looks_like_model_weight(key: str) -> bool:
    return key.endswith((".weight", ".bias")) or "." not in key
