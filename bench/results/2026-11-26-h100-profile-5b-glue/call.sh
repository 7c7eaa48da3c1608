. bench/gpu_env.sh
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -3
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 200 python3 bench/results/2026-11-26-h100-profile-5b-glue/block_sequence.py dit_5b fp8_triton 2>&1 | grep -v Warning | tail -40
timeout 300 python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/prof --case dit_5b --mode fp8_fp8attn_compiled --repeats 3 --profile 2>&1 | grep -v Warning | tail -6
kill %1
