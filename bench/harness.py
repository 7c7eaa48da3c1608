"""The one harness of the GPU benchmarks: the cases (real-size shapes and their tiny --quick
versions), seeded random weights on the device, our DiT on them, timing with CUDA events and
the memory peaks around it, output distances, and saving a result as JSON plus Markdown.

Every benchmark script imports it as `wan_enhanced.bench.harness` (run a script as
`python bench/NAME.py` or `python -m wan_enhanced.bench.NAME` from the repository root, with the
package importable: installed, or bench/gpu_env.sh on a GPU machine).
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..atomic_files import write_atomically
from ..checkpoints.tiny import TINY_VAE, randomize
from ..wan.configs import KNOWN_DITS, DiTConfig
from ..wan.dit import WanDiT, keeps_float32
from ..wan.vae21 import WanVAE21
from ..wan.vae22 import WanVAE22

GIB = 2 ** 30
TIMESTEP = 500.0


# -- cases -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiTCase:
    model: str  # a KNOWN_DITS name
    video: str  # W x H x frames
    latent: tuple[int, int, int, int, int]
    per_token_timestep: bool  # Wan2.2 TI2V: diffusers takes one timestep per token


@dataclass(frozen=True)
class VAECase:
    kind: str  # vae21 / vae22
    video: str
    latent: tuple[int, int, int, int, int]


CASES: dict[str, DiTCase | VAECase] = {
    "dit_5b": DiTCase("wan2.2-ti2v-5b", "1280x704x121", (1, 48, 31, 44, 80), True),
    "dit_1_3b": DiTCase("wan2.1-t2v-1.3b", "832x480x81", (1, 16, 21, 60, 104), False),
    "dit_14b": DiTCase("wan2.1-t2v-14b", "1280x720x81", (1, 16, 21, 90, 160), False),
    "vae21_decode": VAECase("vae21", "1280x720x81", (1, 16, 21, 90, 160)),
    "vae22_decode": VAECase("vae22", "1280x704x121", (1, 48, 31, 44, 80)),
}

# --quick: tiny models and latents (tiled decodes still get several tiles on both sides)
QUICK_DIT = dict(dim=256, ffn_dim=512, num_heads=2, num_layers=2)
QUICK_LATENT = {"dit_5b": (1, 48, 3, 8, 12), "dit_1_3b": (1, 16, 3, 8, 12),
                "dit_14b": (1, 16, 3, 8, 12), "vae21_decode": (1, 16, 2, 36, 20),
                "vae22_decode": (1, 48, 2, 18, 10)}


def dit_config(case: DiTCase, quick: bool) -> DiTConfig:
    config = KNOWN_DITS[case.model].config
    return replace(config, name=f"quick-{config.name}", **QUICK_DIT) if quick else config


def vae_config(case: VAECase, quick: bool) -> dict:
    return dict(TINY_VAE[case.kind]) if quick else {}


VAE_CLASSES = {"vae21": WanVAE21, "vae22": WanVAE22}


def vae_arguments(kind: str, config: dict) -> dict:
    """Our VAE constructor's arguments: its defaults (the released model) updated by `config`."""
    signature = inspect.signature(VAE_CLASSES[kind].__init__)
    defaults = {name: p.default for name, p in signature.parameters.items() if name != "self"}
    return {**defaults, **config}


