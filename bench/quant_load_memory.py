"""Host memory of the model loader on the CPU: plain bf16 against quantize-on-load.

The design target: quantizing on load (checkpoints/loader.py load_dit with `quantization`)
peaks at no more than 1.1x the final model's size in host RAM, i.e. the loader never holds the
model twice. This measures it on a real-size checkpoint.

A seeded random-weight bf16 checkpoint of Wan2.1 T2V-1.3B in ComfyUI's single-file layout
(checkpoints/tiny.py write_dit, layout "comfy") is written into --cache, or reused when a file
with the right shapes is already there. It is drawn directly in bf16 (no float32 copy) in a
subprocess of its own, so its memory is in no measurement. The file then sits in the page
cache: the loads read it from memory, not from the disk.

Each --scheme then loads it in a fresh Python process, through pipeline/loading.py load_model
exactly as the model loader node calls it (weight_dtype = the scheme, attention "sdpa", model
left on the CPU). That process records its baseline after importing torch and the package
(VmRSS, RssAnon and RssFile from /proc/self/status), resets the peak-RSS mark (writing 5 to
/proc/self/clear_refs), starts a thread that samples RssAnon and VmRSS every 5 ms, loads, and
reports
  final model     bytes of the model's parameters and buffers (quantized codes, their float32
                  scales and everything left unquantized), and how many of them still point
                  into the checkpoint's file mapping rather than private memory
  peak RssAnon    the largest sampled anonymous (private) memory, minus the baseline
  peak RSS        VmHWM (peak resident set) minus the baseline VmRSS
  after load      RssAnon and RssFile over the baseline once the loader has returned
  heap returned   how much RssAnon malloc_trim(0) hands back after that, the model still
                  alive: free memory that glibc's heap kept from the load
  seconds         the load_model call
safetensors maps the file into the process, so every page the loader reads shows up in the
RSS as file-backed memory (RssFile): clean page-cache pages, shared with the page cache and
reclaimable, but counted by VmRSS/VmHWM. The target is about the memory the load itself
allocates, the anonymous memory, so RssAnon is reported on its own and the ratio is
peak RssAnon over the final model's bytes.

    python bench/quant_load_memory.py --out DIR [--cache DIR] [--scheme bf16 fp8_e4m3fn int8]
                                      [--repeats 1] [--quick]

--cache: where the checkpoint is kept between runs (2.6 GiB at 1.3B); without it a
temporary folder is used and removed at the end.
--repeats: fresh processes per scheme; the peaks vary from process to process (how glibc's
heap happens to fragment), so the table gives medians and the range of the peaks.
The children inherit the environment: MALLOC_* and GLIBC_TUNABLES settings (glibc's malloc
thresholds) apply to the loads and are recorded with the results.
--quick: the tiny test configuration (checkpoints/tiny.py TINY_DIT["t2v"]), a smoke test.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

GIB = 1024 ** 3
MODEL = "wan2.1-t2v-1.3b"
DEFAULT_SCHEMES = ("bf16", "fp8_e4m3fn", "int8")
TARGET_RATIO = 1.1
SAMPLE_SECONDS = 0.005


# -- /proc -------------------------------------------------------------------------------------

def proc_status() -> dict[str, int]:
    """The memory fields of /proc/self/status, in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name.startswith(("Vm", "Rss")) and rest.strip().endswith("kB"):
                values[name] = int(rest.split()[0]) * 1024
    return values


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path`."""
    target = str(path.resolve())
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


class PeakSampler:
    """Samples RssAnon and VmRSS in a background thread, keeping the largest of each."""

    def __init__(self, interval: float = SAMPLE_SECONDS):
        self.interval = interval
        self.peak_anon = 0
        self.peak_rss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        status = proc_status()
        self.peak_anon = max(self.peak_anon, status["RssAnon"])
        self.peak_rss = max(self.peak_rss, status["VmRSS"])
        self.samples += 1

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


# -- child processes ---------------------------------------------------------------------------

def dit_config(quick: bool):
    from wan_enhanced.checkpoints.tiny import TINY_DIT
    from wan_enhanced.wan.configs import KNOWN_DITS

    return TINY_DIT["t2v"] if quick else KNOWN_DITS[MODEL].config


def child_generate(path: Path, quick: bool, seed: int) -> None:
    """Write the random bf16 checkpoint: drawn in bf16 (never a float32 copy) and saved from
    those tensors (safetensors writes them in place), so about one model of memory."""
    import torch

    from wan_enhanced.checkpoints.tiny import randomize, write_dit
    from wan_enhanced.wan.dit import WanDiT

    config = dit_config(quick)
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = randomize(skeleton, seed, dtype=torch.bfloat16)
    write_dit(path, config, layout="comfy", dtype=torch.bfloat16, state=state)


def model_bytes(model, mapped: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(all parameter and buffer bytes, those of quantized block layers, those whose data lies
    inside the checkpoint's file mapping)."""
    from wan_enhanced.quant.linear import QuantizedLinear

    quantized = {id(t) for m in model.modules() if isinstance(m, QuantizedLinear)
                 for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    total = in_quantized = in_file = 0
    for tensor in (*model.parameters(), *model.buffers()):
        nbytes = tensor.nbytes
        total += nbytes
        in_quantized += nbytes if id(tensor) in quantized else 0
        ptr = tensor.data_ptr()
        if any(start <= ptr < end for start, end in mapped):
            in_file += nbytes
    return total, in_quantized, in_file


def malloc_trim() -> bool:
    """Hand glibc's free heap memory back to the kernel; False where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def child_load(path: Path, weight_dtype: str) -> dict:
    """One load as the model loader node does it, with its memory and time."""
    import torch  # noqa: F401  (part of the baseline)

    from wan_enhanced.pipeline import loading
    from wan_enhanced.profiling.snapshot import reset_rss_peak

    gc.collect()
    baseline = proc_status()
    hwm_reset = reset_rss_peak()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        handle = loading.load_model(path, weight_dtype, "sdpa", False, False)
        seconds = time.perf_counter() - start
    end_status = proc_status()  # VmHWM: the peak since the reset
    gc.collect()
    after = proc_status()
    total, quantized, in_file = model_bytes(handle.model, file_mappings(path))
    # measured last, with the model still alive: free memory the C heap kept after the load
    trimmed = proc_status() if malloc_trim() else None
    return {
        "weight_dtype": weight_dtype, "seconds": seconds,
        "quantization": handle.quantization, "detail": handle.info.quantization_detail,
        "final_model_bytes": total, "quantized_layer_bytes": quantized,
        "model_bytes_in_file_mapping": in_file,
        "baseline": {k: baseline[k] for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")},
        "peak_rss_anon_over_baseline": sampler.peak_anon - baseline["RssAnon"],
        "peak_rss_sampled_over_baseline": sampler.peak_rss - baseline["VmRSS"],
        "peak_vmhwm_over_baseline": end_status["VmHWM"] - baseline["VmRSS"],
        "vmhwm_reset": hwm_reset,
        "after_load_rss_anon_over_baseline": after["RssAnon"] - baseline["RssAnon"],
        "after_load_rss_file_over_baseline": after["RssFile"] - baseline["RssFile"],
        "heap_returned_by_malloc_trim": (None if trimmed is None
                                         else after["RssAnon"] - trimmed["RssAnon"]),
        "samples": sampler.samples,
    }


def run_child(args: list[str]) -> None:
    subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], check=True)


# -- the parent --------------------------------------------------------------------------------

def checkpoint_matches(path: Path, quick: bool) -> bool:
    """The cached file is a complete bf16 checkpoint of the configuration's shapes."""
    from wan_enhanced.checkpoints.loader import inspect_checkpoint
    from wan_enhanced.checkpoints.reader import CheckpointError

    if not path.is_file():
        return False
    try:
        info = inspect_checkpoint(path)
    except CheckpointError:
        return False
    config = dit_config(quick)
    return (info.config.dim, info.config.ffn_dim, info.config.num_layers, info.config.in_dim) == (
        config.dim, config.ffn_dim, config.num_layers, config.in_dim) and set(
        info.disk_dtypes) == {"bfloat16"}


def machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as info:
            memory = next(int(line.split()[1]) * 1024 for line in info
                          if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "memory_bytes": memory,
            "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}


def _gib(value) -> str:
    return "" if value is None else f"{value / GIB:.3f}"


# the measurements summarised over a scheme's repeated loads (median, and the range of some)
MEASURES = ("seconds", "peak_rss_anon_over_baseline", "peak_vmhwm_over_baseline",
            "after_load_rss_anon_over_baseline", "after_load_rss_file_over_baseline",
            "heap_returned_by_malloc_trim")
RANGED = ("peak_rss_anon_over_baseline", "peak_vmhwm_over_baseline")


def summarise(weight_dtype: str, runs: list[dict]) -> dict:
    """One table row: the model's bytes (the same in every run), each measure's median over
    the runs, the range of the peaks, and the ratio of peak RssAnon to the final model."""
    first = runs[0]
    row = {"weight_dtype": weight_dtype, "repeats": len(runs)}
    for key in ("quantization", "detail", "final_model_bytes", "quantized_layer_bytes",
                "model_bytes_in_file_mapping", "vmhwm_reset"):
        row[key] = first[key]
    for key in MEASURES:
        values = [r[key] for r in runs if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    for key in RANGED:
        row[key + "_min"] = min(r[key] for r in runs)
        row[key + "_max"] = max(r[key] for r in runs)
    final = row["final_model_bytes"]
    row["ratio_to_final_model"] = row["peak_rss_anon_over_baseline"] / final
    row["ratio_to_final_model_max"] = row["peak_rss_anon_over_baseline_max"] / final
    row["runs"] = runs
    return row


def _ranged(row: dict, key: str) -> str:
    if row["repeats"] == 1:
        return _gib(row[key])
    return f"{_gib(row[key])} ({_gib(row[key + '_min'])}–{_gib(row[key + '_max'])})"


def markdown(data: dict) -> str:
    m = data["machine"]
    memory = f"{m['memory_bytes'] / GIB:.1f} GiB RAM" if m["memory_bytes"] else "RAM unknown"
    repeats = data["repeats"]
    over = ("one fresh process per scheme" if repeats == 1 else
            f"{repeats} fresh processes per scheme: medians, peaks with their range "
            f"(min–max), ratio of the median (and of the largest) peak")
    env = ", ".join(f"{k}={v}" for k, v in data["environment"].items()) or "none set"
    lines = [
        f"# Quantize-on-load host memory, {data['model']}, CPU", "",
        f"{m['cpu']}, {m['cpu_count']} CPUs, {memory}; {m['platform']}; Python {m['python']}, "
        f"torch {m['torch']}; date {m['date']}; malloc/thread environment: {env}", "",
        "Command:", "", f"    {data['command']}", "",
        f"Checkpoint: seeded random bf16 weights, ComfyUI single-file layout, "
        f"{_gib(data['checkpoint_bytes'])} GiB on disk. Each load is a fresh process calling "
        f"load_model as the model loader node does; memory is over that process's baseline "
        f"after importing torch and the package; {over}. Ratio: peak RssAnon over the final "
        f"model's bytes (target <= {TARGET_RATIO}x for the quantized schemes). Peak RSS "
        f"(VmHWM) also counts the checkpoint's pages mapped from the file (page cache).", "",
        "| scheme | final model GiB | peak RssAnon over baseline GiB | ratio to final model "
        "| peak RSS (VmHWM) over baseline GiB | seconds |",
        "|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        ratio = f"{r['ratio_to_final_model']:.3f}"
        if r["repeats"] > 1:
            ratio += f" (max {r['ratio_to_final_model_max']:.3f})"
        lines.append(
            f"| {r['weight_dtype']} | {_gib(r['final_model_bytes'])} | "
            f"{_ranged(r, 'peak_rss_anon_over_baseline')} | {ratio} | "
            f"{_ranged(r, 'peak_vmhwm_over_baseline')} | {r['seconds']:.1f} |")
    lines += ["", "After the load (medians), and where the model's bytes live. Heap returned "
              "by malloc_trim: free memory glibc's heap still held after the load (the model "
              "alive), handed back by malloc_trim(0) once everything was measured (free heap from "
              "before the load included).", "",
              "| scheme | quantized layers GiB | model bytes in the file mapping GiB "
              "| RssAnon after load GiB | RssFile after load GiB | heap returned by "
              "malloc_trim GiB |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(
            f"| {r['weight_dtype']} | {_gib(r['quantized_layer_bytes'])} | "
            f"{_gib(r['model_bytes_in_file_mapping'])} | "
            f"{_gib(r['after_load_rss_anon_over_baseline'])} | "
            f"{_gib(r['after_load_rss_file_over_baseline'])} | "
            f"{_gib(r['heap_returned_by_malloc_trim'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from wan_enhanced.pipeline.loading import MODEL_DTYPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True,
                        help="folder for quant_load_memory.json / .md")
    parser.add_argument("--cache", help="folder keeping the checkpoint between runs "
                                        "(default: a temporary folder, removed at the end)")
    parser.add_argument("--scheme", nargs="+", choices=MODEL_DTYPES,
                        default=list(DEFAULT_SCHEMES), help="the model loader's weight_dtype")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per scheme (the peaks vary between processes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model: a smoke test of the script")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    temporary = args.cache is None
    cache = Path(tempfile.mkdtemp(prefix="quant_load_memory_")) if temporary else Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    name = "tiny_t2v" if args.quick else MODEL.replace(".", "_").replace("-", "_")
    checkpoint = cache / f"{name}_random_bf16_seed{args.seed}.safetensors"
    data = {"model": "tiny t2v" if args.quick else MODEL, "quick": args.quick,
            "machine": machine(),
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith(("MALLOC_", "GLIBC_TUNABLES", "OMP_", "MKL_"))},
            "command": "python " + " ".join(
                sys.argv if argv is None else ["bench/quant_load_memory.py", *argv]),
            "checkpoint": str(checkpoint), "target_ratio": TARGET_RATIO,
            "repeats": args.repeats, "rows": []}
    try:
        if checkpoint_matches(checkpoint, args.quick):
            print(f"reusing {checkpoint}", flush=True)
        else:
            print(f"writing {checkpoint}", flush=True)
            start = time.perf_counter()
            run_child(["child-generate", str(checkpoint), str(args.seed)]
                      + (["--quick"] if args.quick else []))
            print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
        data["checkpoint_bytes"] = checkpoint.stat().st_size
        for weight_dtype in args.scheme:
            runs = []
            for _ in range(args.repeats):
                result_file = out / f".quant_load_memory_{weight_dtype}.json"
                run_child(["child-load", str(checkpoint), weight_dtype, str(result_file)])
                run = json.loads(result_file.read_text())
                result_file.unlink()
                runs.append(run)
                print(f"  {weight_dtype}: final {_gib(run['final_model_bytes'])} GiB, peak "
                      f"anon {_gib(run['peak_rss_anon_over_baseline'])} GiB "
                      f"({run['peak_rss_anon_over_baseline'] / run['final_model_bytes']:.3f}x), "
                      f"VmHWM {_gib(run['peak_vmhwm_over_baseline'])} GiB, "
                      f"{run['seconds']:.1f} s", flush=True)
            data["rows"].append(summarise(weight_dtype, runs))
            # after every scheme, so a cut-off run keeps what it measured
            write_outputs(out, data)
        write_outputs(out, data)
    finally:
        if temporary:
            shutil.rmtree(cache, ignore_errors=True)
    print(markdown(data))
    return 0


def write_outputs(out: Path, data: dict) -> None:
    from wan_enhanced.atomic_files import write_atomically

    write_atomically(out / "quant_load_memory.json", json.dumps(data, indent=1).encode())
    write_atomically(out / "quant_load_memory.md", markdown(data).encode())


def child_main(argv: list[str]) -> int:
    mode, path, *rest = argv
    if mode == "child-generate":
        child_generate(Path(path), "--quick" in rest, int(rest[0]))
        return 0
    weight_dtype, result_file = rest
    result = child_load(Path(path), weight_dtype)
    Path(result_file).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("child-generate", "child-load"):
        sys.exit(child_main(sys.argv[1:]))
    sys.exit(main())
