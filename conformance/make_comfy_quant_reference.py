"""Writes ComfyUI's mixed-precision quantized files and ComfyUI's own dequantization of them, the
reference for checkpoints/comfy_quant.py (tests/test_comfy_quant_files.py).

    python conformance/make_comfy_quant_reference.py [--comfyui DIR] [OUT_DIR]

Run with a Python that has ComfyUI's comfy_kitchen (ComfyUI 0.30 pins comfy-kitchen 0.2.27) and
a ComfyUI checkout (DIR, default /tmp/cu030) whose comfy.ops and comfy.quant_ops it imports; it
runs on the CPU. Seeded random matrices are quantized by ComfyUI's layouts, each put in one of
ComfyUI's mixed-precision Linear layers and written by that layer's own state_dict (weight,
scales, `comfy_quant` config, bias). The reference is what ComfyUI's layer loaded from the file
dequantizes to, in float32 and in bf16.

OUT_DIR (default tests/data/comfy_quant) receives:
  layers.safetensors    every case, one `<layer>.comfy_quant` key per layer
  metadata.safetensors  the small cases without those keys, their formats in the
                        `_quantization_metadata` entry instead (with "format_version"), block
                        scales stored as uint8 as older files have them; checked to load in
                        ComfyUI (comfy.utils.convert_old_quants) to the same reference
  reference.safetensors `<layer>.float32` and `<layer>.bfloat16`: ComfyUI's dequantized weights
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# name -> (format, [out, in], quantize options). Block-scaled cases pad rows and columns and
# span several tiles of the scale layout (128 rows by 4 blocks).
CASES = {
    "fp8_e4m3": ("float8_e4m3fn", (16, 64), {"scale": "recalculate"}),
    "fp8_e5m2": ("float8_e5m2", (16, 64), {"scale": "recalculate"}),
    "int8": ("int8_tensorwise", (16, 64), {}),
    "int8_rows": ("int8_tensorwise", (16, 64), {"per_channel": True}),
    "int8_convrot": ("int8_tensorwise", (16, 64),
                     {"per_channel": True, "convrot": True, "convrot_groupsize": 16}),
    "mxfp8": ("mxfp8", (24, 160), {}),
    "mxfp8_rows": ("mxfp8", (130, 40), {}),
    "nvfp4": ("nvfp4", (24, 144), {}),
    "nvfp4_rows": ("nvfp4", (136, 40), {}),
}
METADATA_CASES = ("fp8_e4m3", "int8", "int8_convrot", "mxfp8", "nvfp4")


def _comfy(checkout: Path):
    sys.path.insert(0, str(checkout))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.ops
    import comfy.quant_ops
    import comfy.utils
    return comfy.ops, comfy.quant_ops, comfy.utils


def _matrix(name: str, shape: tuple[int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    value = torch.randn(shape, generator=gen) * 0.05
    value[0, :5] = torch.tensor([0.0, 1e-6, -2e-4, 0.2, -0.15])  # tiny values and big ones
    return value


def _layer_state(ops, quant_ops, name: str, fmt: str, shape, options) -> dict:
    """ComfyUI's own state dict of a mixed-precision Linear holding the quantized matrix."""
    from comfy_kitchen.tensor import QuantizedTensor

    layout = quant_ops.QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    weight = _matrix(name, shape)
    qdata, params = quant_ops.get_layout_class(layout).quantize(weight, **options)
    linear = ops.mixed_precision_ops({}, compute_dtype=torch.float32).Linear(shape[1], shape[0])
    linear.weight = torch.nn.Parameter(QuantizedTensor(qdata, layout, params),
                                       requires_grad=False)
    linear.quant_format = fmt
    linear.bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, shape[0]), requires_grad=False)
    state = linear.state_dict(prefix=f"layers.{name}.")
    return {k: v.detach().contiguous() for k, v in state.items()}


def _dequantized(ops, state: dict, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The weight a ComfyUI Linear of compute dtype `dtype` loads from `state` and dequantizes."""
    linear = ops.mixed_precision_ops({}, compute_dtype=dtype).Linear(shape[1], shape[0])
    prefix = f"layers.{name}."
    linear.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                            if k.startswith(prefix)}, strict=False)
    return linear.weight.dequantize().contiguous()


def main(argv: list[str]) -> int:
    checkout = Path("/tmp/cu030")
    if argv[:1] == ["--comfyui"]:
        checkout, argv = Path(argv[1]), argv[2:]
    out = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "tests" / "data" \
        / "comfy_quant"
    ops, quant_ops, utils = _comfy(checkout)
    out.mkdir(parents=True, exist_ok=True)
    layers, reference, layer_formats = {}, {}, {}
    for name, (fmt, shape, options) in CASES.items():
        layers.update(_layer_state(ops, quant_ops, name, fmt, shape, options))
        layer_formats[f"layers.{name}"] = fmt
    save_file(layers, str(out / "layers.safetensors"))
    loaded = load_file(str(out / "layers.safetensors"))  # what ComfyUI reads back
    for name, (fmt, shape, _) in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            key = f"layers.{name}.{str(dtype).removeprefix('torch.')}"
            reference[key] = _dequantized(ops, dict(loaded), name, shape, dtype)
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    source = (f"ComfyUI {commit} comfy.ops mixed_precision_ops Linear, comfy-kitchen "
              f"{version('comfy-kitchen')}, torch {torch.__version__}, CPU")
    save_file(reference, str(out / "reference.safetensors"),
              metadata={"reference": source, "cases": json.dumps(
                  {n: [f, list(s)] for n, (f, s, _) in CASES.items()})})
    small = {k: v for k, v in loaded.items() if k.split(".")[1] in METADATA_CASES
             and not k.endswith(".comfy_quant")}
    for key, value in small.items():
        if key.endswith(".weight_scale") and CASES[key.split(".")[1]][0] in ("mxfp8", "nvfp4"):
            small[key] = value.view(torch.uint8)
    metadata = {"format_version": "1.0", "layers": {
        f"layers.{n}": json.loads(bytes(loaded[f"layers.{n}.comfy_quant"].tolist()))
        for n in METADATA_CASES}}
    save_file(small, str(out / "metadata.safetensors"),
              metadata={"_quantization_metadata": json.dumps(metadata)})
    state, _ = utils.convert_old_quants(load_file(str(out / "metadata.safetensors")), "",
                                        {"_quantization_metadata": json.dumps(metadata)})
    for name in METADATA_CASES:
        again = _dequantized(ops, state, name, CASES[name][1], torch.float32)
        assert torch.equal(again, reference[f"layers.{name}.float32"]), name
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
