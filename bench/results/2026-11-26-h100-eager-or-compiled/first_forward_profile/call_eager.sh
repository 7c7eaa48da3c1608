. bench/gpu_env.sh
date +%T
timeout 200 python3 .device/warmup_probe.py $OUT/eager_cold eager 2>&1 | grep -v Warning | grep -E "setup|forward" 
date +%T
timeout 200 python3 .device/warmup_probe.py $OUT/eager_warm eager 2>&1 | grep -v Warning | head -45
date +%T
