# the int8 W8A8 product's epilogue kernel and its FFN chunks: GPU tests, then the forwards
. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_quant.py tests/test_glue.py tests/test_dit.py 2>&1 | tail -2
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
date +%T
timeout 500 python3 bench/quant_gpu.py --out $OUT/run --case dit_5b dit_1_3b --mode eager compiled --repeats 3 \
  --scheme bf16 int8_dynamic 2>&1 | grep -v -i warning | tail -16
date +%T; kill %1
