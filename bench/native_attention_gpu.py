"""Wan Enhanced Attention on ComfyUI's own Wan graphs: each template's sampling with ComfyUI's
attention and with the patch, in one process, and each side's distance to a float32 forward.

    python bench/native_attention_gpu.py --comfyui PATH --out DIR [--case NAME ...]
        [--mode auto|fp8|bf16] [--weights default|fp8_e4m3fn_fast] [--compile] [--tiny]

PATH is a ComfyUI checkout; run the script with a Python that has ComfyUI's requirements and
this package importable as `wan_enhanced` (bench/gpu_env.sh does both on a GPU machine). One
case per ComfyUI Wan template, at the template's size, shift, sampler, scheduler and cfg, with 4
steps (CASES):

  ti2v_5b    video_wan2_2_5B_ti2v     Wan2.2 TI2V-5B (fp16 file), Wan22ImageToVideoLatent
  t2v_a14b   video_wan2_2_14B_t2v     the Wan2.2 T2V A14B pair (fp8-scaled files), two
                                      KSamplerAdvanced split 2 + 2
  vace_14b   video_wan_vace_14B_t2v   Wan2.1 VACE 14B (fp16 file), WanVaceToVideo, TrimVideoLatent
  i2v_a14b   video_wan2_2_14B_i2v     the Wan2.2 I2V A14B pair (fp8-scaled files), WanImageToVideo
                                      with a start image, two KSamplerAdvanced split 2 + 2

The graph on each side is the template's from the model loader to the sampler: the model (its
weights as UNETLoader's `weight_dtype` --weights loads them; `default` is the templates'), then
(on the patched side) Wan Enhanced Attention in mode --mode, then with --compile ComfyUI's
TorchCompileModel (inductor) on both sides, then ModelSamplingSD3, then the template's sampler
node(s) and latent node. What stands in for the rest: the DiTs are seeded
random real-size weights in the template file's storage, handed to
comfy.sd.load_diffusion_model_state_dict (what UNETLoader calls on a file's tensors); the text
encoder's output is a seeded random tensor of umT5-xxl's shape (512 x 4096) for the prompt and
another for the negative (text encoding is not attention of the DiT); the VAE is a seeded random
real-size Wan VAE built by comfy.sd.VAE, for the latent nodes that encode images; the templates'
LoRAs are left out (they change weights, not attention calls).

Per case, every expert is moved to the GPU first (as a server holds them for a second prompt;
the two sides share the experts' weights), then the two sides take turns:
  1. one Euler step of the first expert from pure noise (the model's denoised prediction at the
     first sigma: one forward at cfg 1, a batched pair at cfg > 1); it also builds the kernels,
     so it is not timed as a step. Its latent is compared.
  2. with --compile, the template's 4-step sampling once untimed (what torch.compile builds for
     its shapes and steps);
  3. the template's 4-step sampling, timed: the run's seconds and each step's end from ComfyUI's
     progress hook. `step` is the median of the steps that are not a sampler call's first.
Then the first expert is loaded again with float32 compute (model dtype float32; an fp8-scaled
file keeps its fp8 weights, scaled up to float32 as ComfyUI computes them) and the same Euler step
runs once, with TF32 off: the reference. A case's `error_length` (frames) is the length of
that comparison where the template's would make the float32 forward too slow to run here.
Distances on the output latent: max |x - ref| / max |ref| and ||x - ref|| / ||ref||. The patch's
own record says which kernel took how many calls and why the others were handed back.

Output: DIR/native_attention.json and DIR/native_attention.md (the table, also printed).
--tiny: tiny models and sizes on the CPU, a smoke run of the whole script: there our kernels
hand every call back, so the two sides must agree bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

SEED = 42
STEPS = 4
TEXT_TOKENS, TEXT_DIM = 512, 4096  # umT5-xxl's output for a prompt, as ComfyUI pads it
VACE_LAYERS, VACE_IN_DIM = 8, 96  # Wan2.1 VACE 14B: a VACE block every fifth layer
RESULT_NAME = "native_attention"
SIDES = ("comfyui", "patched")
WEIGHTS = ("default", "fp8_e4m3fn_fast")  # UNETLoader's weight_dtype values measured here
PATCH_NODE = "WanEnhancedAttentionPatch"


@dataclass(frozen=True)
class Case:
    template: str
    dit: str  # a KNOWN_DITS name (the VACE model adds its blocks to it)
    experts: int  # 1, or 2 for a Wan2.2 A14B pair (high noise, then low noise)
    storage: str  # "fp16" or "fp8_scaled", as the template's file
    latent_node: str
    width: int
    height: int
    length: int
    shift: float
    sampler: str
    scheduler: str
    cfg: float
    vace: bool = False
    start_image: bool = False
    error_length: int | None = None  # frames of the float32 comparison (None: `length`)


CASES = {
    "ti2v_5b": Case("video_wan2_2_5B_ti2v", "wan2.2-ti2v-5b", 1, "fp16",
                    "Wan22ImageToVideoLatent", 1280, 704, 121, 8.0, "uni_pc", "simple", 5.0),
    "t2v_a14b": Case("video_wan2_2_14B_t2v", "wan2.1-t2v-14b", 2, "fp8_scaled",
                     "EmptyHunyuanLatentVideo", 640, 640, 81, 5.0, "euler", "simple", 1.0),
    "vace_14b": Case("video_wan_vace_14B_t2v", "wan2.1-t2v-14b", 1, "fp16", "WanVaceToVideo",
                     1280, 720, 81, 8.0, "uni_pc", "simple", 1.0, vace=True, error_length=21),
    "i2v_a14b": Case("video_wan2_2_14B_i2v", "wan2.2-i2v-a14b", 2, "fp8_scaled",
                     "WanImageToVideo", 640, 640, 81, 5.0, "euler", "simple", 1.0,
                     start_image=True),
}
# --tiny: sizes a CPU runs in seconds (multiples of the TI2V-5B's 32 pixels)
TINY_SIZE = dict(width=64, height=64, length=9, error_length=None)
EXTRA_NODES = {"WanVaceToVideo": "comfy_extras.nodes_wan",
               "WanImageToVideo": "comfy_extras.nodes_wan",
               "TrimVideoLatent": "comfy_extras.nodes_wan",
               "TorchCompileModel": "comfy_extras.nodes_torch_compile"}


@dataclass(frozen=True)
class Setup:
    """How both sides are run: the patch's mode, UNETLoader's weight_dtype, ComfyUI's compile
    node or not."""
    mode: str = "auto"
    weights: str = "default"
    compile: bool = False

    def __str__(self) -> str:
        return (f"{self.mode}, {self.weights} weights, "
                f"{'compiled' if self.compile else 'eager'}")


# -- models ------------------------------------------------------------------------------------

def dit_config(case: Case, tiny: bool):
    from wan_enhanced.checkpoints.tiny import TINY_DIT
    from wan_enhanced.wan.configs import KNOWN_DITS

    config = KNOWN_DITS[case.dit].config
    if tiny:
        kind = {48: "ti2v", 36: "i2v_a14b"}.get(config.in_dim, "t2v")
        # ComfyUI's Wan detection takes the text width of the released models
        config = dataclasses.replace(TINY_DIT[kind], text_dim=TEXT_DIM)
    return config


def vace_blocks(state: dict, config, layers: int, seed: int, device) -> dict:
    """VACE's extra tensors under ComfyUI's key names: `layers` blocks shaped as a text-to-video
    block, the first with `before_proj`, each with `after_proj`, and the VACE patch embedding of
    VACE_IN_DIM channels; drawn like the rest (checkpoints/tiny.random_value)."""
    import torch
    from wan_enhanced.checkpoints.tiny import random_value

    gen = torch.Generator(device=device).manual_seed(seed)
    dim = config.dim
    extra = {}
    block = {k[len("blocks.0."):]: v.shape for k, v in state.items() if k.startswith("blocks.0.")}
    for index in range(layers):
        shapes = dict(block)
        if index == 0:
            shapes.update({"before_proj.weight": (dim, dim), "before_proj.bias": (dim,)})
        shapes.update({"after_proj.weight": (dim, dim), "after_proj.bias": (dim,)})
        for name, shape in shapes.items():
            extra[f"vace_blocks.{index}.{name}"] = random_value(name, tuple(shape), gen, device)
    patch = (dim, VACE_IN_DIM, *config.patch_size)
    extra["vace_patch_embedding.weight"] = random_value("weight", patch, gen, device)
    extra["vace_patch_embedding.bias"] = random_value("bias", (dim,), gen, device)
    return extra


def dit_state(case: Case, expert: int, tiny: bool, device) -> dict:
    """The expert's seeded random weights in ComfyUI's names and the template file's storage,
    drawn and left on `device`: ComfyUI's loader copies them into its model's own (host)
    weights, so the host never holds the model twice."""
    import torch
    from wan_enhanced.checkpoints.tiny import fp8_scaled, randomize
    from wan_enhanced.wan.dit import WanDiT

    config = dit_config(case, tiny)
    with torch.device("meta"):
        module = WanDiT(config)
    dtype = torch.float16 if case.storage == "fp16" else torch.bfloat16
    state = randomize(module, 1 + expert, device, dtype, keep_on_device=True)
    del module
    if case.vace:
        extra = vace_blocks(state, config, 1 if tiny else VACE_LAYERS, 7, device)
        state.update((k, v.to(dtype)) for k, v in extra.items())
    if case.storage == "fp8_scaled":
        state = fp8_scaled({f"model.diffusion_model.{k}": v for k, v in state.items()})
    return state


def vae_state(case: Case, device) -> dict:
    """The released VAE's shapes with seeded random values, float32 on the CPU. ComfyUI's VAE
    builds the released shapes whatever a file holds, so --tiny uses them too (a CPU encodes a
    few small frames with it in seconds)."""
    import torch
    from wan_enhanced.checkpoints.tiny import randomize
    from wan_enhanced.wan.configs import KNOWN_DITS
    from wan_enhanced.wan.vae21 import WanVAE21
    from wan_enhanced.wan.vae22 import WanVAE22

    kind = KNOWN_DITS[case.dit].vae
    with torch.device("meta"):
        module = WanVAE22() if kind == "vae22" else WanVAE21()
    return randomize(module, 2, device)


def load_dit(comfy, state: dict, float32: bool = False, weights: str = "default"):
    """A ModelPatcher, as UNETLoader makes one from a file's tensors with its weight_dtype
    `weights` (model dtype float32 for the reference)."""
    import torch

    options = {"dtype": torch.float32} if float32 else {}
    if weights == "fp8_e4m3fn_fast":  # as UNETLoader sets it
        options = {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    patcher = comfy.sd.load_diffusion_model_state_dict(dict(state), model_options=options)
    if patcher is None:
        raise RuntimeError("ComfyUI did not detect the random DiT as a Wan model")
    return patcher


def free(comfy) -> None:
    gc.collect()
    comfy.mm.unload_all_models()
    comfy.mm.soft_empty_cache()
    gc.collect()


# -- the graph ---------------------------------------------------------------------------------

def conditioning(tiny: bool):
    import torch

    gen = torch.Generator().manual_seed(SEED)
    tokens = 16 if tiny else TEXT_TOKENS
    return ([[torch.randn(1, tokens, TEXT_DIM, generator=gen), {}]],
            [[torch.randn(1, tokens, TEXT_DIM, generator=gen), {}]])


def graph_inputs(comfy, case: Case, vae, length: int, tiny: bool):
    """(positive, negative, latent) from the template's latent node."""
    import torch

    positive, negative = conditioning(tiny)
    size = dict(width=case.width, height=case.height, length=length, batch_size=1)
    if case.latent_node == "EmptyHunyuanLatentVideo":
        (latent,), _ = comfy.call(case.latent_node, size, "latent")
    elif case.latent_node == "Wan22ImageToVideoLatent":
        (latent,), _ = comfy.call(case.latent_node, dict(vae=vae, **size), "latent")
    elif case.latent_node == "WanImageToVideo":
        gen = torch.Generator().manual_seed(SEED + 1)
        image = torch.rand(1, case.height, case.width, 3, generator=gen)
        (positive, negative, latent), _ = comfy.call(
            case.latent_node, dict(positive=positive, negative=negative, vae=vae,
                                   start_image=image, **size), "latent")
    elif case.latent_node == "WanVaceToVideo":
        (positive, negative, latent, trim), _ = comfy.call(
            case.latent_node, dict(positive=positive, negative=negative, vae=vae,
                                   strength=1.0, **size), "latent")
        (latent,), _ = comfy.call("TrimVideoLatent", dict(samples=latent, trim_amount=trim),
                                  "trim")
    else:
        raise ValueError(f"{case.latent_node}: no such latent node in the cases")
    return positive, negative, latent


