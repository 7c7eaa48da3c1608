. bench/gpu_env.sh
nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 250 > $OUT/clocks.csv &
date +%T
timeout 400 python3 .device/kab.py base,noV,noKV,noexp,base 5b,1_3b 4 $OUT/kab_diag.json 2>&1 | grep -v Warning | grep -v "equal_portable"
date +%T; kill %1
