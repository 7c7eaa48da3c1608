"""Our umT5 text encoder against ComfyUI's own text encoding of the same file: load time, encode
time and peak memory, on the CPU and on the GPU.

    python bench/text_encoder_peer.py --comfyui PATH --file umt5_xxl_fp8_e4m3fn_scaled.safetensors
        --out DIR [--random xxl|tiny [--seed N]] [--comfyui-python PY] [--device cpu cuda]
        [--dtype auto] [--repeats 3] [--quick]

No real weights are needed: --random first writes a seeded random umT5 of real (xxl) or tiny
size to --file in the layout of ComfyUI's umt5_xxl_fp8_e4m3fn_scaled (bench/random_umt5.py).

PATH is a ComfyUI checkout (its `comfy` package is imported from there, in a process of its
own). Each side runs in a fresh process, so that its peak resident memory (ru_maxrss) is its own:
ours loads the file with the Wan Text Encoder Loader's code (`--dtype`, default auto) and encodes
through the node's pipeline; ComfyUI's loads it with comfy.sd.load_clip(type wan), as its
CLIPLoader does, and encodes with encode_from_tokens_scheduled, as CLIPTextEncode does (on the
CPU with --cpu). Both encode the same prompt and the official negative prompt; the prompt's
512 rows are compared (max |ours - theirs| / max |theirs|), and where the CPU ran, every other
encoding against ours there (float32: the reference). Each side reports the dtype it computes
in (ComfyUI's is its text_encoder_dtype: fp16 on a GPU unless told otherwise).

--quick: the CPU only and one encode per side (a CPU encode of the full umT5 takes minutes).
Rows go to DIR/text_encoder_peer.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from wan_enhanced.bench.random_umt5 import SIZES, write_random_umt5

PROMPT = "A red fox trots through fresh snow in a birch forest at sunrise, cinematic light"

# The process's own peak resident memory: VmHWM belongs to its address space, which exec
# replaces (ru_maxrss survives exec, so a child would report its parent's peak).
PEAK_RSS = r"""
def PEAK_RSS():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""

OURS = PEAK_RSS + r"""
import json, sys, time, torch
from pathlib import Path
from wan_enhanced import host
from wan_enhanced.nodes.text import DEFAULT_NEGATIVE
from wan_enhanced.pipeline.loading import load_text_encoder_handle
from wan_enhanced.pipeline.text import encode_prompts
file, device, dtype, prompt, repeats, rows_out = sys.argv[1:7]
if device == "cpu":
    host.compute_device = lambda: torch.device("cpu")
start = time.perf_counter()
handle = load_text_encoder_handle(Path(file), dtype, "gpu" if device == "cuda" else "cpu")
loaded = time.perf_counter() - start
times = []
for _ in range(int(repeats)):
    start = time.perf_counter()
    rows = encode_prompts(handle, [prompt, DEFAULT_NEGATIVE])
    times.append(time.perf_counter() - start)
torch.save(rows[0], rows_out)
print(json.dumps({"load_s": loaded, "encode_s": times,
                  "peak_rss_bytes": PEAK_RSS(),
                  "peak_cuda_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
                  "torch": torch.__version__,
                  "weights_dtype": str(handle.model.blocks[0].attn.q.weight.dtype),
                  "compute_dtype": str(handle.model.norm.weight.dtype)}))
"""

THEIRS = PEAK_RSS + r"""
import json, sys, time
file, device, comfyui, prompt, repeats, rows_out = sys.argv[1:7]
sys.argv = ["main.py"] + (["--cpu"] if device == "cpu" else [])
sys.path.insert(0, comfyui)
import comfy.options
comfy.options.enable_args_parsing()  # as ComfyUI's main.py does, so that --cpu counts
import torch
import comfy.model_management
import comfy.sd
from wan_enhanced.nodes.text import DEFAULT_NEGATIVE
start = time.perf_counter()
clip = comfy.sd.load_clip(ckpt_paths=[file], clip_type=comfy.sd.CLIPType.WAN)
loaded = time.perf_counter() - start
times = []
for _ in range(int(repeats)):
    start = time.perf_counter()
    conds = [clip.encode_from_tokens_scheduled(clip.tokenize(text))[0][0]
             for text in (prompt, DEFAULT_NEGATIVE)]
    times.append(time.perf_counter() - start)
torch.save(conds[0].float().cpu(), rows_out)
print(json.dumps({"load_s": loaded, "encode_s": times,
                  "peak_rss_bytes": PEAK_RSS(),
                  "peak_cuda_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
                  "torch": torch.__version__,
                  "weights_dtype": None,
                  "compute_dtype": str(comfy.model_management.text_encoder_dtype(
                      clip.patcher.load_device))}))
"""


