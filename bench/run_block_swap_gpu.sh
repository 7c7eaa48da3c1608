#!/usr/bin/env bash
# Block swap on a GPU machine, in one go: the opt-in GPU tests (swapped forward equals resident,
# bit for bit, through the side-stream ring), then bench/block_swap_gpu.py.
# Usage, from the repository root: bench/run_block_swap_gpu.sh OUT_DIR [block_swap_gpu.py args...]
out=${1:?usage: run_block_swap_gpu.sh OUT_DIR [--case ...] [--mode ...] [--repeats N]}; shift
mkdir -p "$out"
. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider tests/test_block_swap.py 2>&1 | tail -2
python3 bench/block_swap_gpu.py --out "$out" "$@" 2>&1 | grep -v "^|"
cat "$out"/block_swap.md
