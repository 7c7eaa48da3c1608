. bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_fp8_attention.py -k "keys or chunk or one_pass" 2>&1 | grep -E "^FAILED|passed|failed" | tail -5
for c in dit_5b dit_1_3b; do
timeout 280 bench/run_forward_ab.sh 1 base .device/var/prev2 -- python3 bench/peer_comfy.py \
  --comfyui .device/ComfyUI --out /tmp/ab --case $c --mode fp8_fp8attn_eager --repeats 3 \
  2>&1 | grep -E "^== |fp8_fp8attn_eager: ours|Error"
done
