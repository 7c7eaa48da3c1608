# Source on a GPU machine from the repository root: makes `wan_enhanced` importable from this
# checkout (a link named after the package) and installs carried wheels (.whl/) if present.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/pkg && ln -sfn "$(pwd)" /tmp/pkg/wan_enhanced
export PYTHONPATH=/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
set +e
