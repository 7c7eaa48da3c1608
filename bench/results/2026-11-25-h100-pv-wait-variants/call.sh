. bench/gpu_env.sh
nvidia-smi --query-gpu=name,power.limit,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 500 > $OUT/clocks_A.csv &
date +%T
timeout 420 python3 .device/kab.py base,latewait,psmem,pl3,psmem_late 5b,1_3b,14b 3 $OUT/kab_wait.json 2>&1 | grep -v Warning
date +%T; kill %1