def ours_vae(kind: str, config: dict, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Our VAE of `kind` built with `config`, holding the tensors of `state` themselves."""
    with torch.device("meta"):
        model = VAE_CLASSES[kind](**config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def images_from_video(video: torch.Tensor) -> torch.Tensor:
    """A decoded video [B, 3, F, H, W] in [-1, 1] (a peer's) -> our IMAGE layout [B*F, H, W, 3]
    in 0..1, float32 on the CPU (not clamped)."""
    images = video.float().cpu().add_(1.0).mul_(0.5).permute(0, 2, 3, 4, 1)
    return images.reshape(-1, *images.shape[2:])


def run_dtype(device: torch.device) -> torch.dtype:
    """bf16, what the comparison is about; float32 on the CPU, where bf16 convolutions crawl."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class DiTSetup:
    """One DiT case ready to run: its configuration, seeded random weights on the device and
    seeded inputs (noise, 512 text rows, t = TIMESTEP)."""
    config: DiTConfig
    latent: tuple[int, ...]
    state: dict[str, torch.Tensor]
    noise: torch.Tensor
    context: torch.Tensor
    timestep: torch.Tensor

    def parts(self) -> tuple:
        return (self.config, self.latent, self.state, self.noise, self.context, self.timestep)


def dit_setup(name: str, quick: bool, seed: int, device: torch.device, dtype: torch.dtype,
              per_token_timestep: bool | None = None) -> DiTSetup:
    """Case `name`'s weights (seed) and inputs (seed + 1). The timestep is one per token where
    the case says so (diffusers' TI2V form; per_token_timestep overrides), else one per
    sample."""
    case = CASES[name]
    config = dit_config(case, quick)
    latent = QUICK_LATENT[name] if quick else case.latent
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = random_state(skeleton, seed, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    noise = torch.randn(latent, generator=gen, device=device).to(dtype)
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen,
                          device=device).to(dtype)
    per_token = case.per_token_timestep if per_token_timestep is None else per_token_timestep
    b, _, f, h, w = latent
    pt, ph, pw = config.patch_size
    tokens = (f // pt) * (h // ph) * (w // pw)
    timestep = torch.full((b, tokens) if per_token else (b,), TIMESTEP, device=device)
    return DiTSetup(config, latent, state, noise, context, timestep)


@dataclass
class VAESetup:
    case: VAECase
    config: dict
    latent_shape: tuple
    dtype: torch.dtype
    state: dict[str, torch.Tensor]
    latent: torch.Tensor


def vae_setup(name: str, quick: bool, seed: int, device: torch.device) -> VAESetup:
    """VAE case `name`'s configuration, weights (seed) and raw latent (seed + 1), in the run
    dtype of `device`."""
    case = CASES[name]
    config = vae_config(case, quick)
    shape = QUICK_LATENT[name] if quick else case.latent
    dtype = run_dtype(device)
    with torch.device("meta"):
        skeleton = VAE_CLASSES[case.kind](**config)
    state = random_state(skeleton, seed, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    latent = torch.randn(shape, generator=gen, device=device).to(dtype)
    return VAESetup(case, config, shape, dtype, state, latent)


# -- weights --------------------------------------------------------------------------------

def random_state(module: torch.nn.Module, seed: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights for `module` (built on the meta device), drawn and kept on `device`
    (checkpoints/tiny.randomize's values; kept there: at 14B a copy to the host and back would
    be 28.6 GB each way), so one tensor set serves every model of a case."""
    return randomize(module, seed, device, dtype, keep_on_device=True)


def ours_dit(config: DiTConfig, state: dict[str, torch.Tensor],
             compute_dtype: torch.dtype) -> WanDiT:
    """Our DiT on the tensors of `state`; norms and modulation in float32, as our loader does."""
    with torch.device("meta"):
        model = WanDiT(config, compute_dtype)
    model.load_state_dict({k: v.float() if keeps_float32(k) else v for k, v in state.items()},
                          strict=True, assign=True)
    return model.eval().requires_grad_(False)


# -- timing ------------------------------------------------------------------------------------

@dataclass
class Run:
    """One model's timed runs: times in ms, peaks and the memory before them in bytes."""
    times_ms: list[float]
    peak_allocated: int | None
    peak_reserved: int | None
    allocated_before: int | None
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "times_ms": self.times_ms,
                "peak_allocated_bytes": self.peak_allocated,
                "peak_reserved_bytes": self.peak_reserved,
                "allocated_before_bytes": self.allocated_before, "error": self.error}


def bench_ms(fn: Callable[[], object], warmup: int = 50, rep: int = 300) -> float:
    """A kernel's time in ms: Triton's do_bench median (warmup and rep in ms of calls; it
    clears the L2 cache between calls)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device,
          to_cpu: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor | None, Run]:
    """Warm up once, then time `repeats` calls. Returns the last output moved to the CPU by
    `to_cpu` (outside the timing) and the measurements; an out-of-memory error is recorded."""
    cuda = device.type == "cuda"
    out = None
    try:
        with torch.inference_mode():
            fn()
            if cuda:
                torch.cuda.synchronize()
            gc.collect()
            before = torch.cuda.memory_allocated() if cuda else None
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(repeats):
                out = None  # the previous output is not part of the next call's peak
                out, ms = _call_ms(fn, cuda)
                times.append(ms)
            run = Run(times, torch.cuda.max_memory_allocated() - before if cuda else None,
                      torch.cuda.max_memory_reserved() - before if cuda else None, before)
            return to_cpu(out), run
    except RuntimeError as error:  # out of memory, or a backend refusing the shapes: recorded
        out = None
        return None, Run([], None, None, None, error=_failure(error))
    finally:
        out = None
        free_memory()


def _call_ms(fn: Callable[[], torch.Tensor], cuda: bool) -> tuple[torch.Tensor, float]:
    """fn's output and the milliseconds it took (CUDA events on a GPU)."""
    if not cuda:
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def _failure(error: RuntimeError, name: str = "") -> str:
    """Says what a timed call raised (out of memory, or a backend refusing the shapes) and
    returns it as a Run's error."""
    kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else "error"
    print(f"  {name + ': ' if name else ''}{kind}: {str(error)[:300]}", flush=True)
    return f"{kind}: {str(error)[:200]}"


def timed_in_turns(fns: dict[str, Callable[[], torch.Tensor]], repeats: int,
                   device: torch.device, to_cpu: Callable[[torch.Tensor], torch.Tensor]
                   ) -> dict[str, tuple[torch.Tensor | None, Run]]:
    """Like `timed`, for several calls that are to be compared: each is warmed up once (its
    output, moved to the CPU by `to_cpu`, is what this returns for it), then they are timed in
    turns, a b a b ..., `repeats` times each, so that a GPU that warms up, throttles or drifts
    during the run weighs on every side alike (timed one after the other, the side timed last
    ran on a hotter GPU: 1-6% on the lent H100s). Peak activation of each: the most allocated
    during its calls over what was allocated at their start. A call that runs out of memory or
    raises is recorded and leaves the turns."""
    cuda = device.type == "cuda"
    outs, times, peaks, errors = {}, {n: [] for n in fns}, {n: 0 for n in fns}, {}
    befores = {}

    def fail(name, error):
        errors[name] = _failure(error, name)
        outs[name] = None
        free_memory()

    with torch.inference_mode():
        for name, fn in fns.items():
            try:
                out = fn()
                if cuda:
                    torch.cuda.synchronize()
                outs[name] = to_cpu(out)
                del out
            except RuntimeError as error:
                fail(name, error)
            free_memory()
        for _ in range(repeats):
            for name, fn in fns.items():
                if name in errors:
                    continue
                try:
                    if cuda:
                        before = torch.cuda.memory_allocated()
                        befores.setdefault(name, before)
                        torch.cuda.reset_peak_memory_stats()
                    out, ms = _call_ms(fn, cuda)
                    del out
                    times[name].append(ms)
                    if cuda:
                        peaks[name] = max(peaks[name],
                                          torch.cuda.max_memory_allocated() - before)
                except RuntimeError as error:
                    fail(name, error)
    return {name: (outs.get(name), Run(times[name] if name not in errors else [],
                                       peaks[name] if cuda and name not in errors else None,
                                       None, befores.get(name), errors.get(name)))
            for name in fns}


def device_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what it holds on the device), a tensor
    subclass's (torchao's quantized weights) counted by the tensors it holds."""
    tensors = {t.data_ptr(): t.nbytes for p in [*model.parameters(), *model.buffers()]
               for t in _held_tensors(p)}
    return sum(tensors.values())


def _held_tensors(tensor: torch.Tensor):
    if not hasattr(type(tensor), "__tensor_flatten__"):
        yield tensor
        return
    for name in tensor.__tensor_flatten__()[0]:
        yield from _held_tensors(getattr(tensor, name))


def difference(ours: torch.Tensor | None, theirs: torch.Tensor | None) -> tuple[float, float]:
    """(max |ours - theirs|, that / max |theirs|), in float64 on the CPU."""
    if ours is None or theirs is None:
        return math.nan, math.nan
    diff = float((ours.double() - theirs.double()).abs().max())
    scale = float(theirs.double().abs().max())
    return diff, diff / scale if scale > 0 else math.inf


def float32_forward(config: DiTConfig, state: dict[str, torch.Tensor], noise: torch.Tensor,
                    timestep: torch.Tensor, context: torch.Tensor,
                    tf32: bool = False) -> torch.Tensor:
    """Our DiT computed in float32 end to end on the same weights and inputs: what the
    lower-precision runs approximate (our float32 DiT equals diffusers' and ComfyUI's to float32
    rounding). The weights become float32 in place, one tensor at a time, and go back to their
    dtype after (exactly: their values came from it), so the model is never held twice.
    tf32: TF32 matrix products, for the largest cases (some hundred times finer than bf16)."""
    dtypes = {key: value.dtype for key, value in state.items()}
    for key in dtypes:
        state[key] = state[key].float()
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    model = None
    try:
        model = ours_dit(config, state, torch.float32)
        with torch.inference_mode():
            out = model(noise.float(), timestep, context.float(), attention="sdpa")
        return out.float().cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
        del model
        for key, dtype in dtypes.items():
            state[key] = state[key].to(dtype)
        free_memory()


def distance(out: torch.Tensor | None, ref: torch.Tensor) -> dict:
    """max |out - ref| / max |ref| and ||out - ref|| / ||ref||, in float64 on the CPU."""
    if out is None:
        return {"max_rel": math.nan, "rel_l2": math.nan}
    diff = out.double() - ref.double()
    return {"max_rel": float(diff.abs().max() / ref.double().abs().max()),
            "rel_l2": float(diff.norm() / ref.double().norm())}


# -- results ----------------------------------------------------------------------------------

def device_name(device: torch.device | None = None) -> str:
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


def fmt(value, spec: str, scale: float = 1.0, missing: str = "-") -> str:
    """A table cell: `value / scale` formatted, or `missing` for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value / scale, spec)


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def gib(value) -> float | None:
    return None if value is None else value / GIB


def comfy_version(path: Path) -> str:
    """The version a ComfyUI checkout declares (comfyui_version.py), or "unknown"."""
    version_file = path / "comfyui_version.py"
    if version_file.is_file():
        for line in version_file.read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip("\"'")
    return "unknown"


def save_result(out: Path, stem: str, data: dict, markdown: str) -> None:
    """OUT/STEM.json and OUT/STEM.md, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / f"{stem}.json", json.dumps(data, indent=1).encode())
    write_atomically(out / f"{stem}.md", markdown.encode())
