# GPU tests of the DiT, then eager fp8 + fp8 attention A/B (held codes = base, old = .device/s9old)
. bench/gpu_env.sh
date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider --gpu tests/test_dit.py -x 2>&1 | tail -2
date +%T
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_ab.csv &
timeout 420 bench/run_forward_ab.sh 1 base .device/s9old -- bash -c 'python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out $OUT/ab/$AB_ROUND-${AB_VARIANT//\//_} --case dit_5b dit_1_3b --mode fp8_fp8attn_eager --repeats 3' 2>&1 | grep -E "^==|\| dit|Error|error"
date +%T; kill %1
