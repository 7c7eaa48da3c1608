. bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_dit.py tests/test_norm_codes.py tests/test_fp8_attention.py 2>&1 | grep -E "^FAILED|passed|failed" | tail -6
for c in dit_5b dit_1_3b; do
timeout 200 bench/run_forward_ab.sh 1 base .device/var/prev3 -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case $c --mode fp8_fp8attn_eager --repeats 3 \
  2>&1 | grep -E "^== |fp8_fp8attn_eager: ours|Error"
done
