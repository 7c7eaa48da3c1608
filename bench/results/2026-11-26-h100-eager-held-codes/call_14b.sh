# 14B eager fp8 + fp8 attention A/B (held codes = base, old = .device/s9old)
. bench/gpu_env.sh
date +%T
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_ab14.csv &
timeout 560 bench/run_forward_ab.sh 1 base .device/s9old -- bash -c 'python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/ab14/$AB_ROUND-${AB_VARIANT//\//_} --case dit_14b --mode fp8_fp8attn_eager --repeats 2' 2>&1 | grep -E "^==|\| dit|Error|error"
date +%T; kill %1
