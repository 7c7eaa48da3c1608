#!/usr/bin/env bash
# The fp8 attention kernel's hardware counters, by Nsight Compute (bench/kernel_counters.py says
# what and why). Usage, from the repository root on a GPU machine whose ncu reads counters:
#   bench/run_kernel_counters.sh OUT_DIR [kernel_counters.py args: --shape 5b --kernel hopper]
# Writes OUT_DIR/counters.ncu-rep (open with ncu-ui or `ncu --import`), the details page as
# text and CSV, and the per-line source counters (stall reasons) as CSV.
out=${1:?usage: run_kernel_counters.sh OUT_DIR [--shape 5b] [--kernel hopper]}; shift
mkdir -p "$out"
. bench/gpu_env.sh
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$ncu" ]; then echo "run_kernel_counters.sh: no ncu here" >&2; exit 2; fi
python3 bench/kernel_counters.py "$@" | tee "$out/events.txt"
"$ncu" --profile-from-start off --kernel-name regex:attention_kernel --launch-count 1 \
  --set full --clock-control none --import-source yes -f -o "$out/counters" \
  python3 bench/kernel_counters.py "$@" > "$out/ncu.log" 2>&1 || { tail -20 "$out/ncu.log"; exit 1; }
"$ncu" --import "$out/counters.ncu-rep" --page details > "$out/details.txt"
"$ncu" --import "$out/counters.ncu-rep" --page details --csv > "$out/details.csv"
"$ncu" --import "$out/counters.ncu-rep" --page source --csv --print-source sass \
  > "$out/source_sass.csv" 2>/dev/null || echo "(no per-line source page in this ncu)"
grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Issued Warp|No Eligible|Warp Cycles Per Issued|Pipe|Stall" \
  "$out/details.txt" | head -60
