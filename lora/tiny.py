"""Random LoRA files in every key format we read, for tests, the conformance data and the
benchmark: the same content (low-rank pairs, alphas, full differences, LoHa and LoKr factors,
DoRA magnitudes, PEFT lora_B biases, file-level settings) written under each format's names, so
two files of different formats hold the same LoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic_files import atomic_target
from ..checkpoints.keymaps import dit_ours_to_diffusers
from ..wan.configs import DiTConfig
from ..wan.dit import is_block_linear
from .keymap import dit_shapes

# format -> (prefix, up suffix, down suffix)
FORMATS = {
    "kohya": ("lora_unet_", ".lora_up.weight", ".lora_down.weight"),
    "kohya_fun": ("lora_unet__", ".lora_up.weight", ".lora_down.weight"),
    "generic": ("diffusion_model.", ".lora_B.weight", ".lora_A.weight"),
    "generic_down_up": ("diffusion_model.", ".lora_up.weight", ".lora_down.weight"),
    "bare": ("", ".lora_B.weight", ".lora_A.weight"),
    "diffusers": ("transformer.", ".lora_B.weight", ".lora_A.weight"),
    # LyCORIS module names (SimpleTuner, ai-toolkit): official or diffusers names, underscored
    "lycoris": ("lycoris_", ".lora_up.weight", ".lora_down.weight"),
    "lycoris_diffusers": ("lycoris_", ".lora_up.weight", ".lora_down.weight"),
    # LightX2V's extractor: pairs without alpha, a modulation's difference as `blocks.N.diff_m`
    "lightx2v": ("diffusion_model.", ".lora_up.weight", ".lora_down.weight"),
}


@dataclass
class LoraContent:
    """pairs: our module name -> (up [out, rank], down [rank, in], alpha or None);
    diffs: our parameter name -> its difference (a weight, plain parameter or bias);
    factored: our module name -> ({LoHa/LoKr key ending: tensor}, alpha or None);
    dora: our module name -> (magnitude, "dora_scale" | "lora_magnitude_vector");
    up_bias: our module name -> PEFT's lora_B bias; settings: file-level key -> number;
    replacements: our module name -> the weight that replaces its own (`.set_weight`)."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float | None]] = field(default_factory=dict)
    diffs: dict[str, torch.Tensor] = field(default_factory=dict)
    factored: dict[str, tuple[dict[str, torch.Tensor], float | None]] = field(
        default_factory=dict)
    dora: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)
    up_bias: dict[str, torch.Tensor] = field(default_factory=dict)
    settings: dict[str, float] = field(default_factory=dict)
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> new weight


def block_modules(config: DiTConfig, blocks=None) -> list[str]:
    """The block matrices' module names (all blocks, or those of the given block indices)."""
    names = [k[:-len(".weight")] for k in dit_shapes(config)
             if is_block_linear(k) and k.endswith(".weight")]
    if blocks is None:
        return names
    return [n for n in names if int(n.split(".")[1]) in blocks]


def random_lora(config: DiTConfig, seed: int = 0, modules: list[str] | None = None,
                rank: int | dict[str, int] = 4, alpha: float | None = None,
                diffs: tuple[str, ...] = (), magnitude: float = 0.2) -> LoraContent:
    """Seeded random pairs on `modules` (default: every block matrix) of rank `rank` (one for
    all, or per module), with `alpha` (None: no alpha key), plus full differences on the
    parameters `diffs`. Deltas are about `magnitude` of the weights they change."""
    shapes = dit_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    content = LoraContent()
    for module in block_modules(config) if modules is None else modules:
        out, *rest = shapes[f"{module}.weight"]
        width = 1
        for size in rest:
            width *= size
        r = rank if isinstance(rank, int) else rank[module]
        down = torch.randn(r, width, generator=gen) / width ** 0.5
        up = magnitude * torch.randn(out, r, generator=gen) / r ** 0.5
        content.pairs[module] = (up, down.reshape(r, *rest), alpha)
    for key in diffs:
        shape = shapes[key]
        typical = 0.05 if key.endswith(".bias") else magnitude / max(1, shape[-1]) ** 0.5
        content.diffs[key] = typical * torch.randn(shape, generator=gen)
    return content


# LightX2V's extractor (its tools/extract/lora_extractor.py) writes a 2-D weight of at least this
# many elements as a low-rank pair (no alpha) and every other changed tensor as a difference
LIGHTX2V_PAIR_MIN = 1_000_000


def lightx2v_lora(config: DiTConfig, seed: int = 0, rank: int = 64,
                  pair_min: int = LIGHTX2V_PAIR_MIN, magnitude: float = 0.2) -> LoraContent:
    """A step-distill LoRA as LightX2V's extractor writes it (format "lightx2v"): every tensor of
    the model changed, 2-D weights of `pair_min` elements or more as pairs of `rank`, the rest
    (biases, norms, modulations, small matrices, the patch embedding) as full differences."""
    pairs, diffs = [], []
    for key, shape in dit_shapes(config).items():
        if len(shape) == 2 and key.endswith(".weight") and math.prod(shape) >= pair_min:
            pairs.append(key[:-len(".weight")])
        else:
            diffs.append(key)
    return random_lora(config, seed=seed, modules=pairs, rank=rank, diffs=tuple(diffs),
                       magnitude=magnitude)


