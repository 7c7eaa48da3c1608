"""ComfyUI's own end-to-end Wan pipeline on the model files and settings of one of our API
workflows, in one process, timed per phase: the peer of our end to end (`wan-enhanced bench`),
so that the two can be compared as a ratio.

    python bench/peer_comfy_e2e.py --comfyui PATH --workflow api_workflows/X.json --models ROOT
                                   --out DIR [--runs 2] [--set NODE.INPUT=VALUE ...] [--cpu]

PATH is a ComfyUI checkout; run the script with ComfyUI's Python (its venv): it imports ComfyUI's
`nodes`, `comfy_extras` and `comfy` from PATH and calls ComfyUI's node classes, as ComfyUI's own
Wan templates wire them; nothing of this package is imported (the workflow is read as JSON).
ROOT holds the model files in ComfyUI's layout (diffusion_models/, text_encoders/, vae/, loras/),
the same files our loaders read. --set changes a constant input of our workflow before the
translation (NODE: a node id, a class_type or a _meta title; VALUE: JSON, or else the text).
--cpu sets ComfyUI's --cpu (on a machine without a GPU); without it ComfyUI starts as its server
does (its cuda_malloc module is imported before torch, as main.py does).

Our nodes -> ComfyUI's (the translation is `comfy_plan`, data that tests check without ComfyUI):
  WanEnhancedModelLoader        UNETLoader(unet_name, weight_dtype): fp8_e4m3fn_fast ->
                                fp8_e4m3fn_fast, fp8_e4m3fn -> fp8_e4m3fn, auto / bf16 -> default
                                (ComfyUI picks the compute dtype); fp16, fp32 and int8 have no
                                UNETLoader equivalent and are refused; attention and keep_on_gpu
                                are ours alone (ComfyUI chooses its attention and offloading),
                                compile is refused (the templates do not compile).
  WanEnhancedLoRALoader         LoraLoaderModelOnly(lora_name, strength_model=strength); ComfyUI
                                patches the weights when the model is loaded (our "merge").
  WanEnhancedTextEncoderLoader  CLIPLoader(clip_name, type "wan", device "default", or "cpu" for
                                our device cpu); our dtype is not translated.
  WanEnhancedVAELoader          VAELoader(vae_name); our dtype is not translated.
  WanEnhancedTextEncode         two CLIPTextEncode (positive, negative).
  WanEnhancedEmptyLatent        48-channel models (Wan2.2 TI2V-5B; the DiT file's head tells):
                                Wan22ImageToVideoLatent(vae, width, height, length=frames,
                                batch_size) with no start image; 16-channel models (Wan2.1, A14B):
                                EmptyHunyuanLatentVideo(width, height, length, batch_size).
  WanEnhancedSampler            ModelSamplingSD3(shift) on the model, then KSampler(seed, steps,
                                cfg, sampler_name, scheduler "simple", denoise); our scheduler
                                euler -> euler, unipc -> uni_pc, dpm++ -> dpmpp_2m. With a
                                low_noise_model (Wan2.2 A14B): ModelSamplingSD3 on each expert and
                                two KSamplerAdvanced as the Wan2.2 14B template wires them: the
                                high-noise expert steps 0..k (add_noise and
                                return_with_leftover_noise enable, noise_seed = seed), the
                                low-noise expert steps k..steps (add_noise disable, noise_seed 0,
                                cfg_low_noise), k = the steps our sampler gives the high-noise
                                expert (integer timestep >= boundary * 1000 on our shifted grid;
                                boundary -1 = 0.875). denoise < 1 with two experts, gpus > 1 and
                                fsdp are refused; block_swap / prefetch_blocks are ours alone;
                                cache easycache -> ComfyUI's EasyCache node (reuse_threshold =
                                our cache_threshold, start 0.15, end 0.95) on each expert after
                                ModelSamplingSD3.
  WanEnhancedTiledDecode        VAEDecode (what the templates use); our tile settings are ours.
  WanEnhancedSaveVideo          CreateVideo(images, fps) + SaveVideo(filename_prefix, format
                                "mp4", codec "h264"); SaveVideo has no crf input (ComfyUI's
                                encoder picks its own quality), so our crf is not translated.
  WanEnhancedDecodeSaveVideo    VAEDecode + CreateVideo + SaveVideo, as the two above.
Any other node is refused, naming it. Every input that is not translated is listed in the
output's `not_translated`.

Runs: `--runs` times in the same process. Run 1 is cold (models read from disk). Runs 2+ are what
a ComfyUI server does with a second prompt that differs only in the seed (seed + 1 per run):
a node whose inputs and upstream nodes did not change is not run again and its output is
reused, as ComfyUI's output cache does (the loaders, the LoRA and ModelSamplingSD3 patches, the
text encodes and the empty latent); the sampling, decode and save run again. Models stay where
ComfyUI's memory manager left them, as in a server; ComfyUI's `cleanup_models_gc` runs before
each run and everything runs under torch.inference_mode, as its executor does.

Timing: time.perf_counter around each node call (torch.cuda.synchronize() before each clock
reading on CUDA), added up per phase: load (UNETLoader, CLIPLoader, VAELoader,
LoraLoaderModelOnly, ModelSamplingSD3: the files read into host memory, LoRA patches queued),
text_encode (CLIPTextEncode, which moves the text encoder to the GPU first), latent, sample
(KSampler / KSamplerAdvanced: ComfyUI moves the model to the GPU and applies the LoRA patches
inside the sampler call, so that time is in `sample`, and within it in the first step), decode
(VAEDecode), video_write (CreateVideo + SaveVideo), total (the whole run; total minus the phases
is the script's own bookkeeping). Sampling steps are timed by ComfyUI's progress-bar hook
(comfy.utils.set_progress_bar_global_hook, which KSampler's callback updates after every step):
first_step = the first sampler call's start to its first step's end (includes moving the model
to the GPU and patching it); steady_steps = all later steps together (with two experts this
includes the second expert's move and patch in its first step); step_times lists them all.
device_load: time inside ComfyUI's model_management.load_models_gpu, per phase (it is wrapped
to be timed, not changed). Peaks per run: torch.cuda.max_memory_allocated / reserved (reset at
each run's start) on CUDA; host peak RSS from /proc/self/status VmHWM, reset at each run's start
through /proc/self/clear_refs where the kernel allows it (otherwise the process's peak so far).

Output: DIR/peer_comfy_e2e.json (one record per run with its phases, the settings, the plan that
ran and the environment: ComfyUI's version from comfyui_version.py and `git rev-parse HEAD` of
PATH, torch, device) and DIR/peer_comfy_e2e.md (a table, also printed); a later run into the
same folder replaces the records of the same workflow and keeps the others. Videos go to
DIR/output/.

Caveats: ComfyUI's own choices stand (attention kernel, weight and compute dtypes, offloading,
VAE decode tiling when memory is short, encoder quality): that is the point of the comparison,
and it is why the settings above are not all translated. A server adds request handling and
websocket progress messages that this script leaves out. ComfyUI's CLIPLoader and VAELoader
build the released umt5-xxl and Wan VAE shapes whatever a file holds; for tests with tiny files,
--text-encoder-config passes overrides of the umt5-xxl config to ComfyUI's loader
(model_options "umt5xxl_model_config", read by comfy.sd1_clip) and the VAE files must have the
released shapes. With --text-encoder-config the text encoder is loaded by comfy.sd.load_clip
directly, with the arguments CLIPLoader passes plus that override. Where ComfyUI 0.3.64 computes
something else than we do: it does not load the `blocks.N.diff_m` / `head.diff_m` modulation
differences of a LightX2V-layout LoRA (it logs "lora key not loaded"; ours applies them), and
Wan22ImageToVideoLatent returns a batch of 1 without a start image whatever batch_size is.
Importing ComfyUI is not in any run (environment.comfyui.import_seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import inspect
import json
import logging
import os
import platform
import re
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

PHASES = ("load", "text_encode", "latent", "sample", "decode", "video_write")
SAMPLER_NAMES = {"euler": "euler", "unipc": "uni_pc", "dpm++": "dpmpp_2m"}
# our grid's first sigma per solver (sampling/schedules.py): euler and unipc start at float32(0.999)
_SIGMA_MAX = {"euler": 0.9990000128746033, "unipc": 0.9990000128746033, "dpm++": 1.0}
WEIGHT_DTYPES = {"auto": "default", "bf16": "default", "fp8_e4m3fn": "fp8_e4m3fn",
                 "fp8_e4m3fn_fast": "fp8_e4m3fn_fast"}
T2V_BOUNDARY = 0.875
NUM_TRAIN_TIMESTEPS = 1000
# ComfyUI node class -> the module of the checkout that defines it
COMFY_MODULES = {
    "UNETLoader": "nodes", "CLIPLoader": "nodes", "VAELoader": "nodes",
    "LoraLoaderModelOnly": "nodes", "CLIPTextEncode": "nodes", "KSampler": "nodes",
    "KSamplerAdvanced": "nodes", "VAEDecode": "nodes",
    "ModelSamplingSD3": "comfy_extras.nodes_model_advanced",
    "EasyCache": "comfy_extras.nodes_easycache:EasyCacheNode",  # (module:class where they differ)
    "EmptyHunyuanLatentVideo": "comfy_extras.nodes_hunyuan",
    "Wan22ImageToVideoLatent": "comfy_extras.nodes_wan",
    "CreateVideo": "comfy_extras.nodes_video", "SaveVideo": "comfy_extras.nodes_video",
}
SAMPLERS = ("KSampler", "KSamplerAdvanced")
RESULT_NAME = "peer_comfy_e2e"


class TranslationError(ValueError):
    """A node or input of our workflow that has no ComfyUI counterpart; names the node."""


class ComfyCheckoutError(RuntimeError):
    pass


# -- the translation -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Ref:
    """Output `index` of the plan step `step`."""
    step: str
    index: int = 0


@dataclass
class Step:
    key: str          # unique in the plan: our node id, with a suffix where one node becomes many
    node: str         # ComfyUI node class
    inputs: dict      # constants, or Ref to an earlier step
    phase: str
    source: str       # "ID ClassType" of our node

    def as_json(self) -> dict:
        return {"key": self.key, "node": self.node, "phase": self.phase, "source": self.source,
                "inputs": {k: ({"from": v.step, "output": v.index} if isinstance(v, Ref) else v)
                           for k, v in self.inputs.items()}}


@dataclass
class Plan:
    steps: list[Step]
    not_translated: list[str] = field(default_factory=list)

    def step(self, key: str) -> Step:
        return next(s for s in self.steps if s.key == key)

    def nodes(self) -> list[str]:
        return [s.node for s in self.steps]


def channels_from_name(model_name: str) -> int:
    """Latent channels guessed from a file name (Wan2.2 TI2V-5B: 48, every other Wan: 16); the
    script reads the file's header instead when it has the file."""
    name = model_name.lower()
    return 48 if "ti2v" in name or "5b" in name else 16


