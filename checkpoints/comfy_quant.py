"""ComfyUI's mixed-precision quantized files: which layers are quantized, in which format, and
their weights dequantized to float32.

A layer is quantized when the file holds `<layer>.comfy_quant` (a uint8 tensor of JSON,
`{"format": ...}`) or when the safetensors metadata entry `_quantization_metadata` names it
(`{"layers": {"<layer>": {"format": ...}}}`); its scales sit beside its weight:

  float8_e4m3fn, float8_e5m2  fp8 weight, float32 `weight_scale` (per tensor)
  int8_tensorwise             int8 weight, float32 `weight_scale` (per tensor or per row);
                              with `convrot`, rows rotated by a Hadamard matrix in groups of
                              `convrot_groupsize` input channels, rotated back on load
  mxfp8                       e4m3fn weight padded to 32x32, `weight_scale` one e8m0 power of two
                              per 32 values of a row (uint8 on disk in older files)
  nvfp4                       two e2m1 values per uint8 (high nibble first) padded to 16x16,
                              `weight_scale` one e4m3fn scale per 16 values, `weight_scale_2`
                              the float32 scale of the whole tensor; `pre_quant_scale` (the
                              input's per-channel smoothing) folded into the weight's columns
Block scales are stored in cuBLAS's tiled layout (tiles of 128 rows by 4 blocks).
`input_scale` (a static activation scale) is not used: our fp8 and int8 matmuls scale their
activations per token; nor is `full_precision_matrix_mult` (the loader's weight_dtype chooses the
matmul of every block matrix). Other formats, and `convrot` on a format other than int8_tensorwise,
are refused before anything is loaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import torch

from .reader import CheckpointError, TensorSource

METADATA_KEY = "_quantization_metadata"
PER_TENSOR = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise")
# values per block scale, and the multiple the stored matrix is padded to
BLOCK_SIZE = {"mxfp8": 32, "nvfp4": 16}
READ = PER_TENSOR + tuple(BLOCK_SIZE)
_WHAT_IS_READ = ", ".join(READ)
# the keys beside a quantized layer's weight that belong to its quantization
_SCALE_NAMES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
_WEIGHT_DTYPES = {"float8_e4m3fn": (torch.float8_e4m3fn,), "float8_e5m2": (torch.float8_e5m2,),
                  "int8_tensorwise": (torch.int8,), "mxfp8": (torch.float8_e4m3fn,),
                  "nvfp4": (torch.uint8,)}
# e2m1 codes 0-15: sign bit, 2 exponent bits, 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_CODES = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
# each byte of a packed nvfp4 weight -> its two values, the high nibble first
_E2M1_PAIRS = torch.stack((_E2M1_CODES[torch.arange(256) >> 4],
                           _E2M1_CODES[torch.arange(256) & 0x0F]), dim=-1)


@dataclass(frozen=True)
class QuantLayer:
    """One quantized layer of a file: its weight's key, its format and the keys it owns."""
    weight: str
    format: str
    config: dict
    where: str  # where the format is declared: its comfy_quant key or the metadata entry
    keys: dict[str, str] = field(default_factory=dict)  # scale name -> file key
    rotation: int = 0  # int8 convrot's Hadamard group size; 0: not rotated
    # the matrix the weight holds: a block-scaled one's padded shape, with the rows of its bias
    # where it has one (ComfyUI pads both sides to the format's multiple)
    shape: tuple[int, ...] = ()

    @property
    def block_scaled(self) -> bool:
        return self.format in BLOCK_SIZE

    @property
    def dequantized(self) -> bool:
        """Read by `dequantize` (block scales or a rotation), never kept as stored."""
        return self.block_scaled or self.rotation > 0

    @property
    def label(self) -> str:
        return f"{self.format} convrot" if self.rotation else self.format

    def pads_to(self, shape: tuple[int, ...]) -> bool:
        """Whether the weight is the matrix `shape` with ComfyUI's padding (block-scaled)."""
        return (self.block_scaled and len(shape) == 2
                and all(want <= have for want, have in zip(shape, self.shape))
                and padded(self, shape) == padded(self, self.shape))

    def owned(self) -> list[str]:
        """The file keys beside the weight that this layer's quantization accounts for."""
        marker = [self.where] if self.where.endswith(".comfy_quant") else []
        return marker + list(self.keys.values())


