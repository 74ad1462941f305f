#!/usr/bin/env bash
# One device-machine call: install the library, run the GPU tests, optionally the reliability
# suite through the CUDA handlers. Logs go to $OUT.
#
#   bash scripts/device_check.sh [--wheel] [--reliability] [extra pytest args for the GPU part]
#
# --wheel: install the wheel carried in dist/ (python -m build --wheel, built elsewhere) into a
#   fresh venv (--system-site-packages for the machine's jax, --no-deps) and run the tests from
#   a copy of tests/ and models/ outside the checkout, so that jax_ssdtrain is the wheel's.
# Without it: build in place (pip install --no-build-isolation --no-deps -e .), with kvikio
#   when its wheels are carried in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ssdtrain-out}; mkdir -p "$OUT"
WHEEL=0; RELIABILITY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) WHEEL=1; shift ;;
    --reliability) RELIABILITY=1; shift ;;
    *) break ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
ROOT=$(pwd)
if [ "$WHEEL" = 1 ]; then
  python3 -m venv /tmp/ssd-venv
  # The machine's python3 is itself a venv: make its packages (jax, pytest, ...) visible.
  python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$(/tmp/ssd-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/machine.pth"
  /tmp/ssd-venv/bin/python -m pip install -q --no-index --no-deps dist/jax_ssdtrain-*.whl \
    > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  PY=/tmp/ssd-venv/bin/python
  RUN=/tmp/ssd-run; rm -rf "$RUN"; mkdir -p "$RUN"
  cp -r tests models scripts "$RUN"/  # no jax_ssdtrain/: the installed wheel is imported
  cp pyproject.toml "$RUN"/
  cd "$RUN"
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  PY=python3
fi
$PY -c "import jax_ssdtrain, jax_ssdtrain._src.native as n; print(jax_ssdtrain.__file__, n.library_path(), n.build_info())" \
  | tee -a "$OUT/env.txt"
timeout 900 $PY -m pytest -q -ra -s -p no:cacheprovider -m gpu tests "$@" 2>&1 \
  | tee "$OUT/tests_gpu.log" | grep -E "max rel|XLA temp|passed|failed|Error|error" | tail -30
if [ "$RELIABILITY" = 1 ]; then
  # Reliability (faults, verify, on_full, kill -9, concurrency, soak) through the CUDA handlers.
  SSDTRAIN_TEST_PLATFORM=cuda timeout 900 $PY -m pytest -q -ra -p no:cacheprovider \
    tests/test_reliability.py 2>&1 | tee "$OUT/tests_reliability_gpu.log" | tail -15
fi
cd "$ROOT"