def random_loha(config: DiTConfig, seed: int, modules: list[str], rank: int = 4,
                alpha: float | None = None, tucker: tuple[str, ...] = (),
                magnitude: float = 0.2) -> LoraContent:
    """LoHa factors on `modules` (Tucker cores on those in `tucker`: convolutions)."""
    shapes = dit_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    content = LoraContent()
    for module in modules:
        out, into, *kernel = shapes[f"{module}.weight"]
        part = (magnitude / rank) ** 0.5
        factors = {}
        for side in ("1", "2"):
            if module in tucker:
                factors[f"hada_w{side}_a"] = part * torch.randn(rank, out, generator=gen)
                factors[f"hada_w{side}_b"] = torch.randn(rank, into, generator=gen) / into ** 0.5
                factors[f"hada_t{side}"] = torch.randn(rank, rank, *kernel, generator=gen) / rank
            else:
                width = into * math.prod(kernel)
                factors[f"hada_w{side}_a"] = part * torch.randn(out, rank, generator=gen)
                factors[f"hada_w{side}_b"] = torch.randn(rank, width, generator=gen) / width ** 0.5
        content.factored[module] = (factors, alpha)
    return content


def random_lokr(config: DiTConfig, seed: int, modules: list[str], factor: int = 4,
                rank: int = 4, alpha: float | None = None, layouts: dict[str, str] | None = None,
                magnitude: float = 0.2) -> LoraContent:
    """LoKr factors on `modules`: w1 [factor, factor] and w2 the rest of the weight. layouts
    (per module; default "w2_ab"): "w2_ab" (w1 whole, w2 = w2_a @ w2_b), "w1_ab" (w1 = w1_a @
    w1_b, w2 whole), "both_ab" (both decomposed), "whole" (both whole)."""
    shapes = dit_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    content = LoraContent()
    for module in modules:
        out, into, *kernel = shapes[f"{module}.weight"]
        layout = (layouts or {}).get(module, "w2_ab")
        rows, cols = out // factor, into // factor
        width = cols * math.prod(kernel)
        factors = {}
        w1_rank = min(rank, factor)
        if layout in ("w1_ab", "both_ab"):
            factors["lokr_w1_a"] = torch.randn(factor, w1_rank, generator=gen) / w1_rank ** 0.5
            factors["lokr_w1_b"] = torch.randn(w1_rank, factor, generator=gen)
        else:
            factors["lokr_w1"] = torch.randn(factor, factor, generator=gen)
        scale = magnitude / width ** 0.5
        if layout in ("w2_ab", "both_ab"):
            factors["lokr_w2_a"] = scale * torch.randn(rows, rank, generator=gen) / rank ** 0.5
            factors["lokr_w2_b"] = torch.randn(rank, width, generator=gen)
        else:
            factors["lokr_w2"] = scale * torch.randn(rows, cols, *kernel, generator=gen)
        content.factored[module] = (factors, alpha)
    content.settings["lokr_factor"] = float(factor)
    return content


def random_oft(config: DiTConfig, seed: int, modules: list[str], block_size: int = 8,
               constraint: float | None = None, magnitude: float = 0.05) -> LoraContent:
    """OFT blocks [rows / block_size, block_size, block_size] on `modules` (small entries: a
    rotation near the identity), with the constraint as the file's alpha when given."""
    shapes = dit_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    content = LoraContent()
    for module in modules:
        rows = shapes[f"{module}.weight"][0]
        blocks = magnitude * torch.randn(rows // block_size, block_size, block_size,
                                         generator=gen)
        content.factored[module] = ({"oft_blocks": blocks}, constraint)
    return content


def random_boft(config: DiTConfig, seed: int, modules: list[str], levels: int = 2,
                block_size: int = 8, constraint: float | None = None, rescale: bool = False,
                magnitude: float = 0.05) -> LoraContent:
    """BOFT blocks [levels, rows / block_size, block_size, block_size] (and a rescale per row)
    on `modules`."""
    shapes = dit_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    content = LoraContent()
    for module in modules:
        shape = shapes[f"{module}.weight"]
        rows = shape[0]
        factors = {"oft_blocks": magnitude * torch.randn(levels, rows // block_size, block_size,
                                                         block_size, generator=gen)}
        if rescale:
            factors["rescale"] = 1 + 0.1 * torch.randn(rows, *[1] * (len(shape) - 1),
                                                       generator=gen)
        content.factored[module] = (factors, constraint)
    return content


def random_glora(config: DiTConfig, seed: int, modules: list[str], rank: int = 4,
                 alpha: float | None = None, magnitude: float = 0.05) -> LoraContent:
    """GLoRA factors in its newer layout (W a1 a2 + b1 b2) on `modules`."""
    shapes = dit_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    content = LoraContent()
    for module in modules:
        out, into = shapes[f"{module}.weight"][:2]
        factors = {"a1.weight": magnitude * torch.randn(into, rank, generator=gen),
                   "a2.weight": torch.randn(rank, into, generator=gen) / rank ** 0.5,
                   "b1.weight": magnitude * torch.randn(out, rank, generator=gen),
                   "b2.weight": torch.randn(rank, into, generator=gen) / into ** 0.5}
        content.factored[module] = (factors, alpha)
    return content


