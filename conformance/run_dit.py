"""Conformance of the DiT against a golden file of kind dit_wan21 / dit_wan22_ti2v."""

from __future__ import annotations

import torch

from ..wan.configs import DiTConfig
from ..wan.dit import WanDiT
from .golden_file import GoldenFile, OutputScore, score


def build(golden: GoldenFile) -> WanDiT:
    c = golden.config
    config = DiTConfig(
        in_dim=c["in_dim"], out_dim=c["out_dim"], dim=c["dim"], ffn_dim=c["ffn_dim"],
        num_heads=c["num_heads"], num_layers=c["num_layers"], freq_dim=c["freq_dim"],
        text_dim=c["text_dim"], text_len=c["text_len"], patch_size=tuple(c["patch_size"]),
        eps=c["eps"], qk_norm=c.get("qk_norm", True), cross_attn_norm=c.get("cross_attn_norm", True),
        image_embedding=c.get("model_type") in ("i2v", "flf2v") and "weights.img_emb.proj.0.weight"
        in golden.tensors,
        image_pos_embedding=c.get("model_type") == "flf2v")
    model = WanDiT(config)
    model.load_state_dict(golden.weights, strict=True)
    return model.eval()


def run(golden: GoldenFile) -> list[OutputScore]:
    model = build(golden)
    scores = []
    with torch.no_grad():
        for case in golden.cases():
            x, context = case.inputs["x"], case.inputs["context"]
            y = model(x, case.inputs["t"], context, clip_tokens=case.inputs.get("clip_fea"),
                      y=case.inputs.get("y"))
            scores.append(score(case.name, "y", y, case.expected["y"], golden.tolerance("y")))
            if "t_per_frame" in case.inputs:  # the same case with one timestep per latent frame
                y = model(x, case.inputs["t_per_frame"], context)
                scores.append(score(case.name, "y(t_per_frame)", y, case.expected["y"],
                                    golden.tolerance("y")))
    return scores
