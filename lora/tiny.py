"""Random LoRA files in every key format we read, for tests, the conformance data and the
benchmark: the same content (low-rank pairs, alphas, full differences) written under each
format's names, so two files of different formats hold the same LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic_files import atomic_target
from ..checkpoints.tiny import dit_ours_to_diffusers
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
}


@dataclass
class LoraContent:
    """pairs: our module name -> (up [out, rank], down [rank, in], alpha or None);
    diffs: our parameter name -> its difference (a weight, plain parameter or bias)."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float | None]] = field(default_factory=dict)
    diffs: dict[str, torch.Tensor] = field(default_factory=dict)


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
    for key, diff in content.diffs.items():
        module, leaf = key.rsplit(".", 1) if key.endswith((".weight", ".bias")) else (key, "")
        if fmt.startswith("kohya") and not leaf:
            raise ValueError(f"kohya names reach modules with a weight only, not {key}")
        name = prefix + _module_name(module if leaf else key, fmt, parameter=not leaf)
        state[name + (".diff_b" if leaf == "bias" else ".diff")] = diff.to(dtype).contiguous()
    return state


def _module_name(name: str, fmt: str, parameter: bool = False) -> str:
    if fmt.startswith("kohya"):
        return name.replace(".", "_")
    if fmt == "diffusers":
        return dit_ours_to_diffusers(name) if parameter else \
            dit_ours_to_diffusers(f"{name}.weight")[:-len(".weight")]
    return name


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
