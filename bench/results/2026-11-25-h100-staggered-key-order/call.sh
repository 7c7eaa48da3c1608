. bench/gpu_env.sh
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
date +%T
timeout 400 python3 .device/kab.py base,stag4,stag16 5b,1_3b,14b 4 $OUT/kab_stagger.json 2>&1 | grep -v Warning
date +%T
