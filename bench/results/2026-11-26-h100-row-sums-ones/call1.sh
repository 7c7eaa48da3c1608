# Call 1 (H100): the row-sum product alone, then the two variants against the shipped kernel
. bench/gpu_env.sh
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
D=bench/results/2026-11-26-h100-row-sums-ones
python3 $D/rowsum_micro.py 2>&1 | grep -v Warn
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_ab.csv &
timeout 520 python3 bench/results/2026-11-26-h100-fp8-three-groups/variants/ab_files.py $D/ones8_hopper.py,$D/ones16_hopper.py 5b,14b,1_3b 3 $OUT/ab.json 2>&1 | grep -v Warn | tee $OUT/ab.txt
kill %1
