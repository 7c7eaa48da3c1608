#!/usr/bin/env bash
# Judge code variants where they serve: one command (a forward benchmark, e.g. bench/peer_comfy.py)
# run once per variant per round, the variants alternating (A B A B ...), each in a process of
# its own on the same machine. A variant is `base` (the checkout as it is) or a folder whose files
# overlay the checkout's (paths relative to the repository root, e.g. VARIANT/wan/glue.py); the
# checkout's own files are put back after every run, also when a run fails or is stopped. Each
# run's output is prefixed with "== ROUND VARIANT"; AB_VARIANT and AB_ROUND are set for it.
# Usage, from the repository root:
#   bench/run_forward_ab.sh ROUNDS VARIANT... -- COMMAND...
# e.g. bench/run_forward_ab.sh 2 base .device/var/new -- python3 bench/peer_comfy.py \
#        --comfyui .device/ComfyUI --out /tmp/ab --case dit_5b --mode fp8_fp8attn_compiled
set -u
rounds=${1:?usage: run_forward_ab.sh ROUNDS VARIANT... -- COMMAND...}; shift
variants=()
while [[ $# -gt 0 && $1 != -- ]]; do variants+=("$1"); shift; done
usage="usage: run_forward_ab.sh ROUNDS VARIANT... -- COMMAND..."
[[ $# -gt 1 && ${#variants[@]} -gt 0 ]] || { echo "$usage" >&2; exit 2; }
shift  # the --
for variant in "${variants[@]}"; do
  [[ $variant == base || -d $variant ]] \
    || { echo "run_forward_ab.sh: no variant folder $variant" >&2; exit 2; }
done
backup=$(mktemp -d)
overlaid=()
restore() {
  for path in "${overlaid[@]}"; do
    if [[ -e $backup/$path ]]; then cp -p "$backup/$path" "$path"; else rm -f "$path"; fi
  done
  overlaid=()
  find "$backup" -mindepth 1 -delete
}
trap 'restore; rm -rf "$backup"' EXIT
trap 'exit 130' INT TERM
status=0
for ((round = 1; round <= rounds; round++)); do
  for variant in "${variants[@]}"; do
    if [[ $variant != base ]]; then
      while IFS= read -r -d '' file; do
        path=${file#"$variant"/}
        if [[ -e $path ]]; then
          mkdir -p "$backup/$(dirname "$path")"; cp -p "$path" "$backup/$path"
        fi
        mkdir -p "$(dirname "$path")"; cp "$file" "$path"
        overlaid+=("$path")
      done < <(find "$variant" -type f -print0)
    fi
    echo "== $round $variant"
    AB_VARIANT=$variant AB_ROUND=$round "$@" || status=1
    restore
  done
done
exit $status
