. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_E.csv &
date +%T
BENCH_ARGS="--set WanEnhancedModelLoader.weight_dtype=fp8_e4m3fn_fast --set WanEnhancedModelLoader.compile=false" \
  timeout 560 bench/run_scenarios_gpu.sh $OUT/scenarios ti2v_efficiency t2v_1_3b_baseline:30 2>&1 | grep -vE "^-|^total|^drwx" | tail -16
date +%T; kill %1
