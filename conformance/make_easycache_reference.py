"""EasyCache's decisions as ComfyUI computes them, on seeded synthetic sampling runs: the data
tests/test_step_cache.py replays through sampling/step_cache.py.

    python conformance/make_easycache_reference.py --comfyui PATH --out tests/data/easycache

Run with a Python that imports the ComfyUI checkout at PATH (its venv): ComfyUI's own
easycache_forward_wrapper and easycache_calc_cond_batch_wrapper (comfy_extras/nodes_easycache.py)
and its EasyCacheHolder are driven as its sampler drives them, around a stand-in diffusion
model: a fixed channel mix of the input plus a sigma-scaled offset per branch, which changes
smoothly along the run as a real model's output does. Each run is a plain Euler integration
over a shifted flow grid (the driver below, which the test repeats): per step one call per
branch (the unconditional first, as ComfyUI's calc_cond_batch orders them) or one batched call
(unconditional rows first), guidance uncond + cfg (cond - uncond).

Written: reference.safetensors (each run's inputs: the start sample and the stand-in model's
tensors) and reference.json (per run: its settings, the sigmas, the steps ComfyUI skipped, and
the final sample's name in the tensors file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# (name, cfg, batched, threshold, shift, steps)
RUNS = (
    ("cfg1", 1.0, False, 0.2, 5.0, 30),
    ("cfg1_low_threshold", 1.0, False, 0.05, 5.0, 30),
    ("cfg5_two_calls", 5.0, False, 0.2, 5.0, 30),
    ("cfg5_batched", 5.0, True, 0.2, 5.0, 30),
    ("cfg5_high_threshold", 5.0, True, 0.5, 8.0, 40),
    ("cfg3_shift3", 3.0, False, 0.1, 3.0, 25),
)
SHAPE = (1, 4, 2, 16, 16)  # [B, C, F, H, W]: every eighth pixel gives 2 x 2 per frame
START_PERCENT, END_PERCENT, SUBSAMPLE = 0.15, 0.95, 8


def shifted_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 sigmas from 1 to 0, shifted as a flow model's: shift s / (1 + (shift - 1) s)."""
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * base / (1 + (shift - 1) * base)).to(torch.float32)


def stand_in(tensors: dict, x: torch.Tensor, sigma: torch.Tensor, branch: str) -> torch.Tensor:
    """The stand-in model's output for one branch: a channel mix of x plus sigma times an
    offset."""
    mix = tensors[f"mix_{branch}"]
    mixed = torch.einsum("oc,bcfhw->bofhw", mix, x)
    return mixed + sigma.view(-1, 1, 1, 1, 1) * tensors[f"offset_{branch}"]


def inputs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    channels = SHAPE[1]
    tensors = {"x0": torch.randn(SHAPE, generator=gen)}
    for branch in ("cond", "uncond"):
        tensors[f"mix_{branch}"] = torch.eye(channels) * -0.9 + \
            0.05 * torch.randn(channels, channels, generator=gen)
        tensors[f"offset_{branch}"] = torch.randn(SHAPE, generator=gen)
    return tensors


def euler_run(step_velocity, x0: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The driver both sides share: x <- x + (sigma_next - sigma) v."""
    x = x0.clone()
    for i in range(len(sigmas) - 1):
        v = step_velocity(x, sigmas[i])
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.comfyui.resolve()))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args as comfy_args
    comfy_args.cpu = True  # (what it computes here needs no device)
    from comfy_extras import nodes_easycache as ec

    import comfy.model_sampling

    def Sampling(shift):  # ComfyUI's flow sampling with `shift`, as ModelSamplingSD3 sets it
        sampling = comfy.model_sampling.ModelSamplingDiscreteFlow(None)
        sampling.set_parameters(shift=shift, multiplier=1000)
        return sampling

    tensors_out, records = {}, []
    for seed, (name, cfg, batched, threshold, shift, steps) in enumerate(RUNS):
        tensors = inputs(seed)
        holder = ec.EasyCacheHolder(threshold, START_PERCENT, END_PERCENT, SUBSAMPLE, False,
                                    output_channels=SHAPE[1]).prepare_timesteps(Sampling(shift))
        options = {"transformer_options": {"easycache": holder}}
        skipped_at = []

        def forward(x, sigma, uuids):
            transformer_options = {"easycache": holder, "sigmas": sigma.view(1),
                                   "uuids": uuids}

            def executor(x_in, _t, _context, _options):
                rows = x_in.shape[0] // len(uuids)
                return torch.cat([stand_in(tensors, x_in[i * rows:(i + 1) * rows],
                                           sigma.view(1), uuid) for i, uuid in
                                  enumerate(uuids)])
            return ec.easycache_forward_wrapper(executor, x, sigma.view(1), None,
                                                transformer_options)

        def step_velocity(x, sigma):
            before = holder.total_steps_skipped

            def calc(*_args):
                if cfg == 1:
                    return [forward(x.clone(), sigma, ["cond"])]
                if batched:
                    both = forward(torch.cat([x, x]), sigma, ["uncond", "cond"])
                    return [both[1:], both[:1]]
                uncond = forward(x.clone(), sigma, ["uncond"])
                cond = forward(x.clone(), sigma, ["cond"])
                return [cond, uncond]
            outs = ec.easycache_calc_cond_batch_wrapper(calc, options)
            if holder.total_steps_skipped != before:
                skipped_at.append(len(step_sigmas))
            step_sigmas.append(float(sigma))
            if cfg == 1:
                return outs[0]
            cond, uncond = outs
            return uncond + (cond - uncond) * cfg

        step_sigmas: list[float] = []
        sigmas = shifted_sigmas(steps, shift)
        final = euler_run(step_velocity, tensors["x0"], sigmas)
        for key, value in tensors.items():
            tensors_out[f"{name}.{key}"] = value.contiguous()
        tensors_out[f"{name}.final"] = final.contiguous()
        records.append({"name": name, "cfg": cfg, "batched": batched, "threshold": threshold,
                        "shift": shift, "steps": steps, "start_percent": START_PERCENT,
                        "end_percent": END_PERCENT, "subsample": SUBSAMPLE,
                        "start_sigma": holder.start_t, "end_sigma": holder.end_t,
                        "skipped": skipped_at, "total_skipped": holder.total_steps_skipped})
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    save_file(tensors_out, str(args.out / "reference.safetensors"))
    version = (args.comfyui / "comfyui_version.py").read_text().split('"')[1] \
        if (args.comfyui / "comfyui_version.py").is_file() else "unknown"
    (args.out / "reference.json").write_text(json.dumps(
        {"comfyui": version, "runs": records}, indent=1) + "\n")
    for r in records:
        print(r["name"], "skipped", r["skipped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
