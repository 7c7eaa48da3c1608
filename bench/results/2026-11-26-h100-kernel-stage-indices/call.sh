. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 200 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_norm_codes.py tests/test_dit.py tests/test_glue.py --tb=short 2>&1 | tail -5
echo "== kernels"
timeout 170 python3 bench/results/2026-11-26-h100-fp8-three-groups/variants/ab_files.py VARIANTS 5b,14b,1_3b 3 $OUT/kernel_ab.json 2>&1 | grep -vE "^\s*$" | tail -30
echo "== profile"
timeout 200 python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/prof --case dit_5b --mode fp8_fp8attn_compiled --repeats 1 --profile 2>&1 | grep -E "\| dit_|Error" | tail -5
kill %1