def template_models(comfy, case: Case, states: list[dict], setup: Setup = Setup()):
    """Each side's models, as the template wires them after the loader: ({side: [expert, ...]},
    the patch's override of each expert). The patched side is the same experts through Wan
    Enhanced Attention (setup.mode); both then go through TorchCompileModel (setup.compile)
    and ModelSamplingSD3."""
    experts = [load_dit(comfy, state, weights=setup.weights) for state in states]
    models, overrides = {}, []
    for side in SIDES:
        models[side] = []
        for expert in experts:
            if side == "patched":
                (expert,), _ = comfy.call(PATCH_NODE, dict(model=expert, mode=setup.mode),
                                          "patch")
                overrides.append(expert.model_options["transformer_options"][
                    "optimized_attention_override"])
            if setup.compile:
                (expert,), _ = comfy.call("TorchCompileModel",
                                          dict(model=expert, backend="inductor"), "compile")
            (expert,), _ = comfy.call("ModelSamplingSD3", dict(model=expert, shift=case.shift),
                                      "shift")
            models[side].append(expert)
    return models, overrides


def call_counts(overrides: list) -> dict:
    """Calls our kernels took, by kernel, and calls handed back, by reason, over all experts."""
    from collections import Counter

    ours, handed_back = Counter(), Counter()
    for override in overrides:
        ours.update(override.ours)
        handed_back.update(override.handed_back)
    return {"ours": dict(ours), "handed_back": dict(handed_back)}


