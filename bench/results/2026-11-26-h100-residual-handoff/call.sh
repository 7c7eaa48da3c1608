# the compiled blocks handing a phase's residual update to the next graph (base: this checkout)
# against the previous wan/dit.py (.device/var/old), alternating, on one machine
. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_dit.py tests/test_block_swap.py 2>&1 | tail -1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 480 bench/run_forward_ab.sh 2 base .device/var/old -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case dit_1_3b dit_5b --mode fp8_fp8attn_compiled --repeats 3 \
  2>&1 | grep -E "^== |fp8_fp8attn_compiled: ours|\| dit_"
kill %1
