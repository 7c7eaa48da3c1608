# GPU 1 (a copy of the checkout): the row-sum variants checked and timed alone, then the 1.3B
# forward A/B; GPU 0: the 5B forward A/B (as is against rs8).
. bench/gpu_env.sh
nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw --format=csv,noheader -lms 250 > $OUT/clocks.csv &
CLK=$!
cp -a . /tmp/w1
mkdir -p /tmp/pkg1 && ln -sfn /tmp/w1 /tmp/pkg1/wan_enhanced
(
  cd /tmp/w1 && export PYTHONPATH=/tmp/pkg1:/tmp/site CUDA_VISIBLE_DEVICES=1
  python3 .device/var/rscheck.py 2>&1 | grep -v Warning | tail -40
  rm -f wan/_var_*.py
  bench/run_forward_ab.sh 2 base .device/var/rs8 -- python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/ab1 --case dit_1_3b --mode fp8_fp8attn_compiled --repeats 3 2>&1 | grep -E "^== |_compiled:|Error|error"
) > $OUT/gpu1.txt 2>&1 &
G1=$!
export CUDA_VISIBLE_DEVICES=0
bench/run_forward_ab.sh 2 base .device/var/rs8 -- python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/ab0 --case dit_5b --mode fp8_fp8attn_compiled --repeats 3 2>&1 | grep -E "^== |_compiled:|Error|error" | tee $OUT/gpu0.txt
wait $G1
cat $OUT/gpu1.txt
kill $CLK