def sampled(comfy, models: list, case: Case, inputs, steps: int, sampler: str,
            scheduler: str):
    """(latent, seconds, step ends) of one sampling as the template wires it: KSampler for one
    model, the KSamplerAdvanced pair split in half for two."""
    from wan_enhanced.bench.peer_comfy_e2e import Call

    positive, negative, latent = inputs
    common = dict(steps=steps, cfg=case.cfg, sampler_name=sampler, scheduler=scheduler,
                  positive=positive, negative=negative)
    if len(models) == 1:
        calls = [("KSampler", dict(model=models[0], seed=SEED, denoise=1.0, **common))]
    else:
        split = steps // 2
        calls = [("KSamplerAdvanced", dict(model=models[0], add_noise="enable", noise_seed=SEED,
                                           start_at_step=0, end_at_step=split,
                                           return_with_leftover_noise="enable", **common)),
                 ("KSamplerAdvanced", dict(model=models[1], add_noise="disable", noise_seed=0,
                                           start_at_step=split, end_at_step=10000,
                                           return_with_leftover_noise="disable", **common))]
    step_lists = []
    start = comfy.clock()
    for node, arguments in calls:
        call = Call(node, node, "sample", comfy.clock(), 0.0)
        comfy.current = call
        (latent,), _ = comfy.call(node, dict(latent_image=latent, **arguments), node)
        call.end = comfy.clock()
        comfy.current = None
        step_lists.append([t - s for s, t in zip([call.start] + call.steps, call.steps)])
    return latent["samples"].float().cpu(), comfy.clock() - start, step_lists


