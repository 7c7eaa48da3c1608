. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_norm_codes.py --tb=short 2>&1 | grep -E "^FAILED|passed|failed|codes differ|Unsupported|Explanation|Hint:|graph break|Graph break" | head -14
python3 bench/phase_peaks_gpu.py --case dit_5b 2>&1 | grep -E "peak|Error"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 330 bench/run_forward_ab.sh 1 base .device/var/old -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case dit_1_3b dit_5b --mode fp8_fp8attn_compiled --repeats 3 \
  2>&1 | grep -E "^== |\| dit_|Error"
kill %1
