"""Matrices written as ComfyUI's mixed-precision layers (checkpoints/comfy_quant.py reads them),
for test files: each format quantized by its own arithmetic, with the float32 values the codes
stand for computed straight from the codes and the untiled scales.

    state, metadata = quantize_layers(state, {"model.diffusion_model.blocks.0.ffn.0.weight":
                                              "nvfp4"}, metadata_form=False)
"""

from __future__ import annotations

import json
from typing import NamedTuple

import torch

from ..quant.rowwise import FP8, INT8, RowFormat
from .comfy_quant import BLOCK_SIZE, E2M1, METADATA_KEY, READ, rotate, tile

# the per-tensor formats: our per-row quantization with the whole matrix as one row
_PER_TENSOR = {"float8_e4m3fn": FP8, "int8_tensorwise": INT8,
               "float8_e5m2": RowFormat(torch.float8_e5m2,
                                        torch.finfo(torch.float8_e5m2).max, rounds=False)}
_E2M1 = torch.tensor(E2M1)
_E2M1_MIDPOINTS = (_E2M1[1:] + _E2M1[:-1]) / 2


class Quantized(NamedTuple):
    tensors: dict[str, torch.Tensor]  # scale name ("" for the weight) -> tensor
    values: torch.Tensor  # float32, the matrix the codes and scales stand for


def quantize(weight: torch.Tensor, fmt: str, rotation: int = 0) -> Quantized:
    """`weight` [out, in] in ComfyUI's `fmt` (one of comfy_quant.READ); rotation: int8's convrot
    group size (per-row scales of the rotated rows)."""
    weight = weight.float()
    if rotation:
        return _int8_convrot(weight, rotation)
    if fmt in _PER_TENSOR:
        row = _PER_TENSOR[fmt]
        scale = row.scales(weight.reshape(1, -1)).reshape(())
        codes = row.encode(weight, scale)
        return Quantized({"": codes, "weight_scale": scale}, codes.float() * scale)
    if fmt == "mxfp8":
        return _mxfp8(weight)
    if fmt == "nvfp4":
        return _nvfp4(weight)
    raise ValueError(f"{fmt!r} is not one of {READ}")


def _int8_convrot(weight: torch.Tensor, group: int) -> Quantized:
    rotated = rotate(weight, group)
    scale = INT8.scales(rotated)  # per row, [out, 1]
    codes = INT8.encode(rotated, scale)
    return Quantized({"": codes, "weight_scale": scale}, rotate(codes.float() * scale, group))


def _padded_blocks(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The weight padded with zeros to the format's multiple, as [rows, blocks, block]."""
    step = BLOCK_SIZE[fmt]
    rows, cols = weight.shape
    grown = weight.new_zeros(-(-rows // step) * step, -(-cols // step) * step)
    grown[:rows, :cols] = weight
    return grown.reshape(grown.shape[0], -1, step)


def _mxfp8(weight: torch.Tensor) -> Quantized:
    blocks = _padded_blocks(weight, "mxfp8")
    amax = blocks.abs().amax(-1)
    zero = amax == 0
    # the smallest power of two that brings the block's largest value within e4m3's range;
    # an all-zero block gets code 0, which reads as a scale of 0
    exponent = torch.ceil(torch.log2((amax / 448.0).clamp_min(2.0 ** -126))).clamp(-126, 127)
    exponent[zero] = -127
    codes = (blocks / torch.exp2(exponent)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    biased = (exponent + 127).to(torch.uint8)
    values = codes.float() * torch.exp2(exponent).masked_fill(zero, 0.0)[..., None]
    rows, cols = weight.shape
    return Quantized(
        {"": codes.reshape(blocks.shape[0], -1),
         "weight_scale": tile(biased).view(torch.float8_e8m0fnu)},
        values.reshape(blocks.shape[0], -1)[:rows, :cols].contiguous())


def _nvfp4(weight: torch.Tensor) -> Quantized:
    blocks = _padded_blocks(weight, "nvfp4")
    tensor_scale = (weight.abs().amax() / (448.0 * 6.0)).clamp_min(2.0 ** -126)
    block_scale = (blocks.abs().amax(-1) / 6.0 / tensor_scale).clamp(max=448.0)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    total = tensor_scale * block_scale.float()
    scaled = torch.where(total[..., None] == 0, 0.0,
                         blocks / torch.where(total == 0, 1.0, total)[..., None])
    magnitude = torch.bucketize(scaled.abs().clamp(max=6.0), _E2M1_MIDPOINTS)
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    codes = codes.reshape(blocks.shape[0], -1)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    values = _E2M1[magnitude] * torch.where(scaled < 0, -1.0, 1.0) * total[..., None]
    rows, cols = weight.shape
    return Quantized(
        {"": packed, "weight_scale": tile(block_scale),
         "weight_scale_2": tensor_scale.reshape(())},
        values.reshape(blocks.shape[0], -1)[:rows, :cols].contiguous())


def config_bytes(config: str | dict) -> torch.Tensor:
    """A layer's `comfy_quant` tensor: its config (or {"format": config}) as JSON in uint8."""
    config = {"format": config} if isinstance(config, str) else config
    return torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)


def quantize_layers(state: dict[str, torch.Tensor], formats: dict[str, str | dict],
                    metadata_form: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
    """`state` with each weight key of `formats` quantized to its format (a format name, or a
    layer config such as {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize":
    16}): the file's tensors, its metadata (the `_quantization_metadata` entry with
    metadata_form, else each layer's `comfy_quant` key) and the float32 values each quantized
    weight stands for."""
    out, values, layers = {}, {}, {}
    for key, tensor in state.items():
        config = formats.get(key)
        if config is None:
            out[key] = tensor
            continue
        config = {"format": config} if isinstance(config, str) else config
        layer = key[:-len(".weight")]
        rotation = config.get("convrot_groupsize", 256) if config.get("convrot") else 0
        made = quantize(tensor, config["format"], rotation)
        for name, part in made.tensors.items():
            out[f"{layer}.{name}" if name else key] = part
        values[key] = made.values
        layers[layer] = config
        if not metadata_form:
            out[f"{layer}.comfy_quant"] = config_bytes(config)
    metadata = ({METADATA_KEY: json.dumps({"format_version": "1.0", "layers": layers})}
                if metadata_form else {})
    return out, metadata, values
