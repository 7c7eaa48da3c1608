"""Writes the inputs of the LoRA conformance data (tests/data/lora/): a tiny random Wan DiT in
ComfyUI's layout (float32, and the same weights in bf16), random LoRA files in every key format
we read, and cases.json, the LoRA chains (file, strength, base) whose merged weights
conformance/make_lora_reference.py then computes with ComfyUI's own LoRA code, and
conformance/make_peft_dora_reference.py with PEFT's.

    python -m wan_enhanced.conformance.lora_inputs tests/data/lora

ComfyUI reads the kohya, Wan Fun, prefixed generic and full-difference names, LoHa, LoKr and
kohya DoRA, OFT, BOFT, GLoRA and weight replacements, but not the bare official names, diffusers' names, LyCORIS module names, PEFT's
lora_B bias or LightX2V's `.diff_m`: a file in one of those holds the same content as a file
ComfyUI reads (its `twin`: the diffusers names as generic names, `lycoris_` names as
`diffusion_model.` names, a lora_B bias as a `.diff_b`, a `blocks.N.diff_m` as
`blocks.N.modulation.diff`), and the reference merges the twin. PEFT's DoRA magnitudes
(lora_magnitude_vector), which ComfyUI does not read, are merged by PEFT itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

import torch

from ..atomic_files import atomic_target, write_atomically
from ..checkpoints.tiny import random_dit_state
from ..lora.keymap import dit_shapes
from ..lora.tiny import (LoraContent, add_dora, block_modules, lightx2v_lora, merged_content,
                         random_boft, random_glora, random_lokr, random_loha, random_lora,
                         random_oft, write_lora)
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


# LightX2V's extractor's rule (lora/tiny.py lightx2v_lora) at the tiny model's scale
LIGHTX2V_PAIR_MIN = 1500


def peft_bias_contents(seed: int) -> tuple[LoraContent, LoraContent]:
    """PEFT pairs with lora_B biases (lora_bias=True), and their twin: the biases as .diff_b."""
    modules = [m for m in block_modules(CONFIG, blocks=[1]) if ".self_attn." in m]
    content = random_lora(CONFIG, seed=seed, modules=modules, rank=4)
    gen = torch.Generator().manual_seed(seed + 1)
    shapes = dit_shapes(CONFIG)
    content.up_bias = {m: 0.05 * torch.randn(shapes[f"{m}.bias"], generator=gen)
                       for m in modules}
    twin = LoraContent(pairs=dict(content.pairs),
                       diffs={f"{m}.bias": b for m, b in content.up_bias.items()})
    return content, twin


def contents(base: dict[str, torch.Tensor]):
    """name -> (content, format, twin or None): the LoRA files of the data."""
    partial = [m for m in block_modules(CONFIG, blocks=[0]) if ".cross_attn." not in m]
    ranks = {m: (6 if ".ffn." in m else 2) for m in partial + NON_BLOCK}
    generic = random_lora(CONFIG, seed=11, modules=partial + NON_BLOCK, rank=ranks, alpha=3.0)
    distill = random_lora(CONFIG, seed=12, rank=8, alpha=8.0, diffs=DISTILL_DIFFS)
    lightx2v = lightx2v_lora(CONFIG, seed=15, rank=8, pair_min=LIGHTX2V_PAIR_MIN)
    loha_modules = partial + ["text_embedding.0"]
    loha = add_dora(random_loha(CONFIG, seed=16, modules=loha_modules, rank=4, alpha=2.0),
                    base, seed=17, modules=loha_modules[:2])
    add_dora(loha, base, seed=18, modules=[loha_modules[2]], axis="columns")
    block1 = block_modules(CONFIG, blocks=[1])
    layouts = {m: ("w2_ab", "w1_ab", "both_ab", "whole")[i % 4] for i, m in enumerate(block1)}
    lokr = add_dora(random_lokr(CONFIG, seed=19, modules=block1 + ["time_projection.1"],
                                factor=4, rank=3, alpha=4.0, layouts=layouts),
                    base, seed=20, modules=[block1[1]])
    dora = add_dora(random_lora(CONFIG, seed=21, modules=block1, rank=4, alpha=3.0), base,
                    seed=22, modules=block1[:5])
    add_dora(dora, base, seed=23, modules=block1[5:], axis="columns")
    peft_bias, peft_bias_twin = peft_bias_contents(seed=24)
    block0 = block_modules(CONFIG, blocks=[0])
    peft_dora = add_dora(random_lora(CONFIG, seed=26, modules=block0, rank=4), base, seed=27,
                         modules=block0, style="lora_magnitude_vector")
    # OFT on block 1: the attentions free, the feed-forward under a norm constraint small
    # enough to scale its blocks down
    attention = [m for m in block1 if ".ffn." not in m]
    oft = merged_content(random_oft(CONFIG, seed=28, modules=attention, block_size=8),
                         random_oft(CONFIG, seed=29, modules=[m for m in block1
                                                              if ".ffn." in m],
                                    block_size=16, constraint=0.05))
    replaced = random_lora(CONFIG, seed=30, modules=["blocks.1.self_attn.k"], rank=2)
    gen = torch.Generator().manual_seed(31)
    replaced.replacements = {m: 0.1 * torch.randn(dit_shapes(CONFIG)[f"{m}.weight"],
                                                  generator=gen)
                             for m in ("blocks.0.norm3", "blocks.1.ffn.2")}
    glora = random_glora(CONFIG, seed=32, modules=[m for m in block0 if ".self_attn." in m],
                         rank=4, alpha=2.0)
    # BOFT: two butterfly levels on the cross-attention (alpha 0: no constraint; ComfyUI fails
    # on a BOFT module without an alpha and leaves it out), three with a constraint and a
    # rescale on the first feed-forward matrix
    boft = merged_content(
        random_boft(CONFIG, seed=33, modules=[m for m in block0 if ".cross_attn." in m],
                    levels=2, block_size=8, constraint=0.0),
        random_boft(CONFIG, seed=34, modules=["blocks.0.ffn.0"], levels=3, block_size=8,
                    constraint=0.05, rescale=True))
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
        "lightx2v": (lightx2v, "lightx2v", "lightx2v_twin"),
        "lightx2v_twin": (lightx2v, "generic_down_up", None),
        "loha": (loha, "kohya", None),
        "lokr": (lokr, "generic", None),
        "lycoris": (lokr, "lycoris_diffusers", "lokr"),
        "dora": (dora, "kohya", None),
        "peft_bias": (peft_bias, "diffusers", "peft_bias_twin"),
        "peft_bias_twin": (peft_bias_twin, "generic", None),
        "peft_dora": (peft_dora, "diffusers", None),
        "oft": (oft, "kohya", None),
        "set": (replaced, "generic", None),
        "glora": (glora, "kohya", None),
        "boft": (boft, "generic", None),
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
    "lightx2v": [("lightx2v", 1.0)],
    "loha": [("loha", 0.8)],
    "lokr": [("lokr", 1.0)],
    "lycoris": [("lycoris", -0.5)],
    "dora": [("dora", 1.0)],
    "dora_strength": [("dora", 0.6)],
    "peft_bias": [("peft_bias", 1.3)],
    "stack_lycoris": [("kohya", 0.8), ("dora", 0.7), ("loha", 1.0), ("lokr", -0.4),
                      ("lightx2v", 1.0)],
    "oft": [("oft", 1.0)],
    "oft_strength": [("oft", 0.7)],
    "stack_oft": [("kohya", 0.5), ("oft", 0.8), ("lokr", 1.0)],
    "set": [("kohya", 0.6), ("set", 0.5)],
    "glora": [("glora", 1.0)],
    "glora_strength": [("glora", -0.6)],
    "boft": [("boft", 1.0)],
    "boft_strength": [("boft", 0.7)],
    "stack_butterfly": [("lokr", 0.5), ("boft", 0.9), ("glora", 1.0)],
}
# the same chains on the base's weights in bf16 (ComfyUI computes on them in float32)
BF16_CASES = ("lightx2v", "loha", "lokr", "dora_strength", "stack_lycoris", "oft_strength",
              "stack_butterfly")
# merged by PEFT (strength 1: PEFT has no strength), not by ComfyUI
PEFT_CASES = {"peft_dora": [("peft_dora", 1.0)]}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    base = random_dit_state(CONFIG, 7)
    for name, dtype in (("base", torch.float32), ("base_bf16", torch.bfloat16)):
        state = {f"model.diffusion_model.{k}": v.to(dtype) for k, v in base.items()}
        with atomic_target(out / f"{name}.safetensors") as temp:
            save_file(state, str(temp), metadata={"config": json.dumps({"num_heads": 2})})
    twins = {}
    for name, (content, fmt, twin) in contents(base).items():
        write_lora(out / f"{name}.safetensors", content, fmt)
        twins[name] = twin or name

    def case(chain, base_file="base.safetensors"):
        return {"loras": [[f"{n}.safetensors", s] for n, s in chain],
                "comfyui_reads": [[f"{twins[n]}.safetensors", s] for n, s in chain],
                "base": base_file}
    cases = {name: case(chain) for name, chain in CASES.items()}
    cases.update({f"{name}_bf16": case(CASES[name], "base_bf16.safetensors")
                  for name in BF16_CASES})
    peft = {name: case(chain) for name, chain in PEFT_CASES.items()}
    description = {"unet_config": UNET_CONFIG, "base": "base.safetensors", "cases": cases,
                   "peft_cases": peft}
    write_atomically(out / "cases.json", json.dumps(description, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
