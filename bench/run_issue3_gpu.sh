#!/usr/bin/env bash
# GPU checks of the pipeline: the test suite with the GPU tests enabled (CUDA present, so every
# node computes on the GPU), then the memory baseline (three runs of the 1.3B 480p workflow).
# Usage on the GPU machine, from the repository root: bench/run_issue3_gpu.sh OUT_DIR [STEPS]
out=${1:?usage: run_issue3_gpu.sh OUT_DIR [STEPS]}
steps=${2:-4}
mkdir -p "$out"
. bench/gpu_env.sh
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, importlib.util
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for m in ("diffusers", "flash_attn", "sageattention", "pynvml", "av", "ftfy"):
    print(m, "yes" if importlib.util.find_spec(m) else "no")
PY
python3 -m pytest -q --gpu -p no:cacheprovider tests 2>&1 | tail -25 | tee "$out/pytest_gpu.txt"
python3 bench/memory_baseline.py --models /tmp/wan-models --out "$out" --steps "$steps" --runs 3 \
  2>&1 | tee "$out/memory_baseline.log" | tail -30
