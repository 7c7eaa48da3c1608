"""Conformance of the DiT against a golden file of kind dit_wan21 / dit_wan22_ti2v."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class DiTCheck:
    """One forward a golden file asks for and the output it is scored against."""
    case: str
    output: str  # the score's label
    inputs: dict  # keyword inputs of WanDiT.forward besides x, t and context
    x: torch.Tensor
    t: torch.Tensor
    context: torch.Tensor
    expected: torch.Tensor


def checks(golden: GoldenFile) -> list[DiTCheck]:
    out = []
    for case in golden.cases():
        x, context = case.inputs["x"], case.inputs["context"]
        extra = {"clip_tokens": case.inputs.get("clip_fea"), "y": case.inputs.get("y")}
        out.append(DiTCheck(case.name, "y", extra, x, case.inputs["t"], context,
                            case.expected["y"]))
        if "t_per_frame" in case.inputs:  # the same case with one timestep per latent frame
            out.append(DiTCheck(case.name, "y(t_per_frame)", {}, x, case.inputs["t_per_frame"],
                                context, case.expected["y"]))
    return out


def run(golden: GoldenFile) -> list[OutputScore]:
    model = build(golden)
    scores = []
    with torch.no_grad():
        for check in checks(golden):
            y = model(check.x, check.t, check.context, **check.inputs)
            scores.append(score(check.case, check.output, y, check.expected,
                                golden.tolerance("y")))
    return scores
