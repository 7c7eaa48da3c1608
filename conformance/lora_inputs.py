"""Writes the inputs of the LoRA conformance data (tests/data/lora/): a tiny random Wan DiT in
ComfyUI's layout, random LoRA files in every key format we read, and cases.json, the LoRA
chains (file, strength) whose merged weights conformance/make_lora_reference.py then computes
with ComfyUI's own LoRA code.

    python -m wan_enhanced.conformance.lora_inputs tests/data/lora

ComfyUI reads the kohya, Wan Fun, prefixed generic and full-difference names but not the bare
official names or diffusers' names: a file in one of those holds the same content as a file in
a format ComfyUI reads (its `twin`), and the reference merges the twin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from ..atomic_files import atomic_target, write_atomically
from ..checkpoints.tiny import random_dit_state
from ..lora.tiny import block_modules, random_lora, write_lora
from ..wan.configs import DiTConfig

# head_dim 16: ComfyUI gets the head count from cases.json, our loader from the file's metadata
CONFIG = DiTConfig(name="lora-conformance", dim=32, ffn_dim=64, num_heads=2, num_layers=2,
                   text_dim=16, freq_dim=32)
UNET_CONFIG = {"image_model": "wan2.1", "model_type": "t2v", "dim": 32, "ffn_dim": 64,
               "num_heads": 2, "num_layers": 2, "text_dim": 16, "freq_dim": 32, "in_dim": 16,
               "out_dim": 16, "patch_size": [1, 2, 2], "eps": 1e-6}

NON_BLOCK = ["text_embedding.0", "time_projection.1", "head.head", "patch_embedding"]
DISTILL_DIFFS = ("blocks.0.modulation", "blocks.1.modulation", "head.modulation",
                 "blocks.0.norm3.weight", "blocks.0.norm3.bias", "blocks.1.self_attn.norm_q.weight",
                 "blocks.0.ffn.0.bias", "blocks.1.cross_attn.o.bias", "patch_embedding.weight",
                 "patch_embedding.bias")


def contents():
    """name -> (content, format, twin or None): the LoRA files of the data."""
    partial = [m for m in block_modules(CONFIG, blocks=[0]) if ".cross_attn." not in m]
    ranks = {m: (6 if ".ffn." in m else 2) for m in partial + NON_BLOCK}
    generic = random_lora(CONFIG, seed=11, modules=partial + NON_BLOCK, rank=ranks, alpha=3.0)
    distill = random_lora(CONFIG, seed=12, rank=8, alpha=8.0, diffs=DISTILL_DIFFS)
    return {
        "kohya": (random_lora(CONFIG, seed=13, rank=4, alpha=2.0,
                              diffs=("blocks.0.norm3.weight", "blocks.1.cross_attn.o.bias")),
                  "kohya", None),
        # ComfyUI converts Wan Fun names only when block 0's cross-attention key is there
        "kohya_fun": (random_lora(CONFIG, seed=14, rank=3), "kohya_fun", None),
        "generic": (generic, "generic", None),
        "distill": (distill, "generic_down_up", None),
        "bare": (generic, "bare", "generic"),
        "diffusers": (distill, "diffusers", "distill"),
    }


CASES = {
    "kohya": [("kohya", 1.0)],
    "kohya_fun": [("kohya_fun", 0.7)],
    "generic": [("generic", 0.5)],
    "distill": [("distill", 1.0)],
    "bare": [("bare", -0.8)],
    "diffusers": [("diffusers", 1.25)],
    "stack": [("kohya", 0.8), ("distill", 1.0), ("generic", -0.3), ("kohya_fun", 1.5)],
    "stack_unread_by_comfyui": [("diffusers", 0.6), ("bare", 0.4)],
}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    state = {f"model.diffusion_model.{k}": v for k, v in random_dit_state(CONFIG, 7).items()}
    with atomic_target(out / "base.safetensors") as temp:
        save_file(state, str(temp), metadata={"config": json.dumps({"num_heads": 2})})
    twins = {}
    for name, (content, fmt, twin) in contents().items():
        write_lora(out / f"{name}.safetensors", content, fmt)
        twins[name] = twin or name
    cases = {case: {"loras": [[f"{n}.safetensors", s] for n, s in chain],
                    "comfyui_reads": [[f"{twins[n]}.safetensors", s] for n, s in chain]}
             for case, chain in CASES.items()}
    description = {"unet_config": UNET_CONFIG, "base": "base.safetensors", "cases": cases}
    write_atomically(out / "cases.json", json.dumps(description, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
