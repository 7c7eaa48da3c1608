#!/usr/bin/env bash
# The scenario benchmarks on a GPU machine: each argument is one `wan-enhanced bench` run
# ("SCENARIO[,SCENARIO...][:MAX_STEPS]"), in its own process; the tables and event logs are
# copied to OUT_DIR (videos stay behind). BENCH_ARGS adds arguments to every run, e.g.
# BENCH_ARGS="--set WanEnhancedModelLoader.compile=true".
# Usage, from the repository root: bench/run_scenarios_gpu.sh OUT_DIR SPEC...
out=${1:?usage: run_scenarios_gpu.sh OUT_DIR SPEC...}; shift
mkdir -p "$out"
. bench/gpu_env.sh
work=/tmp/bench-out
for spec in "$@"; do
  names=${spec%%:*}; steps=${spec#*:}
  args=()
  for name in ${names//,/ }; do args+=(--scenario "$name"); done
  [[ $spec == *:* ]] && args+=(--max-steps "$steps")
  args+=(${BENCH_ARGS:-})
  python3 -m wan_enhanced.runner.cli bench "${args[@]}" --models /tmp/bench-models --out "$work" \
    2>&1 | grep -v "^\[" | tail -12
done
cp "$work"/*.md "$work"/*.json "$out"/ 2>/dev/null
ls -la "$out"
