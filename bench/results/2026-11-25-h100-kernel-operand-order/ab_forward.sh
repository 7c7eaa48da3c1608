. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 250 > $OUT/clocks.csv &
for v in a b a b; do
  cp .device/var/hopper_$v.py wan/fp8_attention_hopper.py; cp .device/var/kernels_$v.py wan/fp8_attention_kernels.py
  echo "== $v $(date +%T)"
  python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/peer_$v --case dit_5b --mode fp8_fp8attn_compiled --repeats 3 2>&1 | grep "fp8_fp8attn_compiled:"
  echo "== end $v $(date +%T)"
done
kill %1