def _declared(path, source: TensorSource) -> dict[str, tuple[dict, str]]:
    """Layer name (as the file spells it) -> (its config, where it is declared)."""
    found: dict[str, tuple[dict, str]] = {}
    for metadata in source.metadata_sets():  # a sharded set: each shard's own layers
        text = metadata.get(METADATA_KEY)
        if text is None:
            continue
        try:
            layers = json.loads(text)["layers"]
            if not isinstance(layers, dict):
                raise TypeError("'layers' is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: the metadata entry {METADATA_KEY} is not ComfyUI's "
                                  f"quantization metadata ({exc}); read: "
                                  f'{{"layers": {{"<layer>": {{"format": ...}}}}}}') from None
        found.update({name: (conf, METADATA_KEY) for name, conf in layers.items()})
    for key in source.keys():
        if key.endswith(".comfy_quant"):
            raw = source.read(key)
            try:
                conf = json.loads(raw.numpy().tobytes())
            except (ValueError, TypeError, RuntimeError) as exc:
                raise CheckpointError(f"{path}: {key} is not a layer's quantization config "
                                      f"(JSON bytes as uint8): {exc}") from None
            found[key[:-len(".comfy_quant")]] = (conf, key)
    return found


def quant_layers(path, source: TensorSource, prefix: str = "") -> dict[str, QuantLayer]:
    """The file's quantized layers by their weight's file key; raises CheckpointError naming
    the file, the layer and its format for any format or option we do not read."""
    keys = set(source.keys())
    layers = {}
    for name, (conf, where) in _declared(path, source).items():
        weight = next((w for w in (f"{name}.weight", f"{prefix}{name}.weight") if w in keys),
                      None)
        fmt = conf.get("format") if isinstance(conf, dict) else None
        if weight is None:
            raise CheckpointError(f"{path}: {where} declares layer {name!r} ({fmt}), which has "
                                  f"no weight in the file")
        rotation = _check_format(path, name, where, conf, fmt)
        owned = {s: f"{weight[:-len('weight')]}{s}" for s in _SCALE_NAMES}
        layer = QuantLayer(weight, fmt, conf, where,
                           {s: k for s, k in owned.items() if k in keys}, rotation)
        _check_tensors(path, source, layer)
        layers[weight] = replace(layer, shape=_held_shape(source, keys, layer))
    return layers


def _held_shape(source: TensorSource, keys: set[str], layer: QuantLayer) -> tuple[int, ...]:
    """QuantLayer.shape: a block-scaled weight's rows are its bias's where the bias is the
    weight's rows less the padding."""
    shape = logical_shape(layer, source.shape(layer.weight))
    bias = layer.weight[:-len("weight")] + "bias"
    if not layer.block_scaled or bias not in keys:
        return shape
    rows, cols = shape
    bias_shape = source.shape(bias)
    if len(bias_shape) == 1 and rows - BLOCK_SIZE[layer.format] < bias_shape[0] <= rows:
        rows = bias_shape[0]
    return rows, cols


def _check_format(path, name: str, where: str, conf, fmt) -> int:
    """Refuse what is not read; the layer's convrot group size (0: none)."""
    if not isinstance(conf, dict) or not isinstance(fmt, str):
        raise CheckpointError(f"{path}: layer {name!r}: {where} has no format ({conf!r}); "
                              f"read: {_WHAT_IS_READ}")
    if fmt not in READ:
        raise CheckpointError(f"{path}: layer {name!r} is quantized as {fmt!r} ({where}), a "
                              f"format this loader does not read; it reads {_WHAT_IS_READ}")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return 0
    group = conf.get("convrot_groupsize", params.get("convrot_groupsize", 256))
    if fmt != "int8_tensorwise":
        raise CheckpointError(f"{path}: layer {name!r} is quantized as {fmt!r} with convrot "
                              f"(Hadamard-rotated weights, {where}), which this loader does not "
                              f"read; it reads {_WHAT_IS_READ}, convrot with int8_tensorwise only")
    if not _power_of_4(group):
        raise CheckpointError(f"{path}: layer {name!r} ({fmt} convrot, {where}) has convrot "
                              f"group size {group!r}; Hadamard rotations are read for powers of "
                              f"4 (4, 16, 64, 256, ...)")
    return group


