"""The tiny model folders several test files share (written once per session by the fixtures in
conftest.py): one Wan2.2 TI2V-5B set, and one set holding every model kind."""

from pathlib import Path

from wan_enhanced.checkpoints import tiny

# the TI2V-5B set: file names in its folders
DIT, VAE, TE = "dit.safetensors", "vae.safetensors", "te.safetensors"

# the set of every kind: (DiT, VAE) per kind, the text encoder and the CLIP vision encoder
NAMES = {"ti2v": ("tiny_ti2v.safetensors", "tiny_vae22.safetensors"),
         "t2v": ("tiny_t2v.safetensors", "tiny_vae21.safetensors"),
         "i2v_a14b": ("tiny_i2v_a14b.safetensors", "tiny_vae21.safetensors"),
         "i2v": ("tiny_i2v.safetensors", "tiny_vae21.safetensors")}
ALL_TE = "tiny_umt5.safetensors"
CLIP = "tiny_clip_vision_h.safetensors"
# the tiny Wan2.1 I2V DiT takes 64-wide image tokens
TINY_CLIP = dict(hidden=64, layers=2, heads=1, intermediate=128, image_size=28, patch=14)


def write_ti2v_set(root: Path) -> Path:
    return tiny.write_models_folder(root, dit_name=DIT, vae_name=VAE, text_encoder_name=TE,
                                    kind="ti2v")


def write_all_kinds(root: Path) -> Path:
    for kind, (dit, vae) in NAMES.items():
        tiny.write_models_folder(root, dit_name=dit, vae_name=vae, text_encoder_name=ALL_TE,
                                 kind=kind)
    (root / "clip_vision").mkdir()
    tiny.write_clip_vision(root / "clip_vision" / CLIP, TINY_CLIP)
    return root
