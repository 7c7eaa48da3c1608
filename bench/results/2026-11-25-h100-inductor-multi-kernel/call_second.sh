. bench/gpu_env.sh
nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date +%T
for c in dit_5b dit_1_3b; do
timeout 290 bench/run_forward_ab.sh 2 base .device/var/mk -- python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/ab_$c --case $c --mode fp8_fp8attn_compiled --repeats 3 2>&1 | grep -E "^==|fp8_fp8attn_compiled:" | tee -a $OUT/ab.txt
date +%T
done
