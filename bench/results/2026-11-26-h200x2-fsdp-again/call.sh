# 2 x H100: the 14B forward on 1 and 2 GPUs, fsdp off and on ($OUT: the device tool's output folder)
. bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m > $OUT/topology.txt 2>&1
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -4 > $OUT/nvidia-smi.txt
cat $OUT/nvidia-smi.txt
date +%T
timeout 560 python3 bench/multi_gpu.py --out $OUT/run --gpus 1,2 --fsdp both --repeats 2 2>&1 | grep -v Warning | tail -25
date +%T
