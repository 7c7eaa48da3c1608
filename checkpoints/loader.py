"""Loading DiT, VAE and text-encoder checkpoints into our modules.

Every load follows the same steps, and fails before reading any weight when something is off:
  1. open the file(s) and read the header: keys, shapes, dtypes;
  2. identify the component and key layout, refuse a file of another component;
  3. map the keys onto our names and infer the configuration from the shapes;
  4. build the module on the meta device and compare every key and shape (strict both ways);
  5. stream the tensors one by one, converted to the target dtype (or quantized, for the DiT's
     block matrices when asked), and assign them.
On any error the partly filled state is dropped, so nothing half-loaded stays referenced.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn as nn

from ..gpu_support import warn_once
from ..wan.configs import KNOWN_T5, SAME_SHAPE_ALIASES, DiTConfig, T5Config, match_known
from . import comfy_quant, keymaps
from .detect import (COMPONENT_NAMES, Identity, identify, infer_dit_config, infer_t5_config,
                     infer_vae_config)
from .reader import CheckpointError, TensorSource, open_checkpoint

if TYPE_CHECKING:
    from ..quant.schemes import QuantScheme

# Quantized checkpoints: per-layer scales stored beside the weights (ComfyUI's fp8 "scaled"
# formats, old and new names) and marker tensors that carry no weights. ComfyUI's mixed-precision
# files (a `.comfy_quant` config per layer) are read by comfy_quant.py, which owns those keys.
_WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_AUXILIARY_SUFFIXES = (".scale_input", ".input_scale")
_MARKER_KEYS = ("scaled_fp8", "spiece_model")

KNOWN_VAES = {
    "vae21": {"dim": 96, "z_dim": 16},
    "vae22": {"dim": 160, "dec_dim": 256, "z_dim": 48},
}


class WeightMerge(Protocol):
    """Changes added into some of the weights while they load (a LoRA merge, lora/merge.py):
    each such tensor is read, made float32, changed in place by `apply_`, and only then
    converted or quantized, so quantized weights carry the change."""

    def touches(self, key: str) -> bool:
        """Whether the tensor of our name `key` changes."""

    def apply_(self, key: str, weight: torch.Tensor) -> None:
        """Add the change into `weight` (float32, contiguous, the caller's own copy)."""


@dataclass
class CheckpointInfo:
    path: Path
    component: str
    layout: str
    config: DiTConfig | T5Config | dict  # dict: a VAE's widths
    known_as: str | None  # a released model's name, or None for a custom size
    disk_dtypes: dict[str, int] = field(default_factory=dict)  # dtype name -> tensor count
    fp8_scaled: bool = False
    quantization: str | None = None  # the weight_dtype that quantized the block matrices
    quantization_detail: str = ""  # what was kept as stored and what quantized on load
    comfy_quant: dict[str, int] = field(default_factory=dict)  # ComfyUI format -> layer count

    @property
    def description(self) -> str:
        name = self.known_as or "custom size"
        return f"{COMPONENT_NAMES[self.component]} [{name}], {self.layout} layout"


@dataclass
class _Plan:
    """Everything known before the first weight is read."""
    source: TensorSource
    identity: Identity
    key_map: dict[str, str]  # our key -> file key
    scales: dict[str, str]  # our key -> file key of its fp8 (or int8) scale
    info: CheckpointInfo
    # layers of ComfyUI's mixed-precision files dequantized on load (mxfp8, nvfp4, int8 convrot)
    dequantized: dict[str, comfy_quant.QuantLayer] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ours -> the matrix held


def _plan(source: TensorSource, expected: tuple[str, ...], role: str) -> _Plan:
    """Identify and map a checkpoint's keys; closes the source when it raises."""
    path = source.path
    try:
        keys = source.keys()
        identity = identify(keys)
        if identity is None:
            sample = ", ".join(sorted(keys)[:5])
            raise CheckpointError(
                f"{path}: unknown key layout: not a Wan DiT, Wan VAE or umT5 text encoder in any "
                f"known layout (official, ComfyUI, diffusers, HF); first keys: {sample}")
        if identity.component not in expected:
            wanted = " or ".join(COMPONENT_NAMES[c] for c in expected)
            raise CheckpointError(
                f"{path}: this file is a {identity.description}, not a {wanted}; "
                f"give it to the {_LOADER_FOR[identity.component]} instead of the {role}")
        key_map, scales, layers = _map_keys(path, source, identity)
        dtypes: dict[str, int] = {}
        for key in key_map.values():
            name = str(source.dtype(key)).replace("torch.", "")
            dtypes[name] = dtypes.get(name, 0) + 1
        info = CheckpointInfo(path, identity.component, identity.layout, {}, None, dtypes,
                              fp8_scaled=bool(scales))
        for layer in layers.values():
            info.comfy_quant[layer.format] = info.comfy_quant.get(layer.format, 0) + 1
        dequantized = {ours: layers[f] for ours, f in key_map.items()
                  if f in layers and layers[f].dequantized}
        shapes = {ours: layer.shape for ours, layer in dequantized.items()}
        return _Plan(source, identity, key_map, scales, info, dequantized, shapes)
    except BaseException:
        source.close()
        raise


_LOADER_FOR = {"dit": "model loader", "vae21": "VAE loader", "vae22": "VAE loader",
               "t5": "text encoder loader"}


def _map_keys(path: Path, source: TensorSource, identity: Identity):
    keys = source.keys()
    layers = comfy_quant.quant_layers(path, source, identity.prefix)
    owned = {k for layer in layers.values() for k in layer.owned()}
    auxiliary = {k for k in keys
                 if k.endswith(_AUXILIARY_SUFFIXES) or k.rsplit(".", 1)[-1] in _MARKER_KEYS}
    auxiliary |= owned
    scale_of = {}
    for k in keys:
        for suffix in _WEIGHT_SCALE_SUFFIXES:
            if k.endswith(suffix) and k not in owned:
                scale_of[k[:-len(suffix)] + ".weight"] = k
                auxiliary.add(k)
    for weight, layer in layers.items():
        if not layer.dequantized:  # one scale per tensor (or row): read as fp8-scaled files
            scale_of[weight] = layer.keys["weight_scale"]
    plain = [k for k in keys if k not in auxiliary]

    if identity.component == "dit":
        if identity.layout == "diffusers":
            mapping = {k: keymaps.dit_diffusers_to_ours(k) for k in plain}
        else:
            p = identity.prefix
            mapping = {k: (k[len(p):] if k.startswith(p) else None) for k in plain}
        key_map = {ours: k for k, ours in mapping.items() if ours is not None}
        unmapped = [k for k, ours in mapping.items() if ours is None]
    elif identity.component in ("vae21", "vae22"):
        if identity.layout == "diffusers":
            key_map = keymaps.vae_diffusers_map(plain, nested=identity.component == "vae22")
        else:
            key_map = {k: k for k in plain}
        unmapped = sorted(set(plain) - set(key_map.values()))
    else:
        if identity.layout == "hf":
            key_map = keymaps.t5_hf_map(plain)
            tied = {"shared.weight", "encoder.embed_tokens.weight"}
            unmapped = sorted(set(plain) - set(key_map.values()) - tied)
        else:
            key_map = {k: k for k in plain}
            unmapped = []
    if unmapped:
        raise CheckpointError(f"{path}: {len(unmapped)} keys fit no part of the "
                              f"{identity.description}: {', '.join(unmapped[:5])}")
    scales = {ours: scale_of[f] for ours, f in key_map.items() if f in scale_of}
    return key_map, scales, layers


def _declared_heads(path: Path, source: TensorSource) -> int | None:
    """A head count declared by the checkpoint: `config` metadata or a config.json beside it."""
    candidates = []
    if "config" in source.metadata:
        candidates.append(source.metadata["config"])
    folder = path if path.is_dir() else path.parent
    if (folder / "config.json").is_file() and (path.is_dir() or "-of-" in path.name
                                               or path.name.startswith("diffusion_pytorch_model")):
        candidates.append((folder / "config.json").read_text())
    for text in candidates:
        try:
            config = json.loads(text)
        except ValueError:
            continue
        for key in ("num_heads", "num_attention_heads"):
            if isinstance(config.get(key), int):
                return config[key]
    return None


def _check_shapes(path: Path, module: nn.Module, plan: _Plan, what: str) -> None:
    """Strict both ways: every module key present with the module's shape, nothing left over."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = _shapes(plan)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k]
                   and not (k in plan.dequantized and plan.dequantized[k].pads_to(expected[k])))
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])})")
        if wrong:
            parts.append(f"{len(wrong)} with other shapes (" + ", ".join(
                f"{k} {list(found[k])} vs {list(expected[k])}" for k in wrong[:3]) + ")")
        raise CheckpointError(f"{path}: shapes match no known configuration of {what}: "
                              + "; ".join(parts))
    for ours in plan.dequantized:
        plan.shapes[ours] = expected[ours]  # the padding is cut off as the weight is read


def _shapes(plan: _Plan) -> dict[str, tuple[int, ...]]:
    """Our key -> the shape of the tensor it holds (a dequantized weight's matrix)."""
    return {ours: plan.shapes.get(ours) or tuple(plan.source.shape(f))
            for ours, f in plan.key_map.items()}


def _stream(plan: _Plan, module: nn.Module, dtype_for: Callable[[str], torch.dtype],
            quantized: "QuantScheme | None" = None, merge: WeightMerge | None = None,
            is_matrix: Callable[[str], bool] | None = None,
            device: torch.device | None = None) -> None:
    """Read each tensor once, convert, and assign; a failure drops everything read so far.

    With `quantized`, each block matrix is quantized as soon as it is read: host memory holds
    the growing model plus one matrix in transit, never the model twice. With `merge`, the
    tensors it touches are changed in float32 on the way (one float32 matrix more in transit).
    is_matrix: which keys are the quantized matrices (the DiT's block matrices by default)."""
    from ..wan.dit import is_block_linear

    is_matrix = is_block_linear if is_matrix is None else is_matrix
    state: dict[str, torch.Tensor] = {}
    kept = 0
    note = comfy_quant.dequantized_note(plan.info.path, plan.dequantized)
    if note is not None:
        warn_once(note)
    try:
        for ours, file_key in plan.key_map.items():
            if quantized is not None and is_matrix(ours) and ours.endswith(".weight"):
                stored = read_quantized(plan, ours, file_key, quantized, merge, device)
                state[ours] = stored.codes
                state[ours[:-len("weight")] + "weight_scale"] = stored.scales
                kept += stored.kept_as_stored
                del stored
            else:
                state[ours] = read_converted(plan, ours, file_key, dtype_for(ours),
                                             merge)
        module.load_state_dict(state, strict=True, assign=True)
        if quantized is not None:
            plan.info.quantization = quantized.name
            plan.info.quantization_detail = _quantization_detail(plan, quantized, kept,
                                                                 is_matrix)
    except BaseException as exc:
        # the traceback keeps the failed step's frames alive: drop what they would hold
        state.clear()
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__.tb_next)
        raise
    finally:
        plan.source.close()


def _file_scale(plan: _Plan, ours: str) -> torch.Tensor | None:
    return plan.source.read(plan.scales[ours]) if ours in plan.scales else None


def read_float(plan: _Plan, ours: str, file_key: str,
               merge: WeightMerge | None = None, device: torch.device | None = None
               ) -> torch.Tensor:
    """One tensor as the file has it (dequantized with its scale when it has one), or, when
    `merge` touches it, as a float32 copy with the change added. device: where the tensor is
    dequantized and merged (and returned); None: the CPU."""
    from ..quant.on_load import dequantize_stored

    scale = _file_scale(plan, ours)
    # a dequantized or scaled weight is a float32 tensor of our own; the reader's may share the
    # file mapping
    own = scale is not None or ours in plan.dequantized
    if ours in plan.dequantized:
        tensor = comfy_quant.dequantize(plan.source, plan.dequantized[ours], plan.shapes[ours])
    else:
        tensor = plan.source.read(file_key)
    if device is not None:
        tensor = tensor.to(device)
        scale = None if scale is None else scale.to(device)
    if scale is not None:
        try:
            tensor = dequantize_stored(tensor, scale)
        except ValueError as exc:
            raise CheckpointError(f"{plan.info.path}: {plan.scales[ours]} (the scale of "
                                  f"{file_key} {list(tensor.shape)}): {exc}") from None
    if merge is None or not merge.touches(ours):
        return tensor
    # a copy of the reader's tensor even when the file is float32
    weight = tensor.to(torch.float32, copy=not own).contiguous()
    del tensor
    merge.apply_(ours, weight)
    return weight


def read_converted(plan: _Plan, ours: str, file_key: str, dtype: torch.dtype,
                   merge: WeightMerge | None = None) -> torch.Tensor:
    """One tensor in `dtype`; quantized ones (fp8-scaled files) dequantized with their scale."""
    return read_float(plan, ours, file_key, merge).to(dtype)


def read_quantized(plan: _Plan, ours: str, file_key: str, quantized: "QuantScheme",
                   merge: WeightMerge | None = None, device: torch.device | None = None):
    """One block matrix as `quantized` stores it (quant.on_load.stored_weight); a merged one is
    quantized from its float32 sum (fp8 files' codes are then not kept as stored).

    device: where a merged matrix is merged and quantized (its float32 low-rank products and
    sums take a GPU a fraction of the CPU's time); its codes and scales come back to the CPU.
    A matrix no merge touches is quantized on the CPU, so that its codes are those a load
    gives whatever the device (a GPU's rounding of the scales' division can differ)."""
    from ..quant.on_load import StoredWeight, stored_weight

    touched = merge is not None and merge.touches(ours)
    if touched or ours in plan.dequantized:
        scale, weight = None, read_float(plan, ours, file_key, merge,
                                         device if touched else None)
    else:
        scale, weight = _file_scale(plan, ours), plan.source.read(file_key)
    try:
        stored = stored_weight(quantized, weight, scale)
    except ValueError as exc:
        where = file_key if scale is None else f"{plan.scales[ours]} (the scale of {file_key})"
        raise CheckpointError(f"{plan.info.path}: {where}: {exc}") from None
    if stored.codes.device.type == "cpu":
        return stored
    return StoredWeight(stored.codes.cpu(), stored.scales.cpu(), stored.kept_as_stored)


def _quantization_detail(plan: _Plan, quantized: "QuantScheme", kept: int,
                         is_matrix: Callable[[str], bool]) -> str:
    matrices = sum(1 for ours in plan.key_map if is_matrix(ours) and ours.endswith(".weight"))
    parts = []
    if kept:
        scales = "with the file's scales" if plan.scales else "no scales in the file: scale 1"
        stored = "int8" if quantized.storage_dtype == torch.int8 else "fp8 e4m3fn"
        parts.append(f"{kept} block matrices kept as stored ({stored}, {scales})")
    if matrices - kept:
        parts.append(f"{matrices - kept} block matrices quantized on load "
                     f"(per-output-channel scales)")
    return f"{quantized.name}: " + "; ".join(parts)


def _fail_cleanly(plan: _Plan, exc: Exception, what: str):
    plan.source.close()
    raise CheckpointError(f"{plan.info.path}: shapes match no known configuration of {what}: "
                          f"{exc}") from exc


# ---------------------------------------------------------------------------------------------

def prepare(source: TensorSource, expected: tuple[str, ...] = ("dit", "vae21", "vae22", "t5"),
            role: str = "inspector") -> tuple[_Plan, nn.Module]:
    """Everything before the first weight is read: identify, map, configure, build the module on
    the meta device and compare every key and shape. Raises CheckpointError (source closed)."""
    plan = _plan(source, expected, role)
    info = _configure(plan)
    try:
        module = _meta_module(plan.identity.component, info.config)
    except ValueError as exc:
        _fail_cleanly(plan, exc, COMPONENT_NAMES[plan.identity.component])
    try:
        _check_shapes(plan.info.path, module, plan, COMPONENT_NAMES[plan.identity.component])
    except CheckpointError:
        plan.source.close()
        raise
    return plan, module


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Component, layout and configuration of any checkpoint, from its header alone."""
    plan, _ = prepare(open_checkpoint(path))
    plan.source.close()
    return plan.info


def _configure(plan: _Plan) -> CheckpointInfo:
    """Fill plan.info with the configuration read from the shapes."""
    component = plan.identity.component
    shapes = _shapes(plan)
    info = plan.info
    try:
        if component == "dit":
            config = infer_dit_config(shapes, _declared_heads(info.path, plan.source))
            known = match_known(config)
            if known:
                config = config.renamed(known)
            info.config, info.known_as = config, known
            if known in SAME_SHAPE_ALIASES:
                info.known_as = " / ".join((known,) + SAME_SHAPE_ALIASES[known])
        elif component in ("vae21", "vae22"):
            config = infer_vae_config(component, shapes)
            info.config = config
            info.known_as = component if config == KNOWN_VAES[component] else None
        else:
            config = infer_t5_config(shapes)
            info.config = config
            info.known_as = next((n for n, c in KNOWN_T5.items() if c == config), None)
    except (ValueError, KeyError) as exc:
        _fail_cleanly(plan, exc, COMPONENT_NAMES[component])
    return info


def _meta_module(component: str, config):
    from ..wan.dit import WanDiT
    from ..wan.t5 import UMT5Encoder
    from ..wan.vae21 import WanVAE21
    from ..wan.vae22 import WanVAE22

    with torch.device("meta"):
        if component == "dit":
            return WanDiT(config)
        if component == "vae21":
            return WanVAE21(**config)
        if component == "vae22":
            return WanVAE22(**config)
        return UMT5Encoder.from_config(config)


def _load(path, expected, role) -> tuple[nn.Module, CheckpointInfo, _Plan]:
    plan, module = prepare(open_checkpoint(path), expected, role)
    return module, plan.info, plan


def load_dit(path: str | Path, dtype: torch.dtype = torch.bfloat16,
             quantization: str | None = None, merge: WeightMerge | None = None,
             device: torch.device | None = None):
    """A WanDiT on the CPU: block matrices and embeddings in `dtype`, norms and modulation in
    float32; fp8-scaled files are dequantized with their scales.

    quantization (a quant.schemes.SCHEMES name: fp8_e4m3fn, fp8_e4m3fn_fast, int8,
    int8_dynamic): the block matrices become quantized layers instead, each quantized as it is
    read (fp8 e4m3fn weights of pre-quantized files kept as stored when the scheme stores fp8);
    everything else loads as above and the model computes in bf16.

    merge: changes added into the tensors it touches as they are read, in float32 and before
    any quantization (a LoRA merged on load: lora.Merge).
    device: where the block matrices a merge touches are merged and quantized on their way to
    the CPU (read_quantized); None: the CPU."""
    from ..quant.block_linears import quantize_block_linears
    from ..quant.schemes import COMPUTE_DTYPE, SCHEMES
    from ..wan.dit import is_block_linear, keeps_float32

    chosen = None
    if quantization is not None:
        if quantization not in SCHEMES:
            raise CheckpointError(f"{path}: quantization {quantization!r} is not one of "
                                  f"{list(SCHEMES)}")
        chosen = SCHEMES[quantization]
    module, info, plan = _load(path, ("dit",), "model loader")
    module.compute_dtype = dtype
    if chosen is not None:
        try:
            quantize_block_linears(module, chosen)  # on the meta device: empty quantized layers
        except BaseException:
            plan.source.close()
            raise

    def dtype_for(key: str) -> torch.dtype:
        if keeps_float32(key):
            return torch.float32
        return COMPUTE_DTYPE if chosen is not None and is_block_linear(key) else dtype

    _stream(plan, module, dtype_for, chosen, merge, device=device)
    return module.eval().requires_grad_(False), info


def load_vae(path: str | Path, dtype: torch.dtype = torch.float32):
    """A Wan2.1 or Wan2.2 VAE (told apart by its keys) on the CPU."""
    module, info, plan = _load(path, ("vae21", "vae22"), "VAE loader")
    _stream(plan, module, lambda k: dtype)
    return module.eval().requires_grad_(False), info


def load_text_encoder(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                      fp8_dtype: torch.dtype | None = None):
    """The umT5 encoder on the CPU, plus the sentencepiece model bytes when the file embeds one
    (ComfyUI's text-encoder files carry it as a uint8 tensor `spiece_model`).

    A file whose block matrices are fp8 e4m3fn (ComfyUI's umt5_xxl_fp8_e4m3fn_scaled) keeps them
    as stored, with their scales, dequantized per matmul to `fp8_dtype` (None: `dtype`): the
    model holds half the bytes of a bf16 one and computes what the file dequantized on load
    would."""
    from ..quant.block_linears import quantize_block_linears
    from ..quant.schemes import Float8WeightOnlyConfig
    from ..wan.t5 import is_block_matrix

    module, info, plan = _load(path, ("t5",), "text encoder loader")
    spiece = None
    if "spiece_model" in plan.source.keys():
        spiece = plan.source.read("spiece_model").numpy().tobytes()
    fp8 = any(plan.source.dtype(f) == torch.float8_e4m3fn
              for ours, f in plan.key_map.items() if is_block_matrix(ours))
    kept = Float8WeightOnlyConfig() if fp8 else None
    if fp8 and fp8_dtype is not None:
        dtype = fp8_dtype
    if kept is not None:  # empty fp8 layers on the meta device, for the file's codes
        quantize_block_linears(module, kept, compute_dtype=dtype,
                               filter_fn=lambda m, name: isinstance(m, nn.Linear)
                               and is_block_matrix(f"{name}.weight"))
    stored_embedding = plan.source.dtype(plan.key_map["token_embedding.weight"])

    def dtype_for(key: str) -> torch.dtype:
        return lookup_table_dtype(stored_embedding, dtype) if key == "token_embedding.weight" \
            else dtype
    _stream(plan, module, dtype_for, kept, is_matrix=is_block_matrix)
    return module.eval().requires_grad_(False), spiece, info


def lookup_table_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The token embedding's dtype in memory: the file's when it is a float type narrower than
    `dtype` (bf16 in a float32 encoder: 2 GiB less for umT5), since a lookup reads a few rows and
    widening them after is exact; otherwise `dtype`."""
    narrower = stored.is_floating_point and stored.itemsize < dtype.itemsize
    return stored if narrower and stored.itemsize >= 2 else dtype

