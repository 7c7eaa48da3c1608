# GPU 0: the fused norm codes in the forward (A/B); GPU 1 (a copy of the checkout): their GPU
# tests, then the Hopper kernel's STAGES in the forward.
. bench/gpu_env.sh
nvidia-smi -L; nvidia-smi topo -m | head -4
nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw --format=csv,noheader -lms 250 > $OUT/clocks.csv &
CLK=$!
cp -a . /tmp/w1 && rm -rf /tmp/w1/.whl
mkdir -p /tmp/pkg1 && ln -sfn /tmp/w1 /tmp/pkg1/wan_enhanced
(
  cd /tmp/w1 && export PYTHONPATH=/tmp/pkg1:/tmp/site CUDA_VISIBLE_DEVICES=1
  bench/run_forward_ab.sh 1 .device/var/fused_codes -- python3 -m pytest --gpu -q -x tests/test_fp8_norm_codes.py tests/test_dit.py tests/test_glue.py 2>&1 | tail -25
  bench/run_forward_ab.sh 2 base .device/var/stages2 .device/var/stages4 -- python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/ab1 --case dit_5b --mode fp8_fp8attn_compiled --repeats 3 2>&1 | grep -E "^== |fp8_fp8attn_compiled:|Error|error" 
) > $OUT/gpu1.txt 2>&1 &
G1=$!
export CUDA_VISIBLE_DEVICES=0
bench/run_forward_ab.sh 2 base .device/var/fused_codes -- python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/ab0 --case dit_5b --mode fp8_compiled fp8_fp8attn_compiled --repeats 3 2>&1 | grep -E "^== |_compiled:|Error|error" | tee $OUT/gpu0.txt
wait $G1
cat $OUT/gpu1.txt
kill $CLK
