# A Triton wheel small enough for the GPU machine's carry limit (64 MiB a call): the NVIDIA
# backend only, libtriton stripped of its debug symbols, xz-compressed and split in two parts
# carried by two calls on one warm machine (its /tmp keeps the first part between them).
#   bash pack_triton.sh 3.9.0 OUTDIR     (Python 3.12 wheel, what the H100 machines run)
set -e
version=$1; out=$2; work=$(mktemp -d)
pip download "triton==$version" --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_27_x86_64 -d "$work"
unzip -q "$work"/triton-*.whl -d "$work/x"
rm -rf "$work"/x/triton/backends/amd "$work"/x/triton/backends/nvidia/lib/cupti* \
    "$work"/x/triton/_C/libproton.so "$work"/x/triton/instrumentation "$work"/x/triton/profiler \
    "$work"/x/triton/FileCheck "$work"/x/triton/backends/nvidia/bin/nvdisasm \
    "$work"/x/triton/backends/nvidia/bin/cuobjdump
sed -i '/amd/d' "$work"/x/triton-*.dist-info/entry_points.txt  # backends are found by entry point
strip --strip-unneeded "$work"/x/triton/_C/libtriton.so
mkdir -p "$out"
tar -C "$work/x" -cf - . | xz -6 -T2 | split -b 30500000 - "$out/part_"
# on the GPU machine: cat part_* | xz -d | tar -C /tmp/tsite -xf -; PYTHONPATH=/tmp/tsite:... python3 ...