def run_side(code: str, args: list[str], timeout: float, python: str = sys.executable) -> dict:
    done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                f"exit code {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(ours_rows: Path, theirs_rows: Path, length: int = 512) -> float | None:
    import torch

    if not (ours_rows.is_file() and theirs_rows.is_file()):
        return None
    ours, theirs = torch.load(ours_rows), torch.load(theirs_rows)
    ours, theirs = ours[:, :length].float(), theirs[:, :length].float()
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12))


def markdown(rows: list[dict]) -> str:
    def number(value, spec, scale=1.0):
        return "-" if value is None else format(value / scale, spec)

    lines = ["| device | side | load s | encode s (median) | peak RSS GiB | peak CUDA GiB | "
             "weights | computes in | rel. error |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for side in ("ours", "comfyui"):
            r = row[side]
            encode = sorted(r.get("encode_s") or [None])[len(r.get("encode_s") or [0]) // 2]
            lines.append(f"| {row['device']} | {side} | {number(r.get('load_s'), '.1f')} | "
                         f"{number(encode, '.2f')} | "
                         f"{number(r.get('peak_rss_bytes'), '.2f', 2 ** 30)} | "
                         f"{number(r.get('peak_cuda_bytes'), '.2f', 2 ** 30)} | "
                         f"{r.get('weights_dtype') or '-'} | {r.get('compute_dtype') or '-'} | "
                         f"{number(row['relative_error'], '.2e') if side == 'ours' else ''} |"
                         + (f" {r['error']}" if "error" in r else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", required=True, help="a ComfyUI checkout")
    parser.add_argument("--comfyui-python", default=sys.executable,
                        help="the Python with ComfyUI's requirements (default: this one); it "
                             "must import wan_enhanced too (PYTHONPATH)")
    parser.add_argument("--file", required=True, help="the umT5 file (ComfyUI's layout)")
    parser.add_argument("--random", choices=SIZES,
                        help="first write a seeded random umT5 of this size to --file in the "
                             "layout of ComfyUI's umt5_xxl_fp8_e4m3fn_scaled (bench/random_umt5.py;"
                             " kept when it is already there)")
    parser.add_argument("--seed", type=int, default=0, help="the random file's seed")
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--device", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", help="our loader's dtype (auto, bf16, ...)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--quick", action="store_true", help="CPU only, one encode per side")
    args = parser.parse_args(argv)
    devices, repeats = (["cpu"], 1) if args.quick else (args.device, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.random:
        start = time.perf_counter()
        import torch  # drawn on a GPU where there is one: seconds instead of minutes

        write_random_umt5(args.file, args.random, args.seed,
                          "cuda" if torch.cuda.is_available() else "cpu")
        print(f"random umT5 {args.random} at {args.file} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    rows = []
    for device in devices:
        ours_rows, theirs_rows = out / f"ours-{device}.pt", out / f"comfyui-{device}.pt"
        ours = run_side(OURS, [args.file, device, args.dtype, args.prompt, str(repeats),
                               str(ours_rows)], args.timeout)
        theirs = run_side(THEIRS, [args.file, device, args.comfyui, args.prompt, str(repeats),
                                   str(theirs_rows)], args.timeout, args.comfyui_python)
        rows.append({"device": device, "ours": ours, "comfyui": theirs,
                     "relative_error": compare(ours_rows, theirs_rows)})
        print(markdown(rows[-1:]), flush=True)
    reference = out / "ours-cpu.pt"  # float32 on the CPU (auto), the reference when it ran
    distances = {f"{side}-{device}": compare(out / f"{side}-{device}.pt", reference)
                 for device in devices for side in ("ours", "comfyui")
                 if reference.is_file() and not (side == "ours" and device == "cpu")}
    for device in devices:
        for side in ("ours", "comfyui"):
            (out / f"{side}-{device}.pt").unlink(missing_ok=True)
    if distances:
        print("max rel. distance to our float32 CPU encoding:", json.dumps(distances))
    from wan_enhanced.bench.harness import comfy_version

    result = {"comfyui": comfy_version(Path(args.comfyui)), "file": Path(args.file).name,
              "random": args.random and
              f"{args.random}, seed {args.seed}", "dtype": args.dtype, "repeats": repeats,
              "prompt": args.prompt, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "rows": rows, "distance_to_float32_cpu": distances}
    (out / "text_encoder_peer.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "text_encoder_peer.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
