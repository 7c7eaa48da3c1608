"""Random-weight checkpoints in every on-disk layout we read, for tests, the demo and benchmarks.

Sizes are tiny by default but any configuration works (the benchmark writes real sizes). The
weights are seeded, unit-scale fan-in random values with norm gains near 1, so every tensor
visibly affects the outputs. Files are written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic_files import atomic_target, write_atomically
from ..wan.configs import DiTConfig, T5Config
from ..wan.dit import WanDiT, is_block_linear
from . import keymaps
from .comfy_quant_write import quantize_layers

# head_dim 128 like every released size, so no config has to travel with the file; the text
# width is the tiny text encoder's
_TINY = dict(dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_dim=64)
TINY_DIT = {
    "t2v": DiTConfig(name="tiny-t2v", **_TINY),
    "ti2v": DiTConfig(name="tiny-ti2v", in_dim=48, out_dim=48, **_TINY),
    "i2v": DiTConfig(name="tiny-i2v", in_dim=36, image_embedding=True, image_dim=64, **_TINY),
    # Wan2.2 I2V-A14B layout: image conditioning channels, no CLIP image embedding
    "i2v_a14b": DiTConfig(name="tiny-i2v-a14b", in_dim=36, **_TINY),
}
TINY_VAE = {"vae21": {"dim": 8, "z_dim": 16}, "vae22": {"dim": 8, "dec_dim": 12, "z_dim": 48}}
TINY_T5 = T5Config(vocab_size=256, dim=64, dim_attn=64, dim_ffn=128, num_heads=4, num_layers=2,
                   num_buckets=32)


# -- random weights ----------------------------------------------------------------------------

def randomize(module: torch.nn.Module, seed: int, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32,
              keep_on_device: bool = False) -> dict[str, torch.Tensor]:
    """A seeded random state dict of `dtype` for `module` (built on any device, e.g. meta).
    The values are drawn on `device` (a GPU makes real-size models in seconds) and returned on
    the CPU, or left on `device` with keep_on_device."""
    state = {}
    for name, value in random_tensors(module, seed, device):
        value = value.to(dtype)
        state[name] = value if keep_on_device else value.cpu().contiguous()
        del value
    return state


def random_tensors(module: torch.nn.Module, seed: int, device: str | torch.device = "cpu"):
    """(name, float32 value) for every tensor of `module`'s state, drawn one at a time from one
    seeded generator (randomize's values, for writers that stream)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, tensor in module.state_dict().items():
        yield name, random_value(name, tuple(tensor.shape), gen, device)


def random_value(name: str, shape: tuple[int, ...], gen: torch.Generator,
                 device: str | torch.device) -> torch.Tensor:
    """Noise scaled by the kind of tensor: norm gains near 1, small biases, matrices by their
    fan-in."""
    leaf = name.rsplit(".", 1)[-1]
    noise = torch.randn(shape, generator=gen, device=device)
    if leaf in ("gamma",) or (leaf == "weight" and len(shape) == 1):
        return noise.mul_(0.1).add_(1.0)  # norm gains
    if leaf == "bias":
        return noise.mul_(0.02)
    if name.endswith("modulation"):
        return noise.div_(shape[-1] ** 0.5)
    if "pos_embedding" in name or "emb_pos" in name or "token_embedding" in name:
        return noise.mul_(0.5)
    fan_in = max(1, math.prod(shape[1:])) if len(shape) > 1 else 1
    return noise.div_(fan_in ** 0.5)


def _atomic_save(state: dict[str, torch.Tensor], path: Path, metadata: dict | None = None):
    with atomic_target(path, path.name) as tmp:
        if path.suffix == ".safetensors":
            save_file(state, str(tmp), metadata=metadata)
        else:
            torch.save(state, str(tmp))


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


# -- DiT ---------------------------------------------------------------------------------------

def random_dit_state(config: DiTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = WanDiT(config)
    return randomize(model, seed)


def _official_config_json(config: DiTConfig) -> dict:
    model_type = "ti2v" if config.out_dim == 48 else ("i2v" if config.in_dim == 36 else "t2v")
    return {"_class_name": "WanModel", "model_type": model_type, "dim": config.dim,
            "ffn_dim": config.ffn_dim, "freq_dim": config.freq_dim, "in_dim": config.in_dim,
            "out_dim": config.out_dim, "num_heads": config.num_heads,
            "num_layers": config.num_layers, "text_len": config.text_len, "eps": config.eps}


def _diffusers_config_json(config: DiTConfig) -> dict:
    return {"_class_name": "WanTransformer3DModel", "num_attention_heads": config.num_heads,
            "attention_head_dim": config.head_dim, "in_channels": config.in_dim,
            "out_channels": config.out_dim, "text_dim": config.text_dim,
            "freq_dim": config.freq_dim, "ffn_dim": config.ffn_dim,
            "num_layers": config.num_layers, "patch_size": list(config.patch_size),
            "eps": config.eps, "cross_attn_norm": config.cross_attn_norm,
            "qk_norm": "rms_norm_across_heads",
            "image_dim": config.image_dim if config.image_embedding else None,
            "added_kv_proj_dim": config.dim if config.image_embedding else None}


def fp8_scaled(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block matrices as float8_e4m3fn with a per-tensor `scale_weight`, plus the
    `scaled_fp8` marker, as ComfyUI's fp8-scaled files store them."""
    out = {}
    for key, value in state.items():
        if is_block_linear(key.removeprefix("model.diffusion_model.")) and key.endswith(".weight"):
            scale = value.abs().max().float() / 448.0
            out[key] = (value / scale).to(torch.float8_e4m3fn)
            out[key[:-len(".weight")] + ".scale_weight"] = scale.reshape(())
        else:
            out[key] = value
    # the marker goes under the weights' prefix: ComfyUI reads it there (a file's keys are
    # taken without their prefix, the others dropped)
    prefix = "model.diffusion_model." if any(k.startswith("model.diffusion_model.")
                                              for k in state) else ""
    out[prefix + "scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    return out


def fp8_plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block matrices cast to float8_e4m3fn with no scale (values beyond +-448 clipped),
    as plain fp8 files such as `*_fp8_e4m3fn.safetensors` store them."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    return {key: (value.float().clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
                  if is_block_linear(key.removeprefix("model.diffusion_model."))
                  and key.endswith(".weight") else value)
            for key, value in state.items()}


def write_dit(path: str | Path, config: DiTConfig = TINY_DIT["t2v"], layout: str = "comfy",
              seed: int = 0, dtype: torch.dtype = torch.bfloat16,
              state: dict[str, torch.Tensor] | None = None,
              comfy_quant: dict[str, str | dict] | None = None,
              quant_metadata: bool = False) -> Path:
    """Write a DiT checkpoint. Layouts:
    official  - folder with diffusion_pytorch_model.safetensors + config.json
    sharded   - folder with 2 shards, the .index.json and config.json (as the 14B releases)
    comfy     - one file, keys under model.diffusion_model.
    comfy_fp8 - as comfy, block matrices fp8-scaled (per-tensor `scale_weight`)
    comfy_fp8_e4m3fn - as comfy, block matrices plain float8_e4m3fn without scales
    diffusers - folder with diffusers names + config.json
    comfy_quant: {our weight key: ComfyUI mixed-precision format or layer config} (comfy and
    official layouts):
    those weights quantized as ComfyUI's mixed-precision files store them, each with its
    `comfy_quant` config, or with quant_metadata in the `_quantization_metadata` entry
    (checkpoints/comfy_quant_write.py; comfy_quant_values gives the values they stand for).
    Returns the path to hand to the loader.
    """
    path = Path(path)
    state = _cast(state if state is not None else random_dit_state(config, seed), dtype)
    metadata = None
    if comfy_quant and layout not in ("comfy", "official"):
        raise ValueError(f"comfy_quant is written in the comfy and official layouts, not "
                         f"{layout!r}")
    if layout in ("comfy", "comfy_fp8", "comfy_fp8_e4m3fn"):
        prefixed = {"model.diffusion_model." + k: v for k, v in state.items()}
        if layout == "comfy_fp8":
            prefixed = fp8_scaled(prefixed)
        elif layout == "comfy_fp8_e4m3fn":
            prefixed = fp8_plain(prefixed)
        elif comfy_quant:
            prefixed, metadata, _ = quantize_layers(
                prefixed, {"model.diffusion_model." + k: f for k, f in comfy_quant.items()},
                quant_metadata)
        _atomic_save(prefixed, path, metadata or None)
        return path
    if comfy_quant:
        state, metadata, _ = quantize_layers(state, comfy_quant, quant_metadata)
    # a folder's config.json is written last, each file whole or not at all: a folder with its
    # config.json is complete (a write cut short leaves no config.json, so it is written again)
    path.mkdir(parents=True, exist_ok=True)
    if layout == "diffusers":
        _atomic_save({keymaps.dit_ours_to_diffusers(k): v for k, v in state.items()},
                     path / "diffusion_pytorch_model.safetensors")
        _write_config(path, _diffusers_config_json(config))
        return path
    if layout == "official":
        _atomic_save(state, path / "diffusion_pytorch_model.safetensors", metadata or None)
        _write_config(path, _official_config_json(config))
        return path
    if layout == "sharded":
        keys = sorted(state)
        halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
        weight_map = {}
        for i, part in enumerate(halves, start=1):
            name = f"diffusion_pytorch_model-{i:05d}-of-{len(halves):05d}.safetensors"
            _atomic_save({k: state[k] for k in part}, path / name)
            weight_map.update({k: name for k in part})
        index = {"metadata": {}, "weight_map": weight_map}
        write_atomically(path / "diffusion_pytorch_model.safetensors.index.json",
                         json.dumps(index).encode())
        _write_config(path, _official_config_json(config))
        return path
    raise ValueError(f"unknown DiT layout {layout!r}")


def comfy_quant_values(state: dict[str, torch.Tensor], comfy_quant: dict[str, str | dict],
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`state` (our keys) with the weights write_dit's `comfy_quant` quantizes replaced by the
    float32 values their codes stand for: the same model as a plain file."""
    state = _cast(state, dtype)
    _, _, values = quantize_layers(state, comfy_quant)
    return {k: values.get(k, v) for k, v in state.items()}


def _write_config(folder: Path, config: dict) -> None:
    write_atomically(folder / "config.json", json.dumps(config, indent=1).encode())


# -- VAE ---------------------------------------------------------------------------------------

_VAE_RESNET_TO_DIFFUSERS = {v: k for k, v in keymaps._VAE_DIFFUSERS_RESNET.items()}


def _vae_inner_to_diffusers(rest: str) -> str:
    for ours, theirs in _VAE_RESNET_TO_DIFFUSERS.items():
        if rest.startswith(ours + "."):
            return theirs + rest[len(ours):]
    return rest


def vae_ours_to_diffusers(keys: list[str], nested: bool) -> dict[str, str]:
    """{our_key: diffusers_key} for a VAE state dict (inverse of keymaps.vae_diffusers_map)."""
    def is_resample(prefix):
        return any(k.startswith(prefix + "resample.") or k.startswith(prefix + "time_conv.")
                   for k in keys)

    flat_decoder: dict[int, str] = {}
    if not nested:  # decoder stages: residual blocks, then one upsampler (not after the last)
        indices = sorted({int(m.group(1)) for k in keys
                          if (m := re.match(r"decoder\.upsamples\.(\d+)\.", k))})
        stage, j = 0, 0
        for i in indices:
            if is_resample(f"decoder.upsamples.{i}."):
                flat_decoder[i] = f"up_blocks.{stage}.upsamplers.0"
                stage, j = stage + 1, 0
            else:
                flat_decoder[i] = f"up_blocks.{stage}.resnets.{j}"
                j += 1

    out = {}
    for key in keys:
        side, _, rest = key.partition(".")
        if side == "conv1":
            out[key] = "quant_conv." + rest
        elif side == "conv2":
            out[key] = "post_quant_conv." + rest
        else:
            out[key] = f"{side}." + _vae_side_to_diffusers(side, rest, nested, is_resample,
                                                          flat_decoder)
    return out


def _vae_side_to_diffusers(side, rest, nested, is_resample, flat_decoder) -> str:
    simple = {"conv1.": "conv_in.", "head.0.": "norm_out.", "head.2.": "conv_out."}
    for ours, theirs in simple.items():
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    m = re.match(r"middle\.(\d)\.(.+)$", rest)
    if m:
        slot = {"0": "resnets.0", "1": "attentions.0", "2": "resnets.1"}[m.group(1)]
        return f"mid_block.{slot}.{_vae_inner_to_diffusers(m.group(2))}"
    if side == "encoder":
        if nested:
            m = re.match(r"downsamples\.(\d+)\.downsamples\.(\d+)\.(.+)$", rest)
            i, j, inner = m.groups()
            slot = ("downsampler" if is_resample(f"encoder.downsamples.{i}.downsamples.{j}.")
                    else f"resnets.{j}")
            return f"down_blocks.{i}.{slot}.{_vae_inner_to_diffusers(inner)}"
        m = re.match(r"downsamples\.(\d+)\.(.+)$", rest)
        return f"down_blocks.{m.group(1)}.{_vae_inner_to_diffusers(m.group(2))}"
    if nested:
        m = re.match(r"upsamples\.(\d+)\.upsamples\.(\d+)\.(.+)$", rest)
        i, j, inner = m.groups()
        slot = ("upsampler" if is_resample(f"decoder.upsamples.{i}.upsamples.{j}.")
                else f"resnets.{j}")
        return f"up_blocks.{i}.{slot}.{_vae_inner_to_diffusers(inner)}"
    m = re.match(r"upsamples\.(\d+)\.(.+)$", rest)
    return f"{flat_decoder[int(m.group(1))]}.{_vae_inner_to_diffusers(m.group(2))}"


def random_vae_state(component: str, config: dict | None = None, seed: int = 0):
    from ..wan.vae21 import WanVAE21
    from ..wan.vae22 import WanVAE22

    config = config or TINY_VAE[component]
    with torch.device("meta"):
        model = (WanVAE21 if component == "vae21" else WanVAE22)(**config)
    return randomize(model, seed)


def write_vae(path: str | Path, component: str = "vae21", layout: str = "official",
              config: dict | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
              state: dict[str, torch.Tensor] | None = None) -> Path:
    """Layouts: official (.safetensors as ComfyUI ships it, or .pth as the official release
    does, chosen by the file suffix) and diffusers (a folder with config.json)."""
    path = Path(path)
    state = _cast(state if state is not None else random_vae_state(component, config, seed), dtype)
    if layout == "official":
        _atomic_save(state, path)
        return path
    if layout == "diffusers":
        names = vae_ours_to_diffusers(list(state), nested=component == "vae22")
        path.mkdir(parents=True, exist_ok=True)
        _atomic_save({names[k]: v for k, v in state.items()},
                     path / "diffusion_pytorch_model.safetensors")
        (path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
        return path
    raise ValueError(f"unknown VAE layout {layout!r}")


# -- CLIP vision tower (Wan2.1 image-to-video) -------------------------------------------------

TINY_CLIP_VISION = dict(hidden=160, layers=3, heads=2, intermediate=320, image_size=56, patch=14)


def write_clip_vision(path: str | Path, config: dict | None = None, seed: int = 0,
                      dtype: torch.dtype = torch.float32, layout: str = "comfy") -> Path:
    """A CLIP vision tower. Layouts: comfy (ComfyUI's clip_vision_h.safetensors: vision_model.*
    plus the unused visual_projection) and official (the Wan2.1 release's .pth: visual.* with
    packed query/key/value, plus a stand-in text tower and logit scale, which are not read)."""
    from ..wan.clip_vision import CLIPVisionConfig, CLIPVisionEncoder
    from .clip_vision import official_state

    with torch.device("meta"):
        model = CLIPVisionEncoder(CLIPVisionConfig(**(config or TINY_CLIP_VISION)))
    state = _cast(randomize(model, seed), dtype)
    hidden = model.config.hidden
    if layout == "comfy":
        state["visual_projection.weight"] = torch.zeros(hidden, hidden, dtype=dtype)
    elif layout == "official":
        state = official_state(state)
        state["visual.head"] = torch.zeros(hidden, 8, dtype=dtype)
        state["textual.token_embedding.weight"] = torch.zeros(16, 8, dtype=dtype)
        state["log_scale"] = torch.zeros((), dtype=dtype)
    else:
        raise ValueError(f"unknown CLIP vision layout {layout!r}")
    path = Path(path)
    _atomic_save(state, path)
    return path


# -- text encoder ------------------------------------------------------------------------------

def random_t5_state(config: T5Config | None = None, seed: int = 0):
    from ..wan.t5 import UMT5Encoder

    with torch.device("meta"):
        model = UMT5Encoder.from_config(config or TINY_T5)
    return randomize(model, seed)


def write_text_encoder(path: str | Path, layout: str = "hf", config: T5Config | None = None,
                       seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                       spiece_model: bytes | None = None,
                       state: dict[str, torch.Tensor] | None = None) -> Path:
    """Layouts: official (Wan T5 names, .pth like models_t5_umt5-xxl-enc-bf16.pth) and hf
    (UMT5 names as ComfyUI's umt5_xxl files, with the sentencepiece model embedded as a uint8
    tensor `spiece_model` when given)."""
    from ..wan.t5 import wan_key_to_hf

    path = Path(path)
    state = _cast(state if state is not None else random_t5_state(config, seed), dtype)
    if layout == "official":
        _atomic_save(state, path)
        return path
    if layout == "hf":
        hf = {wan_key_to_hf(k): v for k, v in state.items()}
        hf["encoder.embed_tokens.weight"] = hf["shared.weight"].clone()
        if spiece_model is not None:
            hf["spiece_model"] = torch.frombuffer(bytearray(spiece_model), dtype=torch.uint8)
        _atomic_save(hf, path)
        return path
    raise ValueError(f"unknown text-encoder layout {layout!r}")


# -- a whole models folder ---------------------------------------------------------------------

def write_models_folder(root: str | Path, *, dit_name: str, vae_name: str, text_encoder_name: str,
                        kind: str = "ti2v", seed: int = 0) -> Path:
    """ComfyUI-style folders (diffusion_models/, vae/, text_encoders/) holding a tiny random
    model set under the given file names: a DiT of `kind` ("t2v": 16 channels with the Wan2.1
    VAE; "ti2v": 48 channels with the Wan2.2 VAE), its VAE, and a umT5 file in ComfyUI's layout
    with an embedded tokenizer. Existing files are kept."""
    from ..wan.tiny_tokenizer import build_spiece_model

    root = Path(root)
    vae_kind = "vae22" if kind == "ti2v" else "vae21"
    targets = {
        root / "diffusion_models" / dit_name:
            lambda p: write_dit(p, TINY_DIT[kind], "comfy", seed=seed),
        root / "vae" / vae_name: lambda p: write_vae(p, vae_kind, "official", seed=seed + 1),
        root / "text_encoders" / text_encoder_name:
            lambda p: write_text_encoder(p, "hf", seed=seed + 2,
                                         spiece_model=build_spiece_model()),
    }
    for path, write in targets.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
    return root