def channels_from_file(path: Path) -> int:
    """Latent channels of a DiT safetensors file: its head's rows / (1 * 2 * 2) patch size."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    for key, value in header.items():
        if key.endswith("head.head.weight"):
            return value["shape"][0] // 4
    raise TranslationError(f"{path}: no head.head.weight, not a Wan DiT file")


def expert_switch_step(steps: int, shift: float, boundary: float, scheduler: str) -> int:
    """Steps our sampler gives the high-noise expert: those whose integer timestep (the shifted
    sigma * 1000, truncated) is >= boundary * 1000 on our schedule grid (numpy's
    linspace(sigma_max, 0, steps + 1) computed in the same float64 operations)."""
    count = 0
    start = _SIGMA_MAX[scheduler]
    delta = (0.0 - start) / steps
    for i in range(steps):
        base = i * delta + start
        shifted = shift * base / (1 + (shift - 1) * base)
        if int(shifted * NUM_TRAIN_TIMESTEPS) >= boundary * NUM_TRAIN_TIMESTEPS:
            count += 1
    return count


def _order(workflow: dict) -> list[str]:
    """Node ids in an order where every node comes after the nodes it links from."""
    done, order = set(), []

    def visit(node_id: str, path: tuple):
        if node_id in done:
            return
        if node_id in path:
            raise TranslationError(f"node {node_id}: the workflow has a cycle")
        if node_id not in workflow:
            raise TranslationError(f"node {path[-1]} links from node {node_id}, which is not "
                                   f"in the workflow")
        for value in workflow[node_id].get("inputs", {}).values():
            if _is_link(value):
                visit(str(value[0]), path + (node_id,))
        done.add(node_id)
        order.append(node_id)

    for node_id in sorted(workflow, key=lambda k: (len(k), k)):
        visit(node_id, ())
    return order


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) \
        and isinstance(value[0], (str, int))


def comfy_plan(workflow: dict, latent_channels: Callable[[str], int] = channels_from_name
               ) -> Plan:
    """Our API workflow as ComfyUI node calls, in an order ComfyUI could run them; phases in
    PHASES order. latent_channels(model_name) tells a 48-channel (TI2V-5B) model from a
    16-channel one."""
    steps: list[Step] = []
    notes: list[str] = []
    outputs: dict[tuple[str, int], Ref] = {}   # (our node id, output) -> plan output
    model_file: dict[str, str] = {}            # our node id of a model -> its DiT file

    def link(node_id: str, inputs: dict, name: str, required: bool = True):
        value = inputs.get(name)
        if value is None and not required:
            return None
        if not _is_link(value):
            raise TranslationError(f"node {node_id} ({workflow[node_id]['class_type']}): input "
                                   f"{name!r} must be linked from another node")
        key = (str(value[0]), value[1])
        if key not in outputs:
            raise TranslationError(f"node {node_id}: input {name!r} links from node "
                                   f"{value[0]} output {value[1]}, which is not translated")
        return outputs[key]

    def ignore(node_id: str, kind: str, inputs: dict, names: dict[str, Any]):
        """Record our inputs that have no ComfyUI counterpart (when not at their default)."""
        for name, default in names.items():
            if name in inputs and inputs[name] != default:
                notes.append(f"{node_id} {kind}.{name}={inputs[name]!r}: not translated")

    for node_id in _order(workflow):
        node = workflow[node_id]
        kind = node.get("class_type")
        inputs = node.get("inputs", {})
        source = f"{node_id} {kind}"

        def add(key, cls, phase, **values):
            steps.append(Step(key, cls, values, phase, source))
            return Ref(key)

        def refuse(why: str):
            raise TranslationError(f"node {node_id} ({kind}): {why}")

        if kind == "WanEnhancedModelLoader":
            dtype = inputs.get("weight_dtype", "auto")
            if dtype not in WEIGHT_DTYPES:
                refuse(f"weight_dtype {dtype!r} has no UNETLoader equivalent (ComfyUI's are "
                       f"default, fp8_e4m3fn, fp8_e4m3fn_fast, fp8_e5m2); translatable: "
                       f"{', '.join(WEIGHT_DTYPES)}")
            if inputs.get("compile", False):
                refuse("compile=true: ComfyUI's Wan templates do not compile the model; set "
                       "compile false")
            ignore(node_id, kind, inputs, {"attention": "auto", "keep_on_gpu": False})
            outputs[(node_id, 0)] = add(node_id, "UNETLoader", "load",
                                        unet_name=inputs["model_name"],
                                        weight_dtype=WEIGHT_DTYPES[dtype])
            model_file[node_id] = inputs["model_name"]
        elif kind == "WanEnhancedLoRALoader":
            model = link(node_id, inputs, "model")
            ignore(node_id, kind, inputs, {"mode": "merge"})
            outputs[(node_id, 0)] = add(node_id, "LoraLoaderModelOnly", "load", model=model,
                                        lora_name=inputs["lora_name"],
                                        strength_model=float(inputs.get("strength", 1.0)))
            model_file[node_id] = model_file[str(inputs["model"][0])]
        elif kind == "WanEnhancedTextEncoderLoader":
            ignore(node_id, kind, inputs, {"dtype": "auto", "keep_on_gpu": False})
            device = "cpu" if inputs.get("device", "gpu") == "cpu" else "default"
            outputs[(node_id, 0)] = add(node_id, "CLIPLoader", "load",
                                        clip_name=inputs["text_encoder_name"], type="wan",
                                        device=device)
        elif kind == "WanEnhancedVAELoader":
            ignore(node_id, kind, inputs, {"dtype": "auto", "keep_on_gpu": False})
            outputs[(node_id, 0)] = add(node_id, "VAELoader", "load",
                                        vae_name=inputs["vae_name"])
        elif kind == "WanEnhancedTextEncode":
            clip = link(node_id, inputs, "text_encoder")
            for index, which in enumerate(("positive", "negative")):
                outputs[(node_id, index)] = add(f"{node_id}.{which}", "CLIPTextEncode",
                                                "text_encode", clip=clip,
                                                text=inputs.get(which, ""))
        elif kind == "WanEnhancedEmptyLatent":
            model_ref = inputs.get("model")
            if not _is_link(model_ref) or str(model_ref[0]) not in model_file:
                refuse("input 'model' must link from a Wan Model Loader (or a LoRA on one)")
            size = dict(width=int(inputs["width"]), height=int(inputs["height"]),
                        length=int(inputs["frames"]), batch_size=int(inputs.get("batch", 1)))
            channels = latent_channels(model_file[str(model_ref[0])])
            if channels == 48:
                vaes = [s for s in steps if s.node == "VAELoader"]
                if len(vaes) != 1:
                    refuse(f"Wan22ImageToVideoLatent needs a VAE and the workflow has "
                           f"{len(vaes)} VAE loaders before it; expected one")
                outputs[(node_id, 0)] = add(node_id, "Wan22ImageToVideoLatent", "latent",
                                            vae=Ref(vaes[0].key), **size)
            elif channels == 16:
                outputs[(node_id, 0)] = add(node_id, "EmptyHunyuanLatentVideo", "latent",
                                            **size)
            else:
                refuse(f"a {channels}-channel model: no ComfyUI empty-latent node for it")
        elif kind == "WanEnhancedSampler":
            scheduler = inputs.get("scheduler", "unipc")
            if scheduler not in SAMPLER_NAMES:
                refuse(f"scheduler {scheduler!r}: translatable are {', '.join(SAMPLER_NAMES)}")
            if int(inputs.get("gpus", 1)) != 1 or inputs.get("fsdp", False):
                refuse("gpus > 1 / fsdp: ComfyUI samples on one GPU; set gpus 1, fsdp false")
            ignore(node_id, kind, inputs, {"block_swap": 0, "prefetch_blocks": 1})
            unknown = set(inputs) - {"model", "positive", "negative", "latent", "seed", "steps",
                                     "cfg", "shift", "scheduler", "denoise", "low_noise_model",
                                     "boundary", "cfg_low_noise", "block_swap",
                                     "prefetch_blocks", "gpus", "fsdp", "cache",
                                     "cache_threshold"}
            if unknown:
                refuse(f"inputs {sorted(unknown)} cannot be translated")
            cache = inputs.get("cache", "off")
            if cache not in ("off", "easycache"):
                refuse(f"cache {cache!r}: translatable are off and easycache")
            threshold = float(inputs.get("cache_threshold", -1.0))

            def cached(key: str, shifted: Ref) -> Ref:
                """ComfyUI's EasyCache node on the model, as a user adds it, when ours runs,
                with our sampler's EasyCache settings."""
                if cache == "off":
                    return shifted
                from wan_enhanced.sampling.step_cache import EasyCacheSettings
                ours = EasyCacheSettings()
                return add(key, "EasyCache", "load", model=shifted,
                           reuse_threshold=ours.threshold if threshold < 0 else threshold,
                           start_percent=ours.start_percent, end_percent=ours.end_percent,
                           verbose=False)

            model = link(node_id, inputs, "model")
            positive = link(node_id, inputs, "positive")
            negative = link(node_id, inputs, "negative")
            latent = link(node_id, inputs, "latent")
            low = link(node_id, inputs, "low_noise_model", required=False)
            seed, steps_n = int(inputs["seed"]), int(inputs["steps"])
            cfg, shift = float(inputs["cfg"]), float(inputs["shift"])
            denoise = float(inputs.get("denoise", 1.0))
            common = dict(sampler_name=SAMPLER_NAMES[scheduler], scheduler="simple",
                          positive=positive, negative=negative)
            if low is None:
                for name in ("boundary", "cfg_low_noise"):
                    if float(inputs.get(name, -1.0)) >= 0:
                        notes.append(f"{node_id} {kind}.{name}: only used with a "
                                     f"low_noise_model; not translated")
                patched = cached(f"{node_id}.cache", add(
                    f"{node_id}.shift", "ModelSamplingSD3", "load", model=model, shift=shift))
                outputs[(node_id, 0)] = add(node_id, "KSampler", "sample", model=patched,
                                            seed=seed, steps=steps_n, cfg=cfg,
                                            latent_image=latent, denoise=denoise, **common)
                continue
            if denoise != 1.0:
                refuse("denoise < 1 with two experts: KSamplerAdvanced has no denoise input")
            boundary = float(inputs.get("boundary", -1.0))
            boundary = T2V_BOUNDARY if boundary < 0 else boundary
            cfg_low = float(inputs.get("cfg_low_noise", -1.0))
            cfg_low = cfg if cfg_low < 0 else cfg_low
            switch = expert_switch_step(steps_n, shift, boundary, scheduler)
            high_model = cached(f"{node_id}.cache_high", add(
                f"{node_id}.shift_high", "ModelSamplingSD3", "load", model=model, shift=shift))
            low_model = cached(f"{node_id}.cache_low", add(
                f"{node_id}.shift_low", "ModelSamplingSD3", "load", model=low, shift=shift))
            high = add(f"{node_id}.high", "KSamplerAdvanced", "sample", model=high_model,
                       add_noise="enable", noise_seed=seed, steps=steps_n, cfg=cfg,
                       latent_image=latent, start_at_step=0, end_at_step=switch,
                       return_with_leftover_noise="enable", **common)
            # the low-noise expert adds no noise, so its seed is unused (the template's 0)
            outputs[(node_id, 0)] = add(f"{node_id}.low", "KSamplerAdvanced", "sample",
                                        model=low_model, add_noise="disable", noise_seed=0,
                                        steps=steps_n, cfg=cfg_low, latent_image=high,
                                        start_at_step=switch, end_at_step=steps_n,
                                        return_with_leftover_noise="disable", **common)
        elif kind in ("WanEnhancedTiledDecode", "WanEnhancedSaveVideo",
                      "WanEnhancedDecodeSaveVideo"):
            if kind != "WanEnhancedSaveVideo":
                ignore(node_id, kind, inputs, {"mode": "auto"})
                notes.append(f"{node_id} {kind}: tile settings not translated (VAEDecode, as "
                             f"the templates)")
                outputs[(node_id, 0)] = add(node_id, "VAEDecode", "decode",
                                            samples=link(node_id, inputs, "latent"),
                                            vae=link(node_id, inputs, "vae"))
            if kind != "WanEnhancedTiledDecode":
                notes.append(f"{node_id} {kind}.crf={inputs.get('crf')!r}: not translated "
                             f"(ComfyUI's SaveVideo has no crf input)")
                images = outputs[(node_id, 0)] if kind == "WanEnhancedDecodeSaveVideo" else \
                    link(node_id, inputs, "images")
                video = add(f"{node_id}.create", "CreateVideo", "video_write",
                            images=images, fps=float(inputs["fps"]))
                add(f"{node_id}.save", "SaveVideo", "video_write", video=video,
                    filename_prefix=inputs.get("filename_prefix", "video/ComfyUI"),
                    format="mp4", codec="h264")
        else:
            refuse("no ComfyUI counterpart is known to this benchmark; it translates "
                   "WanEnhancedModelLoader, WanEnhancedLoRALoader, "
                   "WanEnhancedTextEncoderLoader, WanEnhancedVAELoader, WanEnhancedTextEncode, "
                   "WanEnhancedEmptyLatent, WanEnhancedSampler, WanEnhancedTiledDecode, "
                   "WanEnhancedSaveVideo and WanEnhancedDecodeSaveVideo")

    rank = {phase: i for i, phase in enumerate(PHASES)}
    ordered = sorted(steps, key=lambda s: rank[s.phase])  # stable: keeps dependency order
    return Plan(ordered, notes)


