# One call (H100, Triton 3.6): each block's Q K^T, or its P V, as two products of half the
# width, against the shipped kernel on the same operands, 6 rounds
. bench/gpu_env.sh
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
D=bench/results/2026-11-26-h100-fp8-split-products
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 500 python3 bench/results/2026-11-26-h100-fp8-three-groups/variants/ab_files.py $D/sqk_hopper.py,$D/spv_hopper.py 5b,1_3b,14b 6 $OUT/ab.json 2>&1 | grep -v Warn | tee $OUT/ab.txt
kill %1
