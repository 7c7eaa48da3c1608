. bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/peer --case dit_5b dit_1_3b --mode fp8_fp8attn_eager --repeats 3 2>&1 | grep -E "^\| dit|Error"
timeout 330 python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/peer --case dit_14b --mode fp8_fp8attn_eager --repeats 2 2>&1 | grep -E "^\| dit|Error"