def for_run(plan: Plan, run: int) -> Plan:
    """The plan of run `run` (0-based): every sampler seed + run, as a second prompt that
    changes only the seed."""
    steps = []
    for step in plan.steps:
        inputs = dict(step.inputs)
        if step.node == "KSampler":
            inputs["seed"] += run
        elif step.node == "KSamplerAdvanced" and inputs["add_noise"] == "enable":
            inputs["noise_seed"] += run
        steps.append(Step(step.key, step.node, inputs, step.phase, step.source))
    return Plan(steps, plan.not_translated)


def signatures(plan: Plan) -> dict[str, str]:
    """Per step: its node and inputs with every link replaced by the upstream step's
    signature. Equal signatures = equal outputs, which is how ComfyUI's output cache decides."""
    out: dict[str, str] = {}
    for step in plan.steps:
        values = {k: (["link", out[v.step], v.index] if isinstance(v, Ref) else v)
                  for k, v in sorted(step.inputs.items())}
        out[step.key] = json.dumps([step.node, values], sort_keys=True, ensure_ascii=False)
    return out


# -- --set -----------------------------------------------------------------------------------

def apply_sets(workflow: dict, assignments: list[str]) -> dict:
    """NODE.INPUT=VALUE: NODE is a node id, a class_type or a _meta title (unique); VALUE is
    JSON when it parses, otherwise the text; an int given where a float stands becomes a float."""
    result = copy.deepcopy(workflow)
    for text in assignments:
        path, sep, raw = text.partition("=")
        node, dot, name = path.strip().rpartition(".")
        if not sep or not dot or not node or not name:
            raise TranslationError(f"--set {text!r}: expected NODE.INPUT=VALUE")
        matches = [i for i in result if i == node] or \
            [i for i, n in result.items() if n.get("class_type") == node] or \
            [i for i, n in result.items() if n.get("_meta", {}).get("title") == node]
        if len(matches) != 1:
            raise TranslationError(f"--set {text!r}: {len(matches)} nodes match {node!r} "
                                   f"({', '.join(matches) or 'none'}); use a node id")
        inputs = result[matches[0]].setdefault("inputs", {})
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        old = inputs.get(name)
        if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        inputs[name] = value
    return result


