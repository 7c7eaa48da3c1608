# the fp8 o-projections after attention quantizing with the row kernel in compiled graphs too (base: this checkout)
# against the previous wan/dit.py, quant/linear.py, quant/fp8_rows.py (.device/var/old), alternating, on one machine
. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_quant.py tests/test_dit.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 480 bench/run_forward_ab.sh 2 base .device/var/old -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case dit_1_3b dit_5b --mode fp8_fp8attn_compiled --repeats 3 \
  2>&1 | grep -E "^== |fp8_fp8attn_compiled: ours|\| dit_"
kill %1
