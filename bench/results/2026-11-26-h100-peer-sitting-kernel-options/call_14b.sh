# the 14B rows in two halves (argument 1 or 2), median of 2 forwards
. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_B$1.csv &
date +%T
if [ "$1" = 1 ]; then modes="bf16_eager bf16_compiled fp8_compiled"; else modes="fp8_eager fp8_fp8attn_eager fp8_fp8attn_compiled"; fi
timeout 575 python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/peer --case dit_14b --repeats 2 --mode $modes 2>&1 | grep -v Warning | tail -12
date +%T; kill %1
