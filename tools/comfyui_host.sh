#!/usr/bin/env bash
# A real ComfyUI on the CPU, with this package in its custom_nodes/, for the host tests
# (tests/test_comfyui_host.py) and for trying workflows by hand.
#
# usage (from anywhere):
#   tools/comfyui_host.sh COMFYUI            build the host (once) and load every node once
#   tools/comfyui_host.sh COMFYUI serve [P]  build it and start a server on 127.0.0.1:P (8188)
#
# COMFYUI is a ComfyUI git repository: a URL, a local clone or a bare mirror; REF (the
# environment, optional) a commit or tag of it to check out (the tested releases: 0.3.64 and
# 0.30.0, host.TESTED_COMFYUI). The host is made
# in $COMFYUI_HOME (default: $TMPDIR/comfyui-host-NAME, NAME this repository's folder): a work tree
# of ComfyUI, a virtual environment with PyTorch for the CPU, ComfyUI's requirements and this
# package's dependencies, and this repository linked into custom_nodes/. Then
#   COMFYUI_HOME=... python -m pytest tests/test_comfyui_host.py
# runs the host tests; without COMFYUI_HOME they are skipped.
set -euo pipefail
source=${1:?usage: tools/comfyui_host.sh COMFYUI [check|serve [PORT]]}
mode=${2:-check}
port=${3:-8188}
project=$(cd "$(dirname "$0")/.." && pwd)
name=$(basename "$project")
home=${COMFYUI_HOME:-${TMPDIR:-/tmp}/comfyui-host-$name}
python=${PYTHON:-python3}
mkdir -p "$home"

if [[ ! -f $home/ComfyUI/main.py ]]; then
  git clone -q "$source" "$home/ComfyUI" 2>/dev/null || true
  # a mirror may lack a few large files: check out what is there
  git -C "$home/ComfyUI" checkout -q -f "${REF:-HEAD}" 2>/dev/null \
    || git -C "$home/ComfyUI" checkout -q -f "${REF:-HEAD}" -- . 2>/dev/null || true
  [[ -f $home/ComfyUI/main.py ]] || { echo "no ComfyUI work tree could be made from $source" >&2; exit 2; }
fi

py=$home/venv/bin/python
if [[ ! -x $py ]]; then
  "$python" -m venv "$home/venv"
  "$py" -m pip install -q --upgrade pip
  # PyTorch for the CPU first, with the torchvision and torchaudio ComfyUI imports (newer
  # releases import torchaudio at start-up); PyTorch's own index is tried once, briefly, and
  # without it the default index's builds serve (a CUDA build works as well)
  "$py" -m pip install -q --retries 0 --timeout 15 torch torchvision torchaudio \
    --index-url https://download.pytorch.org/whl/cpu \
    || "$py" -m pip install -q torch torchvision torchaudio
  grep -v -E '^(torch|torchvision|torchaudio)([<>=~ ].*)?$' "$home/ComfyUI/requirements.txt" \
    > "$home/requirements.txt"
  # requests is used by ComfyUI without being listed; pytest runs the host tests
  "$py" -m pip install -q -r "$home/requirements.txt" requests pytest
fi
# A CPU build of PyTorch beside torchvision's default (CUDA) build, which is what an index
# without PyTorch's CPU builds gives, cannot load torchvision's operators ("operator
# torchvision::nms does not exist"): then take a matching default pair from the index.
if ! "$py" -c "import torchvision, torchaudio" >/dev/null 2>&1; then
  "$py" -m pip install -q --upgrade torch torchvision torchaudio
fi
# this package's own dependencies, as a ComfyUI user's install adds them (Python 3.11+)
"$py" - "$project/pyproject.toml" > "$home/project-deps.txt" <<'PY'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.lower().startswith(("torch", "torchvision"))))
PY
"$py" -m pip install -q -r "$home/project-deps.txt"
ln -sfn "$project" "$home/ComfyUI/custom_nodes/$name"

cd "$home/ComfyUI"
case $mode in
  check)
    "$py" main.py --cpu --quick-test-for-ci --disable-all-custom-nodes \
      --whitelist-custom-nodes "$name" 2>&1 | grep -E "IMPORT FAILED|$name|Traceback" || true
    echo "host ready: COMFYUI_HOME=$home" ;;
  serve)
    nohup "$py" main.py --cpu --listen 127.0.0.1 --port "$port" > "$home/server.log" 2>&1 &
    echo "pid $! log $home/server.log url http://127.0.0.1:$port" ;;
  *) echo "unknown mode $mode (check or serve)" >&2; exit 2 ;;
esac
