# ours against torchao's quantize_ on the same block matrices ($1: the case; $OUT: the device
# tool's output folder); torchao's wheel carried in .device/torchao/
. bench/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tao .device/torchao/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/tao
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1
if [ "$1" = dit_5b ]; then
  python3 -m pytest -q -p no:cacheprovider --gpu tests/test_glue.py -k "fused_ffn_product_is_only_offered" 2>&1 | tail -1
fi
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader -lms 1000 > $OUT/clocks_$1.csv &
date +%T
timeout 540 python3 bench/quant_gpu.py --out $OUT/$1 --case $1 --mode eager compiled --repeats 3 \
  --scheme bf16 fp8_e4m3fn_fast int8_dynamic torchao_float8_rowwise torchao_int8_dynamic 2>&1 \
  | grep -v -i warning | grep -v "^ *warnings.warn" | tail -30
date +%T; kill %1
