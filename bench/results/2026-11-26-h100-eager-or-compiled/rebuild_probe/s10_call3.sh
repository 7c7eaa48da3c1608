. bench/gpu_env.sh
export TRITON_CACHE_DIR=/tmp/tc TORCHINDUCTOR_CACHE_DIR=/tmp/ti
for run in 1 2; do date +%T; timeout 200 python3 .device/rebuild_probe.py compiled 2>&1 | grep -v Warn | tail -6; done
ls /tmp/tc | wc -l; ls /tmp/ti | head
date +%T
