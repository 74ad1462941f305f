#!/usr/bin/env bash
# One device-machine call: build with CUDA (and kvikio when its wheels are carried in .whl/),
# run the suite on JAX's CPU backend (jax 0.11 coverage), the GPU tests and the reliability
# tests through the CUDA handlers. Logs go to $OUT.
#   bash scripts/device_check.sh [extra pytest args for the GPU part]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ssdtrain-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "from jax_ssdtrain._src import native; print(native.build_info())" | tee -a "$OUT/env.txt"
JAX_PLATFORMS=cpu timeout 900 python3 -m pytest -q -ra -p no:cacheprovider \
  tests/test_offload.py tests/test_engine.py tests/test_reliability.py 2>&1 \
  | tee "$OUT/tests_cpu_backend.log" | tail -5
timeout 900 python3 -m pytest -q -ra -s -p no:cacheprovider -m gpu tests "$@" 2>&1 \
  | tee "$OUT/tests_gpu.log" | grep -E "max rel|XLA temp|passed|failed|Error|error" | tail -30
# Reliability (faults, verify, on_full, kill -9, concurrency, soak) through the CUDA handlers.
SSDTRAIN_TEST_PLATFORM=cuda timeout 900 python3 -m pytest -q -ra -p no:cacheprovider \
  tests/test_reliability.py 2>&1 | tee "$OUT/tests_reliability_gpu.log" | tail -15