# -- timing arithmetic -------------------------------------------------------------------------

@dataclass
class Call:
    key: str
    node: str
    phase: str
    start: float
    end: float
    cached: bool = False
    steps: list[float] = field(default_factory=list)   # progress-hook times (step ends)
    device_load: float = 0.0


def summarize(calls: list[Call], run_start: float, run_end: float) -> dict:
    """Per-phase seconds (a cached call counts 0), the sampler's step times, the total, and
    what of the total no node call took (`other`)."""
    phases = {phase: 0.0 for phase in PHASES}
    device_load = {phase: 0.0 for phase in PHASES}
    step_times: list[float] = []
    for call in calls:
        if call.cached:
            continue
        phases[call.phase] += call.end - call.start
        device_load[call.phase] += call.device_load
        if call.node in SAMPLERS:
            previous = call.start
            for t in call.steps:
                step_times.append(t - previous)
                previous = t
    total = run_end - run_start
    summary = {"phases": phases, "total": total, "other": total - sum(phases.values()),
               "device_load": {k: v for k, v in device_load.items() if v},
               "step_times": step_times,
               "first_step": step_times[0] if step_times else None,
               "steady_steps": sum(step_times[1:]) if len(step_times) > 1 else None,
               "cached": [c.key for c in calls if c.cached]}
    return summary


