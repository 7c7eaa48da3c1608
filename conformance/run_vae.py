"""Scores our Wan2.1 / Wan2.2 VAE against a golden file of kind "vae21" or "vae22".

The model is built from the file's config and loaded strictly from its weights, in float32 on the
CPU. Per case: the input video is encoded and scored as `latent_raw` (mu) and `latent` (normalised
with the file's own const.latents_mean/std); the stored latent named by the case's `decode_input`
is de-normalised, decoded and scored as `decoded` (before any clamping).
"""

from __future__ import annotations

import math

import torch

from ..wan.latent_format import denormalise_latent, normalise_latent
from ..wan.vae21 import WanVAE21
from ..wan.vae22 import WanVAE22
from .golden_file import GoldenFile, GoldenFileError, OutputScore, score

MODEL_CLASSES = {"vae21": WanVAE21, "vae22": WanVAE22}


def build_model(golden: GoldenFile) -> torch.nn.Module:
    if golden.kind not in MODEL_CLASSES:
        raise GoldenFileError(f"{golden.path}: kind {golden.kind!r} is not a VAE "
                              f"({', '.join(MODEL_CLASSES)})")
    model = MODEL_CLASSES[golden.kind](**golden.config)
    model.load_state_dict(golden.weights, strict=True)
    return model.to(device="cpu", dtype=torch.float32).eval()


def run(golden: GoldenFile) -> list[OutputScore]:
    model = build_model(golden)
    mean = golden.tensor("const.latents_mean")
    std = golden.tensor("const.latents_std")
    scores: list[OutputScore] = []
    for case in golden.cases():
        produced: dict[str, torch.Tensor] = {}
        mu = model.encode(case.inputs["video"].float())
        produced["latent_raw"] = mu
        produced["latent"] = normalise_latent(mu, mean, std)
        stored_latent = golden.tensor(case.meta.get("decode_input", case.meta["outputs"]["latent"]))
        produced["decoded"] = model.decode(denormalise_latent(stored_latent, mean, std))

        for name, expected in case.expected.items():
            tolerance = golden.tolerance(name)
            if name in produced:
                scores.append(score(case.name, name, produced[name], expected, tolerance))
            else:
                scores.append(OutputScore(case.name, name, math.inf, math.inf, tolerance, False,
                                          "not produced by the VAE runner"))
    return scores
