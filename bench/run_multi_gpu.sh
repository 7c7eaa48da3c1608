#!/usr/bin/env bash
# Several GPUs on a machine with 2 or 4 of them, in one go: the opt-in GPU tests (NCCL: the split
# DiT equals one GPU's, the fused attention's log-sum-exp), then bench/multi_gpu.py.
# Usage, from the repository root: bench/run_multi_gpu.sh OUT_DIR [multi_gpu.py args...]
out=${1:?usage: run_multi_gpu.sh OUT_DIR [--gpus 1,2,4] [--fsdp both] [--repeats N]}; shift
mkdir -p "$out"
. bench/gpu_env.sh
# NVLink SHARP multicast needs a fabric manager these hosts do not run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi topo -m > "$out/topology.txt" 2>&1 || true
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_multi_gpu_gpu.py 2>&1 | tail -3
python3 bench/multi_gpu.py --out "$out" "$@"
cat "$out"/multi_gpu.md
