# Call B (same warm machine; carry .device/t39b): Triton 3.9 beside torch 2.11 for our kernels
# only; the two-program (cluster) kernel against the shipped one on the same operands
D=bench/results/2026-11-26-h100-fp8-multicast-triton39
cp .device/t39b/part_ab .device/t39b/part_ac /tmp/t39parts/ || exit 3
mkdir -p /tmp/t39site && cat /tmp/t39parts/part_aa /tmp/t39parts/part_ab /tmp/t39parts/part_ac | xz -d | tar -C /tmp/t39site -xf - || exit 3
. bench/gpu_env.sh
export PYTHONPATH=/tmp/t39site:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=/tmp/t39cache
python3 -c "import triton; print('triton', triton.__version__)"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_mc.csv &
timeout 480 python3 bench/results/2026-11-26-h100-fp8-three-groups/variants/ab_files.py $D/mc_hopper.py 5b,14b,1_3b 3 $OUT/ab_mc.json 2>&1 | grep -v -E "Warn|nanobind|leaked|^ - " | tee $OUT/ab_mc.txt
kill %1