def _power_of_4(value) -> bool:
    """4, 16, 64, ...: one bit set, at an even position."""
    return (isinstance(value, int) and value >= 4 and not value & (value - 1)
            and value.bit_length() % 2 == 1)


def _check_tensors(path, source: TensorSource, layer: QuantLayer) -> None:
    """Every scale the format needs is there, with a dtype and size that fit the weight."""
    fmt, name = layer.format, layer.weight[:-len(".weight")]
    needed = ("weight_scale", "weight_scale_2") if fmt == "nvfp4" else ("weight_scale",)
    missing = [s for s in needed if s not in layer.keys]
    if missing:
        raise CheckpointError(f"{path}: layer {name!r} ({fmt}) has no {' or '.join(missing)}; "
                              f"ComfyUI's {fmt} layers store {', '.join(needed)}")
    if "pre_quant_scale" in layer.keys and fmt != "nvfp4":
        raise CheckpointError(f"{path}: layer {name!r} ({fmt}) has a pre_quant_scale, which "
                              f"only nvfp4 layers take")
    dtype = source.dtype(layer.weight)
    if dtype not in _WEIGHT_DTYPES[fmt]:
        raise CheckpointError(f"{path}: layer {name!r} is {fmt} but its weight is {dtype}; "
                              f"{fmt} weights are {_WEIGHT_DTYPES[fmt][0]}")
    shape = source.shape(layer.weight)
    if layer.dequantized and len(shape) != 2:
        raise CheckpointError(f"{path}: layer {name!r} ({layer.label}) has a weight of shape "
                              f"{list(shape)}; {layer.label} weights are matrices")
    if layer.rotation and shape[1] % layer.rotation:
        raise CheckpointError(f"{path}: layer {name!r} ({layer.label}) has {shape[1]} input "
                              f"channels, not a multiple of its rotation's {layer.rotation}")
    if layer.block_scaled:
        rows, blocks = _scale_grid(layer, shape)
        count = math.prod(source.shape(layer.keys["weight_scale"]))
        if count != rows * blocks:
            raise CheckpointError(
                f"{path}: {layer.keys['weight_scale']} holds {count} block scales; the "
                f"{fmt} weight {list(shape)} needs {rows * blocks} (tiles of 128 rows by 4 "
                f"blocks)")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def logical_shape(layer: QuantLayer, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The matrix a stored weight holds, padding included (nvfp4 packs two values a byte)."""
    if layer.format == "nvfp4":
        return (stored[0], stored[1] * 2)
    return tuple(stored)


def padded(layer: QuantLayer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored matrix's logical shape for a layer of `shape`, as ComfyUI pads it."""
    if not layer.block_scaled:
        return tuple(shape)
    step = BLOCK_SIZE[layer.format]
    return tuple(_round_up(size, step) for size in shape)


def _scale_grid(layer: QuantLayer, stored: tuple[int, ...]) -> tuple[int, int]:
    """Rows and columns of the tiled block-scale layout for a stored weight."""
    rows, cols = logical_shape(layer, stored)
    return _round_up(rows, 128), _round_up(cols // BLOCK_SIZE[layer.format], 4)


def untile(tiled: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Block scales [rows, blocks] from cuBLAS's tiled layout: tiles of 128 rows by 4 blocks,
    tile after tile along a row of tiles; inside a tile, row r and block c sit at
    (r % 32) * 16 + (r // 32) * 4 + c."""
    row_tiles, col_tiles = -(-rows // 128), -(-blocks // 4)
    grid = tiled.reshape(row_tiles, col_tiles, 32, 4, 4)  # tile row, tile col, r%32, r//32, c
    grid = grid.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)
    return grid[:rows, :blocks]


def tile(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [rows, blocks] in cuBLAS's tiled layout (untile's inverse), the grid padded
    with zeros to whole tiles."""
    rows, blocks = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-blocks // 4)
    grid = scales.new_zeros(row_tiles * 128, col_tiles * 4)
    grid[:rows, :blocks] = scales
    grid = grid.reshape(row_tiles, 4, 32, col_tiles, 4)  # tile row, r//32, r%32, tile col, c
    return grid.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 powers of two 2^(code - 127) from e8m0 codes (uint8); code 0 reads as 0, as
    comfy_kitchen writes it for an all-zero block."""
    bits = codes.to(torch.int32) << 23
    return torch.where(codes == 0, 0, bits).view(torch.float32)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 [rows, 2 * cols] from uint8 [rows, cols] holding two e2m1 codes each, the high
    nibble first: each byte looked up once, as the pair of values it holds."""
    return _E2M1_PAIRS[packed.int()].reshape(packed.shape[0], -1)


def hadamard(size: int) -> torch.Tensor:
    """The orthonormal regular Hadamard matrix of `size` (a power of 4): Kronecker powers of the
    symmetric 4x4 one, divided by sqrt(size); it is its own inverse."""
    base = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]],
                        dtype=torch.float32)
    matrix = base
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, base)
    return matrix / size ** 0.5


def rotate(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Each group of `group` input channels of `weight` [out, in] times the Hadamard matrix: int8
    convrot's rotation, and its rotation back (the matrix is its own inverse)."""
    rows, cols = weight.shape
    return (weight.reshape(rows, cols // group, group) @ hadamard(group).T).reshape(rows, cols)


def _unrotated(source: TensorSource, layer: QuantLayer) -> torch.Tensor:
    """An int8 convrot weight: codes times scales (per tensor or per row), rotated back."""
    from ..quant.on_load import dequantize_stored

    scale = layer.keys["weight_scale"]
    try:
        weight = dequantize_stored(source.read(layer.weight), source.read(scale))
    except ValueError as exc:
        raise CheckpointError(f"{source.path}: {scale} (the scale of {layer.weight}): "
                              f"{exc}") from None
    return rotate(weight, layer.rotation)


def dequantize(source: TensorSource, layer: QuantLayer, shape: tuple[int, ...]) -> torch.Tensor:
    """A dequantized layer's weight as float32 of `shape` (its padding cut off): the values
    ComfyUI's float32 dequantization gives (bit for bit but for int8 convrot, whose rotation
    back is a matrix product)."""
    if layer.rotation:
        return _unrotated(source, layer)
    stored = source.read(layer.weight)
    rows, cols = logical_shape(layer, tuple(stored.shape))
    block = BLOCK_SIZE[layer.format]
    # block scales as older files store them too (uint8): mxfp8's e8m0 codes, nvfp4's e4m3fn
    tiled = source.read(layer.keys["weight_scale"])
    if layer.format == "mxfp8":
        values = stored.float()
        per_block = e8m0_values(untile(tiled.view(torch.uint8), rows, cols // block))
    else:
        values = e2m1_values(stored)
        tensor_scale = source.read(layer.keys["weight_scale_2"]).float()
        scales = untile(tiled.view(torch.float8_e4m3fn), rows, cols // block)
        per_block = tensor_scale * scales.float()
    # `values` is a copy of the codes' values of its own: scaled in place
    values.view(rows, -1, block).mul_(per_block.unsqueeze(-1))
    weight = values[:shape[0], :shape[1]].contiguous()
    if "pre_quant_scale" in layer.keys:
        smoothing = source.read(layer.keys["pre_quant_scale"]).float().reshape(1, -1)
        if smoothing.shape[1] != shape[1]:
            raise CheckpointError(f"{source.path}: {layer.keys['pre_quant_scale']} holds "
                                  f"{smoothing.shape[1]} values for the {shape[1]} input "
                                  f"channels of {layer.weight}")
        weight.mul_(smoothing)
    return weight


def dequantized_note(path, layers: dict[str, QuantLayer]) -> str | None:
    """The one line a load says about the layers it dequantized, or None when there are none."""
    counts: dict[str, int] = {}
    for layer in layers.values():
        if layer.dequantized:
            counts[layer.label] = counts.get(layer.label, 0) + 1
    if not counts:
        return None
    listed = ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))
    return (f"{path}: {listed} layers dequantized on load (our kernels do not take these "
            f"formats); they hold the load dtype, or our per-channel fp8/int8 codes when the "
            f"model loads with a quantized weight_dtype")
