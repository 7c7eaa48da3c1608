. bench/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider --gpu tests/test_glue.py tests/test_fp8_attention.py tests/test_dit.py 2>&1 | grep -E "^FAILED|passed|failed" | tail -8
python3 .device/var/glue_ab.py $OUT/glue_ab.json 2>&1 | cut -c1-400
