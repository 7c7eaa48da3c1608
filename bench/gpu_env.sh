# Source on a GPU machine from the repository root: makes `wan_enhanced` importable from this
# checkout (a link named after the package) and installs carried wheels (.whl/) if present.
# The wheels must match the machine's Python (cp312 on the H100 machines); when they do not
# install, this says so and goes on: only the diffusers rows need them.
rm -rf /tmp/site  # a fresh install: left-over wheels of an earlier call would shadow these
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl \
    || echo "gpu_env.sh: the wheels in .whl/ did not install on $(python3 -V); diffusers is missing"
fi
mkdir -p /tmp/pkg && ln -sfn "$(pwd)" /tmp/pkg/wan_enhanced
export PYTHONPATH=/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
