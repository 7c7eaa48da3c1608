# the 5B and 1.3B rows, every mode, then the attention kernels alone ($OUT: the device tool's output folder)
. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_A.csv &
nvidia-smi -q | grep -E "Product Name|Driver Version|Power Limit" | head -5
date +%T
timeout 380 python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/peer --case dit_5b dit_1_3b 2>&1 | grep -v Warning | tail -24
date +%T; kill %1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 500 > $OUT/clocks_C.csv &
timeout 190 python3 bench/fp8_attention_gpu.py --out $OUT/kernel 2>&1 | grep -v Warning | tail -8
date +%T; kill %1
