"""Real-size random-weight model sets in the official release layout, for benchmarks.

Each set is written once into a cache folder and reused: a ComfyUI-style models root whose
`diffusion_models/` holds the official DiT folder (config.json, shards and their index, as the
releases ship), `vae/` the official VAE `.pth`, and `text_encoders/` the official umT5 `.pth`
with the `google/umt5-xxl/` tokenizer folder beside it. Weights are drawn on the GPU when there
is one (seconds for billions of values) and stored in bf16 (the VAE in float32, as released).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.tiny import (TINY_DIT, TINY_T5, TINY_VAE, randomize, write_dit,
                               write_text_encoder, write_vae)
from ..wan.configs import KNOWN_DITS, KNOWN_T5


@dataclass(frozen=True)
class ModelSet:
    dit_config: str  # a KNOWN_DITS name
    dit_folder: str
    vae_kind: str
    vae_file: str

    text_encoder_file: str = "models_t5_umt5-xxl-enc-bf16.pth"


MODEL_SETS = {
    "wan2.2-ti2v-5b": ModelSet("wan2.2-ti2v-5b", "Wan2.2-TI2V-5B", "vae22", "Wan2.2_VAE.pth"),
    "wan2.1-t2v-1.3b": ModelSet("wan2.1-t2v-1.3b", "Wan2.1-T2V-1.3B", "vae21", "Wan2.1_VAE.pth"),
}


def _draw_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_model_set(root: str | Path, name: str, log=print, tiny: bool = False) -> ModelSet:
    """Write the set's missing files under `root`; returns the set (file names for overrides).

    tiny=True writes the same files with tiny random models (a smoke test of the whole command
    on a CPU)."""
    from ..wan.dit import WanDiT
    from ..wan.t5 import UMT5Encoder
    from ..wan.tiny_tokenizer import write_tokenizer_folder
    from ..wan.vae21 import WanVAE21
    from ..wan.vae22 import WanVAE22

    model_set = MODEL_SETS[name]
    root = Path(root)
    draw = _draw_device()

    dit_dir = root / "diffusion_models" / model_set.dit_folder
    if not (dit_dir / "config.json").is_file():
        log(f"writing a random {name} DiT (official layout) to {dit_dir}")
        config = KNOWN_DITS[model_set.dit_config].config
        if tiny:
            config = TINY_DIT["ti2v" if model_set.vae_kind == "vae22" else "t2v"]
        with torch.device("meta"):
            module = WanDiT(config)
        write_dit(dit_dir, config, "sharded", state=randomize(module, 1, draw, torch.bfloat16),
                  dtype=torch.bfloat16)
        gc.collect()

    vae_path = root / "vae" / model_set.vae_file
    if not vae_path.is_file():
        log(f"writing a random {model_set.vae_kind} VAE to {vae_path}")
        with torch.device("meta"):
            widths = TINY_VAE[model_set.vae_kind] if tiny else {}
            module = (WanVAE22 if model_set.vae_kind == "vae22" else WanVAE21)(**widths)
        write_vae(vae_path, model_set.vae_kind, "official", state=randomize(module, 2, draw))
        gc.collect()

    te_path = root / "text_encoders" / model_set.text_encoder_file
    if not te_path.is_file():
        log(f"writing a random umT5-xxl encoder to {te_path}")
        with torch.device("meta"):
            module = UMT5Encoder.from_config(TINY_T5 if tiny else KNOWN_T5["umt5-xxl"])
        write_text_encoder(te_path, "official", dtype=torch.bfloat16,
                           state=randomize(module, 3, draw, torch.bfloat16))
        gc.collect()
    tokenizer_dir = te_path.parent / "google" / "umt5-xxl"
    if not (tokenizer_dir / "tokenizer.json").is_file():  # written last
        write_tokenizer_folder(tokenizer_dir)
    return model_set
