"""Computes the PEFT DoRA reference (tests/data/lora/reference_peft.safetensors) with PEFT's own
code, from the inputs conformance/lora_inputs.py wrote: ComfyUI does not read PEFT's DoRA
magnitudes (`lora_magnitude_vector`), so PEFT itself is the reference for them.

    python conformance/make_peft_dora_reference.py tests/data/lora

Runs in a Python environment with torch, safetensors and peft installed (it imports nothing of
this package). For each case of cases.json's "peft_cases" (strength 1: PEFT has no strength)
and each module the case's file patches, it builds a torch.nn.Linear holding the base's weight
and bias (float32), wraps it with peft's LoraConfig(use_dora=True, r = the file's rank,
lora_alpha = r: PEFT files carry no alpha, so the scale is 1), loads the file's lora_A,
lora_B and lora_magnitude_vector into the adapter, merges it (merge_and_unload) and stores the
merged weight as `CASE/official.name`, float32. The file's keys are diffusers names
(transformer.blocks.N.attn1.to_q...), mapped to the official names by the table below.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# diffusers' block module names -> the official ones, for the modules the data patches
BLOCK_NAMES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_magnitude_vector": "m"}


def official(module: str) -> str:
    found = re.match(r"transformer\.blocks\.(\d+)\.(.+)$", module)
    if found is None or found.group(2) not in BLOCK_NAMES:
        raise ValueError(f"{module}: not a block module of the data")
    return f"blocks.{found.group(1)}.{BLOCK_NAMES[found.group(2)]}"


def merged_by_peft(torch, peft, weight, bias, down, up, magnitude):
    out_features, in_features = weight.shape
    holder = torch.nn.Module()
    holder.layer = torch.nn.Linear(in_features, out_features, bias=bias is not None)
    with torch.no_grad():
        holder.layer.weight.copy_(weight)
        if bias is not None:
            holder.layer.bias.copy_(bias)
    rank = down.shape[0]
    config = peft.LoraConfig(r=rank, lora_alpha=rank, use_dora=True, target_modules=["layer"],
                             init_lora_weights=False)
    model = peft.get_peft_model(holder, config)
    layer = model.base_model.model.layer
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(down)
        layer.lora_B["default"].weight.copy_(up)
        layer.lora_magnitude_vector["default"].weight.copy_(magnitude)
    return model.merge_and_unload().layer.weight.detach().clone()


def main(argv: list[str]) -> int:
    data = Path(argv[0])
    import peft
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    description = json.loads((data / "cases.json").read_text())
    out = {}
    for case, spec in description["peft_cases"].items():
        with safe_open(str(data / spec["base"]), "pt") as f:
            base = {k.removeprefix("model.diffusion_model."): f.get_tensor(k) for k in f.keys()}
        (name, strength), = spec["loras"]
        if strength != 1.0:
            raise ValueError(f"{case}: PEFT merges at strength 1 only")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        with safe_open(str(data / name), "pt") as f:
            for key in f.keys():
                suffix = next(s for s in SUFFIXES if key.endswith(s))
                parts.setdefault(official(key[:-len(suffix)]), {})[SUFFIXES[suffix]] = \
                    f.get_tensor(key).float()
        for module, part in parts.items():
            weight = base[f"{module}.weight"].float()
            bias = base.get(f"{module}.bias")
            out[f"{case}/{module}.weight"] = merged_by_peft(
                torch, peft, weight, None if bias is None else bias.float(), part["A"],
                part["B"], part["m"]).contiguous()
        print(f"{case}: {len(parts)} weights merged")
    metadata = {"reference": f"PEFT {peft.__version__}: LoraConfig(use_dora=True) + "
                             f"merge_and_unload, float32 CPU"}
    save_file(out, str(data / "reference_peft.safetensors"), metadata=metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
