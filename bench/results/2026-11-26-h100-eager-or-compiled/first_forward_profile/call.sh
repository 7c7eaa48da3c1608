. bench/gpu_env.sh
date +%T
timeout 250 python3 .device/warmup_probe.py $OUT/cold 2>&1 | grep -v Warning | head -60
date +%T
timeout 250 python3 .device/warmup_probe.py $OUT/warm 2>&1 | grep -v Warning | head -60
date +%T
