# Call C (same warm machine, right after call B): six more rounds of the same A/B
ls /tmp/t39site >/dev/null || { echo lost; exit 3; }
. bench/gpu_env.sh
export PYTHONPATH=/tmp/t39site:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=/tmp/t39cache
D=bench/results/2026-11-26-h100-fp8-multicast-triton39
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_mc2.csv &
timeout 400 python3 bench/results/2026-11-26-h100-fp8-three-groups/variants/ab_files.py $D/mc_hopper.py 5b,1_3b,14b 6 $OUT/ab_mc_run2.json 2>&1 | grep -v -E "Warn|nanobind|leaked|^ - |check|vs base" | tee $OUT/ab_mc_run2.txt
kill %1
