. bench/gpu_env.sh
date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_norm_codes.py --tb=short 2>&1 | grep -E "^FAILED|passed|failed|Error|assert|differ" | head -12
date +%T
timeout 110 python3 .device/norm_ab.py $OUT/norm_ab.json 2>&1 | grep -v Warning | tail -8
date +%T
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 200 bench/run_forward_ab.sh 1 base .device/var/oldnorm -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case dit_5b dit_1_3b --mode fp8_fp8attn_compiled --repeats 3 \
  2>&1 | grep -E "^== |\| dit_|Error"
kill %1; date +%T
