# Calls 6-13 (machine C: round_a 39 5b,14b,1_3b; round_b 39; round_a 38; round_b 38 -- machine D:
# round_a2 39; round_b2 39 -- machine E: round_a3 37; round_b2 37), each chained to the one before; PARTS/: pack_triton.sh output.
# first call of a release round: park part_aa of release $1 in /tmp; the variants on Triton 3.6
mkdir -p /tmp/parts$1 && cp PARTS/part_aa /tmp/parts$1/ && ls -la /tmp/parts$1
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
. bench/gpu_env.sh
[ -n "$2" ] && timeout 400 python3 bench/results/2026-11-26-h100-triton-releases/variants.py $2 2>&1 | grep -v Warn | tee $OUT/variants_36.txt
# second call: part_ab, unpack Triton $1, then our kernels and GPU tests under it
cp PARTS/part_ab /tmp/parts$1/ && cat /tmp/parts$1/part_aa /tmp/parts$1/part_ab | xz -d | (mkdir -p /tmp/site$1 && tar -C /tmp/site$1 -xf -) || exit 3
sed -i '/amd/d' /tmp/site$1/triton-*.dist-info/entry_points.txt
. bench/gpu_env.sh
export PYTHONPATH=/tmp/site$1:$PYTHONPATH TRITON_CACHE_DIR=/tmp/cache$1 TRITON_DEFAULT_FP_FUSION=1
python3 -c "import triton; print('triton', triton.__version__)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 300 python3 bench/results/2026-11-26-h100-triton-releases/variants.py 5b,14b,1_3b 2>&1 | grep -v -E "Warn|nanobind|leaked|^ - " | tee $OUT/variants_$1.txt | tail -20
timeout 250 python3 -m pytest -q -p no:cacheprovider --gpu -rf tests/test_fp8_attention.py tests/test_bf16_attention.py tests/test_norm_codes.py tests/test_glue.py tests/test_quant.py tests/test_lora_layers.py tests/test_lora_fp8_sum.py 2>&1 | grep -v -E "nanobind|leaked|^ - " | tee $OUT/gpu_tests.txt | grep -E "^FAILED|^ERROR|passed|failed" | cut -c1-300 | tail -40
kill %1
# park part_aa of Triton $1 in /tmp; meanwhile the GPU tests on this machine's Triton 3.6
mkdir -p /tmp/parts$1 && cp PARTS/part_aa /tmp/parts$1/ && ls -la /tmp/parts$1 | tail -1
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
. bench/gpu_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
timeout 330 python3 -m pytest -q -p no:cacheprovider --gpu -rf tests/test_fp8_attention.py tests/test_bf16_attention.py tests/test_norm_codes.py tests/test_glue.py tests/test_quant.py tests/test_lora_layers.py tests/test_lora_fp8_sum.py 2>&1 | tee $OUT/gpu_tests_36.txt | grep -E "^FAILED|^ERROR|passed|failed" | cut -c1-300 | tail -20
# part_ab, unpack Triton $1; the shipped kernels and the GPU tests under it
cp PARTS/part_ab /tmp/parts$1/ && cat /tmp/parts$1/part_aa /tmp/parts$1/part_ab | xz -d | (mkdir -p /tmp/site$1 && tar -C /tmp/site$1 -xf -) || exit 3
sed -i '/amd/d' /tmp/site$1/triton-*.dist-info/entry_points.txt
. bench/gpu_env.sh
export PYTHONPATH=/tmp/site$1:$PYTHONPATH TRITON_CACHE_DIR=/tmp/cache$1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks.csv &
timeout 250 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py 2>&1 | grep -v -E "Warn|nanobind|leaked|^ - " | tee $OUT/release_check_$1.txt | tail -16
# (the two offline-build tests need cuobjdump, which the packed wheel leaves out)
timeout 300 python3 -m pytest -q -p no:cacheprovider --gpu -rf -k "not compiles_for_sm90" tests/test_fp8_attention.py tests/test_bf16_attention.py tests/test_norm_codes.py tests/test_glue.py tests/test_quant.py tests/test_lora_layers.py tests/test_lora_fp8_sum.py 2>&1 | grep -v -E "nanobind|leaked|^ - " | tee $OUT/gpu_tests_$1.txt | grep -E "^FAILED|^ERROR|passed|failed" | cut -c1-300 | tail -20
kill %1
# park part_aa of Triton $1 in /tmp; meanwhile the kernels alone on this machine's Triton 3.6
mkdir -p /tmp/parts$1 && cp PARTS/part_aa /tmp/parts$1/ && ls -la /tmp/parts$1 | tail -1
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
. bench/gpu_env.sh
timeout 250 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py 2>&1 | grep -v Warn | tee $OUT/release_check_36.txt | tail -10
