"""Real-size random-weight model sets for benchmarks, in two layouts.

Each set is written once into a cache folder and reused, under a ComfyUI-style models root:
- official (ModelSet): `diffusion_models/` holds the official DiT folder (config.json, shards and
  their index, as the releases ship), `vae/` the official VAE `.pth`, and `text_encoders/` the
  official umT5 `.pth` with the `google/umt5-xxl/` tokenizer folder beside it;
- ComfyUI's repackaged files (ComfySet), under the names ComfyUI's templates and our distill
  workflows use, which ComfyUI's own loaders read as well as ours: one DiT file per expert
  (fp16 or fp8-scaled), the umT5 in HF names with its tokenizer embedded, the VAE, and
  step-distill LoRAs in LightX2V's extractor layout (rank 64, bf16).
Weights are drawn on the GPU when there is one (seconds for billions of values) and stored in
bf16 (the VAE in float32, as released) unless a file's name says otherwise.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic_files import atomic_target
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


@dataclass(frozen=True)
class ComfySet:
    """Files in ComfyUI's layout under the names the workflows give them."""
    dits: tuple[tuple[str, str, str], ...]  # (file, KNOWN_DITS name, storage: fp16 | fp8_scaled)
    vae_kind: str
    vae_file: str
    loras: tuple[tuple[str, str], ...]  # (file, KNOWN_DITS name): LightX2V layout, rank 64
    text_encoder_file: str = "umt5_xxl_fp16.safetensors"


MODEL_SETS = {
    "wan2.2-ti2v-5b": ModelSet("wan2.2-ti2v-5b", "Wan2.2-TI2V-5B", "vae22", "Wan2.2_VAE.pth"),
    "wan2.1-t2v-1.3b": ModelSet("wan2.1-t2v-1.3b", "Wan2.1-T2V-1.3B", "vae21", "Wan2.1_VAE.pth"),
    "comfy-ti2v-5b-distill": ComfySet(
        (("wan2.2_ti2v_5B_fp16.safetensors", "wan2.2-ti2v-5b", "fp16"),), "vae22",
        "wan2.2_vae.safetensors",
        (("wan2.2_ti2v_5b_lightx2v_4step_lora_rank64.safetensors", "wan2.2-ti2v-5b"),)),
    "comfy-t2v-14b-distill": ComfySet(
        (("wan2.1_t2v_14B_fp8_scaled.safetensors", "wan2.1-t2v-14b", "fp8_scaled"),), "vae21",
        "wan_2.1_vae.safetensors",
        (("lightx2v_t2v_14b_cfg_step_distill_v2_lora_rank64_bf16.safetensors",
          "wan2.1-t2v-14b"),)),
    # the Wan2.2 T2V A14B experts have the Wan2.1 T2V-14B architecture
    "comfy-t2v-a14b-distill": ComfySet(
        (("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.1-t2v-14b", "fp8_scaled"),
         ("wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", "wan2.1-t2v-14b", "fp8_scaled")),
        "vae21", "wan_2.1_vae.safetensors",
        (("wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", "wan2.1-t2v-14b"),
         ("wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors", "wan2.1-t2v-14b"))),
}
LORA_RANK = 64


def _draw_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_model_set(root: str | Path, name: str, log=print,
                     tiny: bool = False) -> ModelSet | ComfySet:
    """Write the set's missing files under `root`; returns the set (file names for overrides).

    tiny=True writes the same files with tiny random models (a smoke test of the whole command
    on a CPU)."""
    if isinstance(MODEL_SETS[name], ComfySet):
        return _ensure_comfy_set(Path(root), MODEL_SETS[name], log, tiny)
    from ..wan.dit import WanDiT
    from ..wan.tiny_tokenizer import write_tokenizer_folder

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

    _ensure_vae(root / "vae" / model_set.vae_file, model_set.vae_kind, draw, log, tiny)
    te_path = root / "text_encoders" / model_set.text_encoder_file
    _ensure_text_encoder(te_path, "official", draw, log, tiny)
    tokenizer_dir = te_path.parent / "google" / "umt5-xxl"
    if not (tokenizer_dir / "tokenizer.json").is_file():  # written last
        write_tokenizer_folder(tokenizer_dir)
    return model_set


