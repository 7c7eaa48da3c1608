#!/usr/bin/env bash
# Ours against diffusers on a GPU machine, in one go: checks that diffusers' models on our mapped
# weights compute what ours do (float32, CPU), then times the cases on the GPU in bf16.
# Usage, from the repository root: bench/run_peer_gpu.sh OUT_DIR [peer_diffusers.py args...]
# (diffusers 0.42 and its missing dependencies come as wheels in .whl/; see gpu_env.sh).
out=${1:?usage: run_peer_gpu.sh OUT_DIR [--case ...] [--repeats N]}; shift
mkdir -p "$out"
. bench/gpu_env.sh
python3 -c "import torch, diffusers; from diffusers import AutoencoderKLWan, WanTransformer3DModel; print('torch', torch.__version__, 'diffusers',
  diffusers.__version__, torch.cuda.get_device_name())" || exit 1
python3 -m pytest -q -p no:cacheprovider tests/test_peer_mapping.py 2>&1 | tail -2
python3 bench/peer_diffusers.py --out "$out" "$@" 2>&1 | grep -v "^|"
cat "$out"/peer_diffusers.md
