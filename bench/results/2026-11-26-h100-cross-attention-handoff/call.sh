. bench/gpu_env.sh
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -3
date +%T
timeout 200 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_norm_codes.py tests/test_glue.py tests/test_quant.py tests/test_dit.py -x --tb=short 2>&1 | grep -E "^FAILED|passed|failed|Error|assert" | head -12
date +%T
timeout 60 python3 bench/phase_peaks_gpu.py --case dit_5b 2>&1 | grep -E "peak|Error"
date +%T
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 300 bench/run_forward_ab.sh 1 base .device/var/old -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case dit_5b dit_1_3b --mode fp8_fp8attn_compiled --repeats 3 \
  2>&1 | grep -E "^== |\| dit_|Error"
kill %1; date +%T
