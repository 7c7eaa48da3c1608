. bench/gpu_env.sh
nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 50 -i 0 > $OUT/clocks.csv &
CLK=$!
CUDA_VISIBLE_DEVICES=0 python3 .device/var/gapcheck.py dit_5b 2>&1 | grep -v Warning | tail -20 | tee $OUT/gapcheck_5b.txt
kill $CLK