def steady_step(step_lists: list[list[float]]) -> float | None:
    """The median step that is not a sampler call's first (those move the expert to the GPU)."""
    steady = [t for steps in step_lists for t in steps[1:]]
    return statistics.median(steady) if steady else None


def say(name: str, what: str) -> None:
    """A progress line with the host's resident memory, so a run cut short shows how far it
    got."""
    from wan_enhanced.bench.peer_comfy_e2e import peak_rss_gb

    print(f"[{name}] {what} (host peak {peak_rss_gb() or 0:.1f} GiB)", file=sys.stderr,
          flush=True)


def run_case(comfy, name: str, case: Case, tiny: bool, device, setup: Setup = Setup()) -> dict:
    import torch
    from wan_enhanced.bench.harness import distance, ratio

    if tiny:
        case = dataclasses.replace(case, **TINY_SIZE)
    record = {"case": name, "setup": str(setup), "mode": setup.mode, "weights": setup.weights,
              "compiled": setup.compile, "template": case.template, "storage": case.storage,
              "video": f"{case.width}x{case.height}x{case.length}", "steps": STEPS,
              "sampler": case.sampler, "scheduler": case.scheduler, "cfg": case.cfg,
              "shift": case.shift, "experts": case.experts}
    t0 = time.perf_counter()
    states = [dit_state(case, e, tiny, device) for e in range(case.experts)]
    vae = comfy.VAE(sd=vae_state(case, device))
    record["draw_seconds"] = time.perf_counter() - t0
    say(name, "weights drawn")
    with torch.inference_mode():
        models, overrides = template_models(comfy, case, states, setup)
        del states
        say(name, "models loaded")
        error_length = case.error_length or case.length
        record["error_video"] = f"{case.width}x{case.height}x{error_length}"
        full = graph_inputs(comfy, case, vae, case.length, tiny)
        short = full if error_length == case.length else \
            graph_inputs(comfy, case, vae, error_length, tiny)
        outputs, runs = {}, {}
        # every expert on the GPU before anything is timed, as a server holds them for its
        # second prompt (the sides share the experts' weights)
        comfy.mm.load_models_gpu(models["comfyui"])
        for side in SIDES:  # one step each: builds the kernels; the latent is compared
            first = time.perf_counter()
            outputs[side], _, _ = sampled(comfy, models[side][:1], case, short, 1, "euler",
                                          "simple")
            runs[side] = {"first_call_seconds": time.perf_counter() - first}
            if setup.compile:  # the timed run once untimed: compiled for its shapes and steps
                first = time.perf_counter()
                sampled(comfy, models[side], case, full, STEPS, case.sampler, case.scheduler)
                runs[side]["compile_warm_seconds"] = time.perf_counter() - first
        for side in SIDES:
            _, seconds, step_lists = sampled(comfy, models[side], case, full, STEPS,
                                             case.sampler, case.scheduler)
            runs[side].update(run_seconds=seconds, step_seconds=step_lists,
                              step=steady_step(step_lists))
        record["runs"] = runs
        say(name, "timed")
        record["calls"] = call_counts(overrides)
        del models, overrides
        free(comfy)
        reference = load_dit(comfy, dit_state(case, 0, tiny, device), float32=True)
        (reference,), _ = comfy.call("ModelSamplingSD3", dict(model=reference, shift=case.shift),
                                     "shift")
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            ref, ref_seconds, _ = sampled(comfy, [reference], case, short, 1, "euler", "simple")
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        del reference
        free(comfy)
        say(name, "float32 reference done")
    record["reference_seconds"] = ref_seconds
    record["distance"] = {side: distance(outputs[side], ref) for side in SIDES}
    record["patched_vs_comfyui"] = distance(outputs["patched"], outputs["comfyui"])
    record["equal"] = bool(torch.equal(outputs["patched"], outputs["comfyui"]))
    native, patched = runs["comfyui"], runs["patched"]
    record["step_ratio"] = ratio(patched["step"], native["step"])
    record["run_ratio"] = ratio(patched["run_seconds"], native["run_seconds"])
    return record


