. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_fp8_attention.py -k "one_pass or before_their_norm or compiled_block_runs" tests/test_norm_codes.py 2>&1 | grep -E "^FAILED|passed|failed|Error" | tail -8
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
for c in dit_1_3b dit_5b; do
timeout 200 bench/run_forward_ab.sh 1 base .device/var/prev -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case $c --mode fp8_fp8attn_compiled --repeats 3 \
  2>&1 | grep -E "^== |\| dit_|Error"
done
kill %1
