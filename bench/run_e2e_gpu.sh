#!/usr/bin/env bash
# End to end on a GPU machine, ours against ComfyUI's own, on the same files: writes the
# scenario's random model set in ComfyUI's layout, then in fresh processes runs our bench
# (cold, then warm with the next seed) and ComfyUI's pipeline (bench/peer_comfy_e2e.py, cold then
# warm). The tables, the JSON records and our event logs go to OUT_DIR.
# Usage, from the repository root, with a ComfyUI checkout in COMFYUI (default .comfyui) and
# PyAV, ftfy, wcwidth, torchsde and trampoline as wheels in .whl/ (see gpu_env.sh):
#   bench/run_e2e_gpu.sh OUT_DIR SCENARIO [MODELS]
set -o pipefail
out=${1:?usage: run_e2e_gpu.sh OUT_DIR SCENARIO [MODELS]}
scenario=${2:?usage: run_e2e_gpu.sh OUT_DIR SCENARIO [MODELS]}
models=${3:-/tmp/bench-models}
comfyui=${COMFYUI:-.comfyui}
mkdir -p "$out"
. bench/gpu_env.sh
read -r workflow set_name < <(python3 - "$scenario" <<'PY'
import sys
from wan_enhanced.runner.bench_command import SCENARIOS
s = SCENARIOS[sys.argv[1]]
print(s.workflow, s.model_set)
PY
)
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv \
  | tee /dev/stderr >/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
python3 -c "from wan_enhanced.runner.bench_models import ensure_model_set as e; \
e('$models', '$set_name')" || exit 1
echo "model set written in $(( $(date +%s) - start )) s"; du -sh "$models"
work=/tmp/e2e-ours-$scenario
python3 -m wan_enhanced.runner.cli bench --scenario "$scenario" --warm --models "$models" \
  --out "$work" 2>&1 | grep -v "^\[" | tail -20
cp "$work"/bench-*.md "$work"/bench-*.json "$work"/*-events.json "$out"/
python3 bench/peer_comfy_e2e.py --comfyui "$comfyui" --workflow "api_workflows/$workflow.json" \
  --models "$models" --out "$out" --runs 2 2>&1 | grep -v -E "^\s*[0-9]+%|it/s" | tail -20
ls -la "$out"
