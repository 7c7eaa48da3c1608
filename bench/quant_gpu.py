"""Quantized DiT forwards against bf16: time, memory and how far the output moves.

For each case one set of seeded random bf16 weights is drawn on the GPU (as in
peer_diffusers.py, whose cases, weights and timing this reuses) and one DiT forward is timed
with the transformer blocks' matrices
  bf16              as drawn
  fp8_e4m3fn        fp8 weights, per-output-channel scales, dequantized to bf16 per matmul
  fp8_e4m3fn_fast   fp8 weights, fp8 x fp8 matmul (torch._scaled_mm), activations per token
  int8              int8 weights, dequantized to bf16 per matmul
  int8_dynamic      int8 weights and per-token int8 activations (torch._int_mm)
eager and with the blocks compiled (the model loader's `compile`); on request also torchao's
  torchao_float8_rowwise  torchao Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
  torchao_int8_dynamic    torchao Int8DynamicActivationInt8WeightConfig()
applied with torchao.quantization.quantize_ to the same block matrices of the same bf16 model
(their weights become torchao's tensor subclasses; the rest of the forward is ours), each
compared in its row with our scheme of the same arithmetic ("/ ours": fp8_e4m3fn_fast,
int8_dynamic). The quantized models are
quantized on the GPU from the very same bf16 weights (quant.quantize_block_linears), as the
model loader would from a bf16 file. Reported per row: median ms and its ratio to the bf16 row
of the same mode, the peak activation memory (allocated during the forward above the weights
and inputs), the weights' GiB, the max relative difference of the output to the bf16 output of
the same mode (max |q - bf16| / max |bf16|), and any fallback warning (fp8_e4m3fn_fast falls
back to dequantizing on GPUs older than compute capability 8.9).

    python bench/quant_gpu.py --out DIR [--case dit_1_3b dit_5b] [--scheme ...]
                              [--mode eager compiled] [--repeats 3] [--quick]

Cases: dit_1_3b (Wan2.1 T2V-1.3B, 832x480x81, latent [1,16,21,60,104]) and dit_5b (Wan2.2
TI2V-5B, 1280x704x121, latent [1,48,31,44,80]). Each compiled row compiles the block forward
afresh (the dynamo cache is reset between rows: every scheme is a new graph).
--quick: tiny model and latent, on the CPU when there is no GPU (a smoke test of the script).
Exits non-zero when a row failed, or when fp8_e4m3fn_fast fell back on a GPU that has the
fp8 matmul.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer

from wan_enhanced.atomic_files import write_atomically
from wan_enhanced.quant import SCHEMES, is_block_matrix, quantize_block_linears
from wan_enhanced.quant.kernels import fp8_matmul_unavailable
from wan_enhanced.wan.dit import WanDiT

GIB = peer.GIB
CASES = ("dit_1_3b", "dit_5b")
WEIGHTS = ("bf16", *SCHEMES)
# torchao's schemes and ours of the same arithmetic (the "/ ours" column)
TORCHAO = {"torchao_float8_rowwise": "fp8_e4m3fn_fast", "torchao_int8_dynamic": "int8_dynamic"}
DTYPE = torch.bfloat16


def torchao_config(weights: str):
    """torchao's configuration for one of TORCHAO's names (torchao must be importable)."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                      Int8DynamicActivationInt8WeightConfig, PerRow)
    if weights == "torchao_float8_rowwise":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Int8DynamicActivationInt8WeightConfig()


def torchao_missing() -> str | None:
    """Why the torchao rows cannot run here, or None."""
    try:
        importlib.import_module("torchao.quantization")
    except ImportError as error:
        return f"torchao is not importable ({error}); pip install torchao"
    return None


def build_model(config, state: dict[str, torch.Tensor], weights: str) -> WanDiT:
    """Our DiT on `state`'s tensors, its block matrices quantized as `weights` says (ours, or
    torchao's quantize_ on the same matrices)."""
    model = peer.ours_dit(config, state, DTYPE)
    if weights == "bf16":
        return model
    if weights in TORCHAO:
        from torchao.quantization import quantize_
        quantize_(model, torchao_config(weights), filter_fn=is_block_matrix)
        return model
    return quantize_block_linears(model, weights)


