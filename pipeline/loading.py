"""Loading the three model files into handles, with the tokenizer found where users keep it."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import host
from ..checkpoints.clip_vision import load_clip_vision
from ..checkpoints.loader import load_dit, load_text_encoder, load_vae
from ..checkpoints.reader import CheckpointError
from ..gpu_support import warn_once
from ..quant.kernels import fp8_matmul_unavailable
from ..quant.linear import fast_fallback_message
from ..quant.schemes import COMPUTE_DTYPE, SCHEMES
from ..wan.attention import available_backends, fp8_attention_fallback, resolve_backend
from ..wan.bf16_attention import bf16_hopper_fallback, bf16_hopper_unavailable
from ..wan.fp8_attention import fp8_attention_unavailable
from ..wan.tokenizer import UMT5Tokenizer
from .handles import WanCLIPVisionHandle, WanModelHandle, WanTextEncoderHandle, WanVAEHandle

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTO = "auto"  # bf16 where the model computes on a GPU, fp32 where it computes on a CPU
FLOAT_CHOICES = [*DTYPES, AUTO]

# The model loader's weight_dtype choices: the float dtypes first, in their released order, then
# the block-matrix quantizations (quant/schemes.py) and auto, appended after them.
MODEL_DTYPES = [*DTYPES, *SCHEMES, AUTO]


def resolve_dtype(name: str, on_gpu: bool | None = None) -> str:
    """"auto" as bf16 where the model computes on a GPU and fp32 on a CPU, where bf16 and fp16
    matrix products run many times slower than fp32 (a CPU-only ComfyUI); another name as it
    is, with a warning when it is a half type on the CPU. `on_gpu`: where the model computes
    (default: the host's compute device)."""
    if on_gpu is None:
        on_gpu = host.compute_device().type != "cpu"
    if name == AUTO:
        return "bf16" if on_gpu else "fp32"
    if name in ("bf16", "fp16") and not on_gpu:
        warn_once(f"{name} weights on the CPU: matrix products in {name} run many times slower "
                  f"there than in fp32; 'auto' picks fp32 on a CPU")
    return name


def _dtype(name: str, field: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"{field}: {name!r} is not one of {list(DTYPES)}")
    return DTYPES[name]


def _resident(module: torch.nn.Module, keep_on_gpu: bool) -> torch.nn.Module:
    """Models normally wait on the CPU; `keep_on_gpu` keeps one on the compute device between
    nodes and runs (no transfer per run, at the cost of its memory all the time)."""
    return module.to(host.compute_device()) if keep_on_gpu else module


def load_model(path: Path, weight_dtype: str = "bf16", attention: str = "auto",
               keep_on_gpu: bool = False, compile: bool = False) -> WanModelHandle:
    if attention not in available_backends():
        raise CheckpointError(f"attention: {attention!r} is not available here; available: "
                              f"{available_backends()}")
    weight_dtype = resolve_dtype(weight_dtype)
    attention = resolve_backend(attention, weight_dtype, host.compute_device())
    _check_attention(attention, COMPUTE_DTYPE if weight_dtype in SCHEMES
                     else DTYPES.get(weight_dtype))
    if weight_dtype in SCHEMES:
        _check_fast_fp8(weight_dtype)
        model, info = load_dit(path, COMPUTE_DTYPE, quantization=weight_dtype)
    elif weight_dtype in DTYPES:
        model, info = load_dit(path, DTYPES[weight_dtype])
    else:
        raise CheckpointError(f"weight_dtype: {weight_dtype!r} is not one of {MODEL_DTYPES}")
    return WanModelHandle(_resident(model, keep_on_gpu), info, attention, compile, weight_dtype)


def _check_attention(attention: str, compute_dtype: torch.dtype | None) -> None:
    """Say at load time when our attention kernel will not run (the blocks fall back to SDPA;
    under torch.compile they cannot warn themselves)."""
    if attention == "fp8_triton":
        reason = fp8_attention_unavailable(host.compute_device())
        if reason is not None:
            warn_once(fp8_attention_fallback(reason))
    elif attention == "bf16_hopper":
        reason = bf16_hopper_unavailable(host.compute_device(), dtype=compute_dtype)
        if reason is not None:
            warn_once(bf16_hopper_fallback(reason))


def _check_fast_fp8(weight_dtype: str) -> None:
    """Say at load time when the fp8 matmul will not be there: under torch.compile the layers
    cannot warn themselves."""
    if SCHEMES[weight_dtype].options.get("fast"):  # fp8 matmuls: say now if they cannot run
        reason = fp8_matmul_unavailable(host.compute_device())
        if reason is not None:
            warn_once(fast_fallback_message(reason, COMPUTE_DTYPE))


def load_vae_handle(path: Path, dtype: str = "bf16", keep_on_gpu: bool = False) -> WanVAEHandle:
    model, info = load_vae(path, _dtype(resolve_dtype(dtype), "dtype"))
    return WanVAEHandle(_resident(model, keep_on_gpu), info, info.component)


def load_clip_vision_handle(path: Path, dtype: str = "fp16") -> WanCLIPVisionHandle:
    return WanCLIPVisionHandle(load_clip_vision(path, _dtype(resolve_dtype(dtype), "dtype")),
                               Path(path))


def find_tokenizer(path: Path, embedded: bytes | None) -> UMT5Tokenizer:
    """The embedded sentencepiece model, else a tokenizer beside the checkpoint: the release's
    google/umt5-xxl/ folder, a tokenizer.json or spiece.model, or a tokenizer/ folder."""
    if embedded is not None:
        return UMT5Tokenizer.from_spiece_bytes(embedded)
    folder = path if path.is_dir() else path.parent
    for candidate in (folder / "google" / "umt5-xxl", folder / "tokenizer.json",
                      folder / "spiece.model", folder / "tokenizer"):
        if candidate.exists():
            return UMT5Tokenizer.from_path(candidate)
    raise CheckpointError(
        f"{path}: no tokenizer found: the file embeds none (no 'spiece_model' tensor) and "
        f"{folder} holds no google/umt5-xxl/, tokenizer.json, spiece.model or tokenizer/")


def load_text_encoder_handle(path: Path, dtype: str = "bf16", device: str = "gpu",
                             keep_on_gpu: bool = False) -> WanTextEncoderHandle:
    if device not in ("gpu", "cpu"):
        raise CheckpointError(f"device: {device!r} is not 'gpu' or 'cpu'")
    on_gpu = device == "gpu" and host.compute_device().type != "cpu"
    # auto with fp8 weights (ComfyUI's umt5 files): they stay fp8 and dequantize to float32 per
    # matmul. Compute time hardly changes (the bus carries the same fp8 bytes) and the encoding
    # keeps float32's precision, which a half-precision umT5 can lose (no 1/sqrt(d) on its
    # attention scores)
    fp8_dtype = torch.float32 if dtype == AUTO else None
    model, spiece, info = load_text_encoder(path, _dtype(resolve_dtype(dtype, on_gpu), "dtype"),
                                            fp8_dtype)
    try:
        tokenizer = find_tokenizer(Path(path), spiece)
    except (OSError, ValueError) as exc:
        del model
        raise CheckpointError(str(exc)) from exc
    return WanTextEncoderHandle(_resident(model, keep_on_gpu and device == "gpu"), tokenizer,
                                info, device)
