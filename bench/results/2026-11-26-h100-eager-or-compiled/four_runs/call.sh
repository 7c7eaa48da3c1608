# the 5B efficiency scenario (fp8 weights, attention auto) four times on one fresh machine, each
# in a process of its own: eager (cold compiler caches), compiled, eager again, compiled again
. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
date +%T
i=0
for c in false true false true; do
  i=$((i+1))
  BENCH_ARGS="--set WanEnhancedModelLoader.weight_dtype=fp8_e4m3fn_fast --set WanEnhancedModelLoader.compile=$c" \
    timeout 200 bench/run_scenarios_gpu.sh $OUT/run$i-compile-$c ti2v_efficiency 2>&1 | grep -E "^ti2v|rror" | head -3
  date +%T
done
kill %1
