# The five calls of this folder, in order (calls 1-3 on machine A, 4-5 on machine B; each call
# chained to the one before on the same warm machine). STORE_EARLY_COPY.py: a copy of
# wan/fp8_attention_hopper.py of f53e008~1 with P stored right after the softmax (what P_EARLY=True
# now does); PARTS_3_x/: pack_triton.sh output for that release.
. bench/gpu_env.sh
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
mkdir -p /tmp/t39parts && cp PARTS_3_9/part_aa /tmp/t39parts/ && ls -la /tmp/t39parts
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_ab.csv &
timeout 400 python3 bench/results/2026-11-26-h100-fp8-three-groups/variants/ab_files.py STORE_EARLY_COPY.py 5b,14b,1_3b 3 $OUT/ab_store_early.json 2>&1 | grep -v Warn
kill %1
# Triton 3.9 (stripped wheel, carried in two parts) beside torch 2.11, for our kernels only
cp PARTS_3_9/part_ab /tmp/t39parts/ && cat /tmp/t39parts/part_aa /tmp/t39parts/part_ab | xz -d | (mkdir -p /tmp/t39site && tar -C /tmp/t39site -xf -)
ls /tmp/t39site
. bench/gpu_env.sh
export PYTHONPATH=/tmp/t39site:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=/tmp/t39cache
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_t39.csv &
timeout 420 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py STORE_EARLY_COPY.py 2>&1 | grep -v Warn | tee $OUT/t39_check.txt | tail -40
kill %1
unset TRITON_CACHE_DIR; export PYTHONPATH=/tmp/pkg:/tmp/site
echo "=== triton 3.6 same script"
timeout 300 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py STORE_EARLY_COPY.py 2>&1 | grep -v Warn | tee $OUT/t36_check.txt | tail -20
ls /tmp/t39site >/dev/null || { echo "machine lost the extracted triton"; exit 3; }
sed -i '/amd/d' /tmp/t39site/triton-3.9.0.dist-info/entry_points.txt; cat /tmp/t39site/triton-3.9.0.dist-info/entry_points.txt
. bench/gpu_env.sh
export PYTHONPATH=/tmp/t39site:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=/tmp/t39cache
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_t39.csv &
timeout 480 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py STORE_EARLY_COPY.py 2>&1 | grep -v Warn | tee $OUT/t39_check.txt | tail -40
kill %1
. bench/gpu_env.sh
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
mkdir -p /tmp/t38parts && cp PARTS_3_8/part_aa /tmp/t38parts/
timeout 300 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_fp8_attention.py 2>&1 | tail -4
cp PARTS_3_8/part_ab /tmp/t38parts/ && cat /tmp/t38parts/part_aa /tmp/t38parts/part_ab | xz -d | (mkdir -p /tmp/t38site && tar -C /tmp/t38site -xf -) || exit 3
. bench/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_t38.csv &
PYTHONPATH=/tmp/t38site:$PYTHONPATH TRITON_CACHE_DIR=/tmp/t38cache timeout 330 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py STORE_EARLY_COPY.py 2>&1 | grep -v -E "Warn|nanobind|leaked" | tee $OUT/t38_check.txt | tail -22
echo "=== triton 3.6, same machine"
timeout 200 python3 bench/results/2026-11-26-h100-triton-releases/release_check.py STORE_EARLY_COPY.py 2>&1 | grep -v Warn | tee $OUT/t36_check.txt | tail -13
kill %1
