"""Computes the LoRA conformance reference (tests/data/lora/reference.safetensors) with
ComfyUI's own LoRA code, from the inputs conformance/lora_inputs.py wrote.

    COMFYUI/venv/bin/python conformance/make_lora_reference.py COMFYUI_DIR tests/data/lora

The committed reference was made with ComfyUI 0.3.64 (a125cd84); ComfyUI 0.30.0 (6db4fa2f)
computes the same bits for every case.

Runs in ComfyUI's Python environment with ComfyUI's source folder COMFYUI_DIR on the path (it
imports nothing of this package). For each case of cases.json it builds ComfyUI's Wan model
(comfy.supported_models.WAN21_T2V, the tiny unet_config of cases.json, on the CPU, in the dtype
of the case's base file: float32 or bf16), loads the base into it, applies the case's LoRA chain the way ComfyUI's LoraLoader
does (comfy.utils.load_torch_file, comfy.sd.load_lora_for_models, which runs
comfy.lora_convert.convert_lora, comfy.lora.model_lora_keys_unet and comfy.lora.load_lora and
adds the patches), computes every patched weight as ModelPatcher.patch_weight_to_device does
(comfy.lora.calculate_weight and the weight adapters on a float32 copy) and stores it as
`CASE/official.name`, float32.

On a bf16 base the weights are ComfyUI's float32 result before its patcher rounds them back to
bf16 (stochastically, seeded per key).

calculate_weight is called directly rather than through ModelPatcher.patch_model: at the
ComfyUI commit this was made with, the patcher patches only the parameters of leaf modules, so
the `.diff` of a block's or the head's `modulation` (parameters of non-leaf modules) is accepted
by load_lora but never applied; the generator prints those keys and names them in the file's
metadata. This package applies them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _import_comfy(comfy_dir: Path):
    sys.path.insert(0, str(comfy_dir))
    from comfy.cli_args import args

    args.cpu = True  # before comfy.model_management is imported
    import comfy.lora
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import comfy.utils
    return comfy


def _model(comfy, torch, unet_config: dict, base: dict):
    config = dict(unet_config, patch_size=tuple(unet_config["patch_size"]))
    model_config = comfy.supported_models.WAN21_T2V(config)
    dtype = next(v.dtype for k, v in base.items() if k.endswith("blocks.0.ffn.0.weight"))
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({})
    model.load_model_weights(dict(base), "model.diffusion_model.")
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def main(argv: list[str]) -> int:
    comfy_dir, data = Path(argv[0]), Path(argv[1])
    comfy = _import_comfy(comfy_dir)
    import torch
    from safetensors.torch import save_file

    description = json.loads((data / "cases.json").read_text())
    bases = {}
    model_prefix = "diffusion_model."
    out, unpatched = {}, set()
    for case, spec in description["cases"].items():
        name = spec.get("base", description["base"])
        if name not in bases:
            bases[name] = comfy.utils.load_torch_file(str(data / name), safe_load=True)
        patcher = _model(comfy, torch, description["unet_config"], bases[name])
        for lora_name, strength in spec["comfyui_reads"]:
            lora = comfy.utils.load_torch_file(str(data / lora_name), safe_load=True)
            patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
        state = patcher.model.state_dict()
        merged = {}
        for key, patches in patcher.patches.items():
            weight = state[key].to(torch.float32, copy=True)
            merged[key] = comfy.lora.calculate_weight(patches, weight, key)
            out[f"{case}/{key.removeprefix(model_prefix)}"] = merged[key].contiguous()
        patcher.patch_model(device_to=torch.device("cpu"))
        patched = patcher.model.state_dict()
        # (on a bf16 base the patcher rounds the float32 result stochastically: the reference
        # keeps the float32 result, and only float32 bases are checked for left-out keys)
        missed = sorted(k.removeprefix(model_prefix) for k in merged
                        if state[k].dtype == torch.float32
                        and not torch.equal(patched[k].float(), merged[k]))
        unpatched.update(missed)
        print(f"{case}: {len(merged)} weights patched"
              + (f"; left unpatched by ModelPatcher.patch_model: {missed}" if missed else ""))
    commit = subprocess.run(["git", "-C", str(comfy_dir), "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    metadata = {"reference": f"ComfyUI {commit or 'unknown commit'}: load_lora_for_models + "
                             f"calculate_weight, float32 CPU",
                "unpatched_by_model_patcher": json.dumps(sorted(unpatched))}
    save_file(out, str(data / "reference.safetensors"), metadata=metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
