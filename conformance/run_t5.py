"""Conformance of the umT5 encoder against a golden file of kind umt5 (HF config and key names)."""

from __future__ import annotations

import torch

from ..wan.t5 import UMT5Encoder, state_dict_from_hf
from .golden_file import GoldenFile, OutputScore, score

# what this encoder implements; other T5 variants would be silently wrong, so they are refused
_SUPPORTED_FFN = ("gated-gelu",)


def build(golden: GoldenFile) -> UMT5Encoder:
    c = golden.config
    ffn = c.get("feed_forward_proj", "gated-gelu")
    if ffn not in _SUPPORTED_FFN:
        raise ValueError(f"feed_forward_proj {ffn!r} is not supported (only {_SUPPORTED_FFN})")
    if c.get("per_layer_relative_bias") is False:
        raise ValueError("a relative-position bias shared across layers (T5) is not umT5")
    # HF's attention width is d_kv per head (inner_dim), which need not equal d_model
    dim_attn = c["d_kv"] * c["num_heads"] if "d_kv" in c else c["inner_dim"]
    model = UMT5Encoder(
        vocab_size=c["vocab_size"], dim=c["d_model"], dim_attn=dim_attn,
        dim_ffn=c["d_ff"], num_heads=c["num_heads"], num_layers=c["num_layers"],
        num_buckets=c["relative_attention_num_buckets"],
        max_distance=c["relative_attention_max_distance"], eps=c["layer_norm_epsilon"])
    model.load_state_dict(state_dict_from_hf(golden.weights), strict=True)
    return model.float().eval()


def run(golden: GoldenFile) -> list[OutputScore]:
    model = build(golden)
    scores = []
    with torch.no_grad():
        for case in golden.cases():
            mask = case.inputs["mask"]
            hidden = model(case.inputs["ids"], mask)
            scores.append(score(case.name, "hidden", hidden, case.expected["hidden"],
                                golden.tolerance("hidden"), mask=mask))
    return scores