# -- ComfyUI and output ------------------------------------------------------------------------

def start_comfy(path: Path, out: Path, cpu: bool):
    """ComfyUI imported headless (bench/peer_comfy_e2e.Comfy) with the template nodes these
    cases add and our patch node."""
    import importlib

    from wan_enhanced.bench.peer_comfy_e2e import Comfy

    comfy = Comfy(path, out / "models", out / "output", cpu)
    for name, module in EXTRA_NODES.items():
        comfy.classes[name] = getattr(importlib.import_module(module), name)
    from wan_enhanced.nodes.attention import WanAttentionPatch  # after ComfyUI: host sees it
    comfy.classes[PATCH_NODE] = WanAttentionPatch
    import comfy.sd as sd  # (the name `comfy` is the caller's object in this module)
    comfy.sd, comfy.VAE = sd, sd.VAE
    return comfy


def table(records: list[dict]) -> str:
    from wan_enhanced.bench.harness import fmt

    lines = ["| case (template) | video | step: ComfyUI / patched (s) | ratio | 4-step run: "
             "ComfyUI / patched (s) | ratio | to float32, max rel: ComfyUI / patched | "
             "rel L2: ComfyUI / patched |",
             "|---|---|---|---:|---|---:|---|---|"]
    for r in records:
        native, patched = r["runs"]["comfyui"], r["runs"]["patched"]
        dn, dp = r["distance"]["comfyui"], r["distance"]["patched"]
        setup = f", {r['setup']}" if r.get("setup") else ""
        lines.append(
            f"| {r['case']} ({r['template']}{setup}) | {r['video']} | {fmt(native['step'], '.3f')} / "
            f"{fmt(patched['step'], '.3f')} | {fmt(r['step_ratio'], '.3f')} | "
            f"{native['run_seconds']:.2f} / {patched['run_seconds']:.2f} | "
            f"{fmt(r['run_ratio'], '.3f')} | {dn['max_rel']:.2e} / {dp['max_rel']:.2e} | "
            f"{dn['rel_l2']:.2e} / {dp['rel_l2']:.2e} |")
    lines.append("")
    for r in records:
        lines.append(f"- {r['case']}: our kernels took {r['calls']['ours'] or 'no calls'}; "
                     f"handed back: {r['calls']['handed_back'] or 'none'}; float32 comparison "
                     f"on {r['error_video']}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--mode", choices=("auto", "fp8", "bf16"), default="auto",
                        help="Wan Enhanced Attention's mode on the patched side")
    parser.add_argument("--weights", choices=WEIGHTS, default="default",
                        help="UNETLoader's weight_dtype for both sides (default: the templates')")
    parser.add_argument("--compile", action="store_true",
                        help="ComfyUI's TorchCompileModel (inductor) on both sides")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models on the CPU: a smoke run of the whole script")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.comfyui / "nodes.py").is_file():
        print(f"native_attention_gpu: --comfyui {args.comfyui}: not a ComfyUI checkout (no "
              f"nodes.py)", file=sys.stderr)
        return 2
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("native_attention_gpu: no CUDA device; use --tiny for a CPU smoke run",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    comfy = start_comfy(args.comfyui, args.out, cpu=args.tiny)
    from wan_enhanced.bench.peer_comfy_e2e import environment

    device = "cpu" if args.tiny else "cuda"
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "tiny": args.tiny, **environment(comfy)}
    path = args.out / f"{RESULT_NAME}.json"
    records = json.loads(path.read_text())["records"] if path.is_file() else []
    setup = Setup(args.mode, args.weights, args.compile)
    for name in args.case:
        record = run_case(comfy, name, CASES[name], args.tiny, device, setup)
        records = [r for r in records
                   if (r["case"], r.get("setup")) != (name, str(setup))] + [record]
        text = table(records)
        path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        (args.out / f"{RESULT_NAME}.md").write_text(text)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