def add_dora(content: LoraContent, base: dict[str, torch.Tensor], seed: int,
             modules: list[str], style: str = "dora_scale", axis: str = "rows") -> LoraContent:
    """DoRA magnitudes for `modules` of `content`: the base weight's norms (per output row or,
    for axis "columns", per input column) changed by about 10%, as a trained DoRA holds them.
    style "dora_scale" (kohya / LyCORIS; [out, 1] or [1, in]) or "lora_magnitude_vector" (PEFT;
    [out], rows only)."""
    gen = torch.Generator().manual_seed(seed)
    for module in modules:
        weight = base[f"{module}.weight"].float()
        if axis == "rows":
            norm = weight.reshape(weight.shape[0], -1).norm(dim=1)
            shape = (weight.shape[0],) if style == "lora_magnitude_vector" else (-1, 1)
        else:
            norm = weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)
            shape = (1, -1)
        noise = 1 + 0.1 * torch.randn(norm.shape, generator=gen)
        content.dora[module] = ((norm * noise).reshape(shape), style)
    return content


def lora_state(content: LoraContent, fmt: str,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The content under `fmt`'s key names."""
    prefix, up_suffix, down_suffix = FORMATS[fmt]
    state = {}
    for module, (up, down, alpha) in content.pairs.items():
        name = prefix + _module_name(module, fmt)
        state[name + up_suffix] = up.to(dtype).contiguous()
        state[name + down_suffix] = down.to(dtype).contiguous()
        if alpha is not None:
            state[name + ".alpha"] = torch.tensor(float(alpha))
    for module, (factors, alpha) in content.factored.items():
        name = prefix + _module_name(module, fmt)
        for ending, tensor in factors.items():
            state[f"{name}.{ending}"] = tensor.to(dtype).contiguous()
        if alpha is not None:
            state[name + ".alpha"] = torch.tensor(float(alpha))
    for module, (magnitude, style) in content.dora.items():
        state[f"{prefix}{_module_name(module, fmt)}.{style}"] = magnitude.to(dtype).contiguous()
    for module, bias in content.up_bias.items():
        if up_suffix != ".lora_B.weight":
            raise ValueError(f"a lora_B bias needs PEFT's names, not {fmt}'s")
        state[f"{prefix}{_module_name(module, fmt)}.lora_B.bias"] = bias.to(dtype).contiguous()
    for key, diff in content.diffs.items():
        module, leaf = key.rsplit(".", 1) if key.endswith((".weight", ".bias")) else (key, "")
        if fmt.startswith(("kohya", "lycoris")) and not leaf:
            raise ValueError(f"kohya names reach modules with a weight only, not {key}")
        if fmt == "lightx2v" and key.endswith(".modulation"):
            state[prefix + key[:-len(".modulation")] + ".diff_m"] = diff.to(dtype).contiguous()
            continue
        name = prefix + _module_name(module if leaf else key, fmt, parameter=not leaf)
        state[name + (".diff_b" if leaf == "bias" else ".diff")] = diff.to(dtype).contiguous()
    for module, weight in content.replacements.items():
        state[f"{prefix}{_module_name(module, fmt)}.set_weight"] = weight.to(dtype).contiguous()
    for key, value in content.settings.items():
        state[key] = torch.tensor(float(value))
    return state


def _module_name(name: str, fmt: str, parameter: bool = False) -> str:
    if fmt.startswith(("kohya", "lycoris")):
        if fmt == "lycoris_diffusers":
            name = dit_ours_to_diffusers(f"{name}.weight")[:-len(".weight")]
        return name.replace(".", "_")
    if fmt == "diffusers":
        return dit_ours_to_diffusers(name) if parameter else \
            dit_ours_to_diffusers(f"{name}.weight")[:-len(".weight")]
    return name


def merged_content(*contents: LoraContent) -> LoraContent:
    """One content holding every part of `contents` (modules must not repeat)."""
    out = LoraContent()
    for content in contents:
        for part in ("pairs", "diffs", "factored", "dora", "up_bias", "settings",
                     "replacements"):
            mine, theirs = getattr(out, part), getattr(content, part)
            overlap = set(mine) & set(theirs)
            if overlap:
                raise ValueError(f"{part} of {sorted(overlap)} given twice")
            mine.update(theirs)
    return out


def write_lora(path: str | Path, content: LoraContent, fmt: str = "kohya",
               dtype: torch.dtype = torch.float32) -> Path:
    """Write `content` in `fmt` to `path` (.safetensors, or .pth), atomically."""
    path = Path(path)
    state = lora_state(content, fmt, dtype)
    with atomic_target(path, path.name) as temp:
        if path.suffix == ".safetensors":
            save_file(state, str(temp))
        else:
            torch.save(state, str(temp))
    return path