def _tiny_dit(known: str):
    return TINY_DIT["ti2v" if KNOWN_DITS[known].config.out_dim == 48 else "t2v"]


def _ensure_comfy_set(root: Path, model_set: ComfySet, log, tiny: bool) -> ComfySet:
    from ..checkpoints.tiny import fp8_scaled
    from ..lora.tiny import lightx2v_lora, write_lora
    from ..wan.dit import WanDiT

    draw = _draw_device()
    for seed, (file, known, storage) in enumerate(model_set.dits, 1):
        path = root / "diffusion_models" / file
        if path.is_file():
            continue
        log(f"writing a random {known} DiT ({storage}, ComfyUI's layout) to {path}")
        config = _tiny_dit(known) if tiny else KNOWN_DITS[known].config
        with torch.device("meta"):
            module = WanDiT(config)
        dtype = torch.float16 if storage == "fp16" else torch.bfloat16
        state = randomize(module, seed, draw, dtype, keep_on_device=True)
        del module
        prefixed = {f"model.diffusion_model.{k}": v for k, v in state.items()}
        del state
        if storage == "fp8_scaled":
            prefixed = fp8_scaled(prefixed)  # on the drawing device: seconds at 14B
        prefixed = {k: v.cpu().contiguous() for k, v in prefixed.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_target(path, path.name) as temp:
            save_file(prefixed, str(temp))
        del prefixed
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for seed, (file, known) in enumerate(model_set.loras, 11):
        path = root / "loras" / file
        if not path.is_file():
            log(f"writing a random {known} step-distill LoRA (LightX2V's layout) to {path}")
            config = _tiny_dit(known) if tiny else KNOWN_DITS[known].config
            path.parent.mkdir(parents=True, exist_ok=True)
            write_lora(path, lightx2v_lora(config, seed, rank=4 if tiny else LORA_RANK),
                       "lightx2v", dtype=torch.bfloat16)
    _ensure_vae(root / "vae" / model_set.vae_file, model_set.vae_kind, draw, log, tiny)
    _ensure_text_encoder(root / "text_encoders" / model_set.text_encoder_file, "hf", draw, log,
                         tiny)
    return model_set


def _ensure_vae(path: Path, kind: str, draw: str, log, tiny: bool) -> None:
    from ..wan.vae21 import WanVAE21
    from ..wan.vae22 import WanVAE22

    if path.is_file():
        return
    log(f"writing a random {kind} VAE to {path}")
    with torch.device("meta"):
        module = (WanVAE22 if kind == "vae22" else WanVAE21)(**(TINY_VAE[kind] if tiny else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_vae(path, kind, "official", state=randomize(module, 2, draw))
    gc.collect()


def _ensure_text_encoder(path: Path, layout: str, draw: str, log, tiny: bool) -> None:
    """umT5-xxl in the official layout (its tokenizer folder beside it, written by the caller)
    or in HF names with the tokenizer embedded, as ComfyUI's files hold it."""
    from ..wan.t5 import UMT5Encoder
    from ..wan.tiny_tokenizer import build_spiece_model

    if path.is_file():
        return
    log(f"writing a random umT5-xxl encoder ({layout} layout) to {path}")
    with torch.device("meta"):
        module = UMT5Encoder.from_config(TINY_T5 if tiny else KNOWN_T5["umt5-xxl"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_encoder(path, layout, dtype=torch.bfloat16,
                       state=randomize(module, 3, draw, torch.bfloat16),
                       spiece_model=build_spiece_model() if layout == "hf" else None)
    gc.collect()