# -- ComfyUI -----------------------------------------------------------------------------------

class Comfy:
    """ComfyUI imported from a checkout, headless, with its node classes and a caller."""

    def __init__(self, path: Path, models: Path, output: Path, cpu: bool):
        path = path.resolve()
        if not (path / "nodes.py").is_file() or not (path / "comfy" / "sd.py").is_file():
            raise ComfyCheckoutError(f"--comfyui {path}: not a ComfyUI checkout (no nodes.py "
                                     f"and comfy/sd.py)")
        self.path = path
        start = time.perf_counter()
        sys.path.insert(0, str(path))
        import comfy.options
        comfy.options.enable_args_parsing(False)
        from comfy.cli_args import args
        args.cpu = cpu
        if not cpu and "torch" not in sys.modules:
            import cuda_malloc  # noqa: F401  (as ComfyUI's main.py: before torch)
        import torch
        import folder_paths
        import comfy.model_management as mm
        import comfy.utils
        self.torch, self.mm, self.utils, self.args = torch, mm, comfy.utils, args
        for name in ("diffusion_models", "text_encoders", "vae", "loras"):
            folder_paths.add_model_folder_path(name, str(models / name), is_default=True)
        output.mkdir(parents=True, exist_ok=True)
        folder_paths.set_output_directory(str(output))
        self.folder_paths = folder_paths
        import importlib
        self.classes = {}
        for name, where in COMFY_MODULES.items():
            module, _, attribute = where.partition(":")
            try:
                self.classes[name] = getattr(importlib.import_module(module), attribute or name)
            except (ImportError, AttributeError) as exc:
                raise ComfyCheckoutError(f"--comfyui {path}: this ComfyUI has no {name} in "
                                         f"{module} ({exc}); use 0.3.64 or later") from None
        self.cuda = (not cpu) and torch.cuda.is_available() \
            and mm.get_torch_device().type == "cuda"
        self.import_seconds = time.perf_counter() - start
        self.current: Call | None = None
        comfy.utils.set_progress_bar_global_hook(self._progress)
        # later ComfyUIs than 0.3.64 pass the hook only some of the steps (at least an interval
        # and a share of the total apart); the step times need every step
        for name in ("PROGRESS_THROTTLE_MIN_INTERVAL", "PROGRESS_THROTTLE_MIN_PERCENT"):
            if hasattr(comfy.utils, name):
                setattr(comfy.utils, name, 0)
        original = mm.load_models_gpu

        def timed_load_models_gpu(*a, **k):
            t0 = self.clock()
            try:
                return original(*a, **k)
            finally:
                if self.current is not None:
                    self.current.device_load += self.clock() - t0
        mm.load_models_gpu = timed_load_models_gpu

    def clock(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def _progress(self, value, total, preview=None, *args, **kwargs):
        if self.current is not None and self.current.node in SAMPLERS:
            self.current.steps.append(self.clock())

    def call(self, name: str, inputs: dict, unique_id: str):
        """Run one node as ComfyUI's executor does: V3 nodes (io.ComfyNode) through a class
        clone with the hidden inputs, V1 nodes through an instance's FUNCTION. Returns the
        output tuple and the UI dict (or None)."""
        cls = self.classes[name]
        try:
            from comfy_api.internal import _ComfyNodeInternal, make_locked_method_func
        except ImportError:
            _ComfyNodeInternal = None
        if _ComfyNodeInternal is not None and isinstance(cls, type) \
                and issubclass(cls, _ComfyNodeInternal):
            cls.VALIDATE_CLASS()
            hidden = {"UNIQUE_ID": unique_id}
            # ComfyUI 0.3.64 takes the hidden inputs; later ones a dict holding them (v3_data)
            first = next(iter(inspect.signature(cls.PREPARE_CLASS_CLONE).parameters))
            clone = cls.PREPARE_CLASS_CLONE(
                {"hidden_inputs": hidden} if first == "v3_data" else hidden)
            function = make_locked_method_func(cls, cls.FUNCTION, clone)
        else:
            function = getattr(cls(), cls.FUNCTION)
        result = function(**inputs)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        if isinstance(result, dict):
            return tuple(result.get("result") or ()), result.get("ui")
        if isinstance(result, tuple):
            return result, None
        ui = getattr(result, "ui", None)
        if ui is not None and not isinstance(ui, dict):
            ui = ui.as_dict()
        return tuple(getattr(result, "result", None) or ()), ui

    def load_clip_with_config(self, inputs: dict, config: dict):
        """CLIPLoader's own call of comfy.sd.load_clip plus a umt5-xxl config override (tests
        with tiny files only)."""
        import comfy.sd
        model_options = {"umt5xxl_model_config": config}
        if inputs.get("device") == "cpu":
            model_options["load_device"] = model_options["offload_device"] = \
                self.torch.device("cpu")
        path = self.folder_paths.get_full_path_or_raise("text_encoders", inputs["clip_name"])
        clip = comfy.sd.load_clip(ckpt_paths=[path],
                                  embedding_directory=self.folder_paths.get_folder_paths(
                                      "embeddings"),
                                  clip_type=comfy.sd.CLIPType.WAN, model_options=model_options)
        return (clip,), None


def peak_rss_reset() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_gb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except ImportError:
        return None


def run_once(comfy: Comfy, plan: Plan, cache: dict, te_config: dict | None) -> tuple[dict, list]:
    """One prompt: every step whose signature is cached is reused, the others run, timed."""
    torch = comfy.torch
    if comfy.cuda:
        try:
            torch.cuda.reset_peak_memory_stats()
        except RuntimeError:
            pass
    rss_reset = peak_rss_reset()
    values: dict[str, tuple] = {}
    calls: list[Call] = []
    saved: list[str] = []
    sigs = signatures(plan)
    with torch.inference_mode():
        run_start = comfy.clock()
        comfy.mm.cleanup_models_gc()
        for step in plan.steps:
            hit = cache.get(step.key)
            if hit is not None and hit[0] == sigs[step.key]:
                values[step.key] = hit[1]
                now = time.perf_counter()
                calls.append(Call(step.key, step.node, step.phase, now, now, cached=True))
                continue
            inputs = {k: (values[v.step][v.index] if isinstance(v, Ref) else v)
                      for k, v in step.inputs.items()}
            call = Call(step.key, step.node, step.phase, 0.0, 0.0)
            comfy.current = call
            call.start = comfy.clock()
            if step.node == "CLIPLoader" and te_config:
                out, ui = comfy.load_clip_with_config(inputs, te_config)
            else:
                out, ui = comfy.call(step.node, inputs, step.key)
            call.end = comfy.clock()
            comfy.current = None
            calls.append(call)
            values[step.key] = out
            cache[step.key] = (sigs[step.key], out)
            for item in (ui or {}).get("images", []):  # SaveVideo's files (dicts)
                saved.append(str(Path(comfy.folder_paths.get_output_directory())
                                 / item.get("subfolder", "") / item["filename"]))
        run_end = comfy.clock()
    # what ComfyUI's prompt worker does after a prompt (untimed): collect and empty the cache
    gc.collect()
    comfy.mm.soft_empty_cache()
    summary = summarize(calls, run_start, run_end)
    summary["videos"] = saved
    summary["calls"] = [{"key": c.key, "node": c.node, "phase": c.phase, "cached": c.cached,
                         "seconds": c.end - c.start, "device_load": c.device_load,
                         "steps": len(c.steps)} for c in calls]
    if comfy.cuda:
        try:  # (ComfyUI's cudaMallocAsync backend reports these too; never lose a run to it)
            summary["peak_cuda_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            summary["peak_cuda_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        except RuntimeError as exc:
            summary["peak_cuda_error"] = str(exc)
    summary["peak_host_rss_gb"] = peak_rss_gb()
    summary["peak_host_rss_scope"] = "run" if rss_reset else "process so far"
    return summary, calls


# -- environment and output --------------------------------------------------------------------

def comfy_version(path: Path) -> dict:
    version = None
    text = (path / "comfyui_version.py").read_text() if (path / "comfyui_version.py").is_file() \
        else ""
    found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    if found:
        version = found.group(1)
    top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True).stdout.strip()
    commit = dirty = None
    changed: list[str] = []
    if top and Path(top).resolve() == path.resolve():  # PATH is itself a git work tree
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or None
    elif (path / "COMMIT").is_file():  # a copy of a checkout's files, its commit beside them
        commit = (path / "COMMIT").read_text().strip() or None
    if commit and top and Path(top).resolve() == path.resolve():
        status = subprocess.run(["git", "-C", str(path), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True)
        changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
        dirty = bool(changed)
    return {"version": version, "commit": commit, "modified": dirty,
            "modified_files": changed[:20]}


def environment(comfy: Comfy) -> dict:
    torch = comfy.torch
    env = {"comfyui": {**comfy_version(comfy.path), "path": str(comfy.path),
                       "import_seconds": comfy.import_seconds},
           "python": platform.python_version(), "platform": platform.platform(),
           "host": platform.node(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": str(comfy.mm.get_torch_device()),
           "cpu_flag": bool(comfy.args.cpu)}
    if comfy.cuda:
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 2**30
        env["cuda_allocator"] = torch.cuda.get_allocator_backend()
        env["comfy_vram_state"] = str(getattr(comfy.mm, "vram_state", None))
    for name in ("pytorch_attention_enabled", "xformers_enabled", "sage_attention_enabled",
                 "flash_attention_enabled"):
        function = getattr(comfy.mm, name, None)
        if function is not None:
            try:
                env[name] = bool(function())
            except Exception:  # an optional probe; the record notes it as unknown
                env[name] = None
    env["cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return env


def settings_of(workflow: dict) -> dict:
    """The workflow's settings worth a table column: size, steps, sampler, models."""
    out: dict[str, Any] = {}
    for node in workflow.values():
        inputs, kind = node.get("inputs", {}), node.get("class_type")
        if kind == "WanEnhancedEmptyLatent":
            out.update({k: inputs.get(k) for k in ("width", "height", "frames", "batch")})
        elif kind == "WanEnhancedSampler":
            out.update({k: inputs.get(k) for k in ("seed", "steps", "cfg", "shift",
                                                    "scheduler", "denoise")})
        elif kind == "WanEnhancedModelLoader":
            out.setdefault("models", []).append(inputs.get("model_name"))
            out["weight_dtype"] = inputs.get("weight_dtype")
        elif kind == "WanEnhancedLoRALoader":
            out.setdefault("loras", []).append([inputs.get("lora_name"), inputs.get("strength")])
    return out


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(records: list[dict]) -> str:
    head = ("| workflow | run | seed | load s | text_encode s | latent s | sample s | "
            "first step s | steady steps s | decode s | video_write s | total s | "
            "peak CUDA alloc/res GB | peak RSS GB |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        p = r["phases"]
        cuda = "-" if r.get("peak_cuda_allocated_gb") is None or \
            r.get("peak_cuda_reserved_gb") is None else \
            f"{r['peak_cuda_allocated_gb']:.1f} / {r['peak_cuda_reserved_gb']:.1f}"
        rss = "-" if r.get("peak_host_rss_gb") is None else f"{r['peak_host_rss_gb']:.1f}"
        rows.append(f"| {r['workflow']} | {r['run']} {r['kind']} | {r['settings'].get('seed')} | "
                    f"{_seconds(p['load'])} | "
                    f"{_seconds(p['text_encode'])} | {_seconds(p['latent'])} | "
                    f"{_seconds(p['sample'])} | {_seconds(r['first_step'])} | "
                    f"{_seconds(r['steady_steps'])} | {_seconds(p['decode'])} | "
                    f"{_seconds(p['video_write'])} | {_seconds(r['total'])} | {cuda} | {rss} |")
    return "\n".join(rows) + "\n"


def write_results(out: Path, records: list[dict]) -> list[dict]:
    """Replace the records of these workflows in DIR/peer_comfy_e2e.json, keep the others."""
    path = out / f"{RESULT_NAME}.json"
    old = json.loads(path.read_text()).get("records", []) if path.is_file() else []
    names = {r["workflow"] for r in records}
    merged = [r for r in old if r.get("workflow") not in names] + records
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"records": merged}, indent=1, ensure_ascii=False))
    tmp.replace(path)
    md = out / f"{RESULT_NAME}.md"
    lines = ["# ComfyUI's own Wan pipeline, per phase", ""]
    for name in dict.fromkeys(r["workflow"] for r in merged):
        r = next(r for r in merged if r["workflow"] == name)
        comfy, env, s = r["environment"]["comfyui"], r["environment"], r["settings"]
        lines.append(f"- {name}: ComfyUI {comfy['version']} ({(comfy['commit'] or '?')[:8]}), "
                     f"{env.get('gpu') or env['device']}, torch {env['torch']}; "
                     f"{s.get('width')}x{s.get('height')}x{s.get('frames')}, "
                     f"{s.get('steps')} steps {s.get('scheduler')}, {s.get('weight_dtype')}; "
                     f"{r['date']}")
    md.write_text("\n".join(lines) + "\n\n" + table(merged))
    return merged


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="ComfyUI checkout")
    parser.add_argument("--workflow", type=Path, required=True, help="our API workflow JSON")
    parser.add_argument("--models", type=Path, required=True,
                        help="models root (diffusion_models/, text_encoders/, vae/, loras/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        metavar="NODE.INPUT=VALUE")
    parser.add_argument("--cpu", action="store_true", help="ComfyUI's --cpu")
    parser.add_argument("--text-encoder-config", type=json.loads, default=None, metavar="JSON",
                        help="tests with tiny files: overrides of ComfyUI's umt5-xxl config")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workflow = apply_sets(json.loads(args.workflow.read_text()), args.sets)
    models = args.models.resolve()

    def channels(model_name: str) -> int:
        path = models / "diffusion_models" / model_name
        return channels_from_file(path) if path.is_file() else channels_from_name(model_name)

    try:
        plan = comfy_plan(workflow, channels)
    except TranslationError as exc:
        print(f"peer_comfy_e2e: cannot translate {args.workflow.name}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out.resolve()
    try:
        comfy = Comfy(args.comfyui, models, out / "output", args.cpu)
    except ComfyCheckoutError as exc:
        print(f"peer_comfy_e2e: {exc}", file=sys.stderr)
        return 2
    env = environment(comfy)
    settings = settings_of(workflow)
    cache: dict = {}
    records = []
    for run in range(args.runs):
        run_plan = for_run(plan, run)
        summary, _ = run_once(comfy, run_plan, cache, args.text_encoder_config)
        records.append({
            "workflow": args.workflow.stem, "run": run + 1,
            "kind": "cold" if run == 0 else "warm",
            **summary,
            "settings": {**settings, "seed": settings.get("seed", 0) + run},
            "overrides": args.sets, "not_translated": plan.not_translated,
            "plan": [s.as_json() for s in run_plan.steps],
            "environment": env,
            "text_encoder_config": args.text_encoder_config,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        })
        print(f"run {run + 1}: total {summary['total']:.2f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, records)
    print(table(records), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
