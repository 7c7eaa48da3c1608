. bench/gpu_env.sh
date +%T
timeout 120 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_fp8_attention.py tests/test_bf16_attention.py -k "wave or hopper" 2>&1 | tail -2
date +%T
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 330 python3 .device/waves_ab.py $OUT/waves_ab.json 2>&1 | grep -v Warn
date +%T; kill %1