def run_case(name: str, args, device: torch.device) -> list[dict]:
    case = peer.CASES[name]
    # the peer benchmark's timestep form (TI2V-5B: one per token), so the bf16 rows compare
    # with its figures
    config, latent, state, noise, context, timestep = peer.dit_setup(
        name, args.quick, args.seed, device, DTYPE).parts()

    rows, reference = [], {}
    for weights in args.scheme:
        model = build_model(config, state, weights)
        weight_bytes = peer.device_bytes(model)
        for mode in args.mode:
            if mode == "compiled":
                torch._dynamo.reset()  # a new graph per scheme, never the recompile limit
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out, run = peer.timed(
                    lambda: model(noise, timestep, context, attention="sdpa",
                                  compiled=mode == "compiled"),
                    args.repeats, device, lambda o: o.float().cpu())
            if weights == "bf16":
                reference[mode] = (out, run)
            base_out, base_run = reference.get(mode, (None, None))
            diff = peer.difference(out, base_out)[1] if weights != "bf16" else 0.0
            notes = sorted({str(w.message) for w in caught
                            if issubclass(w.category, RuntimeWarning)})
            ours = next((r for r in rows if r["weights"] == TORCHAO.get(weights)
                         and r["mode"] == mode), None)
            rows.append({
                "case": name, "video": case.video, "latent": list(latent), "weights": weights,
                "mode": mode, "run": run.to_dict(),
                "time_ratio": None if base_run is None else peer.ratio(run.median_ms,
                                                                        base_run.median_ms),
                "time_ratio_to_ours": None if ours is None else peer.ratio(
                    run.median_ms, ours["run"]["median_ms"]),
                "peak_activation_bytes": run.peak_allocated, "weight_bytes": weight_bytes,
                "max_rel_diff_to_bf16": diff, "warnings": notes})
            print(f"  {weights} {mode}: {run.median_ms} ms, max rel diff {diff:.2e}"
                  + (f", warnings: {notes}" if notes else ""), flush=True)
        del model
        peer.free_memory()
    del state
    peer.free_memory()
    return rows


def markdown(data: dict) -> str:
    f = peer.fmt
    lines = ["# Quantized DiT forward against bf16", "",
             f"device: {data['device']}; torch {data['torch']}; date {data['date']}; "
             f"fp8 matmul: {data['fp8_matmul'] or 'available'}; median of {data['repeats']} "
             f"timed forwards after a warm-up", "",
             "Command:", "", f"    {data['command']}", "",
             "Ratio: to the bf16 row of the same mode. Peak: memory allocated during the "
             "forward above the weights and inputs. Difference: max |out - bf16 out| / "
             "max |bf16 out|, against the bf16 output of the same mode.", "",
             "/ ours: a torchao row's time over our scheme of the same arithmetic "
             f"({', '.join(f'{k}: {v}' for k, v in TORCHAO.items())}), same mode.", "",
             "| case | video | weights | mode | ms | / bf16 | / ours | peak activations GiB "
             "| weights GiB | max rel diff | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        run = r["run"]
        lines.append(
            f"| {r['case']} | {r['video']} | {r['weights']} | {r['mode']} | "
            f"{run['error'] or f(run['median_ms'], '.0f')} | {f(r['time_ratio'], '.2f')} | "
            f"{f(r.get('time_ratio_to_ours'), '.2f')} | "
            f"{f(r['peak_activation_bytes'], '.2f', GIB)} | {f(r['weight_bytes'], '.2f', GIB)} | "
            f"{f(r['max_rel_diff_to_bf16'], '.2e')} | {'; '.join(r['warnings']) or ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for quant_gpu.json / .md")
    parser.add_argument("--case", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--scheme", nargs="+", choices=[*WEIGHTS, *TORCHAO],
                        default=list(WEIGHTS),
                        help="bf16 is the reference of the ratios and differences; the torchao "
                             "rows need torchao and follow our scheme of the same arithmetic")
    parser.add_argument("--mode", nargs="+", choices=("eager", "compiled"),
                        default=["eager", "compiled"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model and latent: a smoke test that runs on the CPU")
    args = parser.parse_args(argv)
    if "bf16" in args.scheme:  # the reference first, ours before torchao's
        args.scheme = ["bf16"] + [s for s in args.scheme if s != "bf16"]
    args.scheme = sorted(args.scheme, key=lambda s: s in TORCHAO)
    missing = torchao_missing() if any(s in TORCHAO for s in args.scheme) else None
    if missing is not None:
        parser.error(f"--scheme {' '.join(s for s in args.scheme if s in TORCHAO)}: {missing}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unavailable = fp8_matmul_unavailable(device)
    data = {"torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda"
            else platform.processor() or "cpu",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "fp8_matmul": unavailable, "repeats": args.repeats, "quick": args.quick,
            "command": "python " + " ".join(sys.argv if argv is None else ["quant_gpu.py", *argv]),
            "rows": []}
    for name in args.case:
        print(f"{name}:", flush=True)
        t0 = time.perf_counter()
        data["rows"] += run_case(name, args, device)
        print(f"  {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        # after every case, so a cut-off run keeps what it measured
        write_atomically(out / "quant_gpu.json", json.dumps(data, indent=1).encode())
        write_atomically(out / "quant_gpu.md", markdown(data).encode())
    print(markdown(data))
    failed = [r for r in data["rows"] if r["run"]["error"]]
    fell_back = unavailable is None and any(
        r["warnings"] for r in data["rows"] if r["weights"] == "fp8_e4m3fn_fast")
    return 1 if failed or fell_back else 0


if __name__ == "__main__":
    sys.exit(main())
