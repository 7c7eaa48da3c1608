. bench/gpu_env.sh
date +%T
timeout 100 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_norm_codes.py tests/test_dit.py --tb=short 2>&1 | grep -E "^FAILED|passed|failed|Error|assert" | head -10
date +%T
timeout 40 python3 bench/phase_peaks_gpu.py --case dit_5b 2>&1 | grep -E "peak|Error"
date +%T
timeout 90 python3 bench/row_kernels_gpu.py --out $OUT/micro14b --shape 14b --warps 4 16 2>&1 | grep -E "norm|Error" | tail -12
date +%T
