#!/usr/bin/env bash
# One device-machine call: MaxText's own trainer with its presets, its pinned-host offload and
# ours (scripts/bench_maxtext.py), side by side. Logs and results go to $OUT (at most 7 files:
# env.txt, build.log, install.log, bench_maxtext.log and the benchmark's .json/.md/.png).
#
#   bash scripts/device_maxtext.sh [bench_maxtext.py arguments]     # run with carry [".whl"]
#
# Default: `--set minimal` (MaxText full, minimal, minimal_offloaded; ours minimal_offloaded@host
# and @nvme), 10 steps each, each variant in its own process, within LIMIT_S (default 570 s)
# counted from the start of this script: the benchmark stops starting variants that would not
# fit, and writes its files after every variant. `--set qkv` runs the qkv_proj family.
#
# Carry .whl/ (git-ignored through .git/info/exclude):
#   .whl/mx/*.whl      MaxText and the packages it imports that the machine's image lacks
#                      (`pip download --no-deps` of the versions tested on CPU, ~25 MB);
#   .whl/xprof_min.tar.xz  xprof's Python files and the profiler plugin library it loads at
#                      import (tokamax imports xprof when MaxText is imported; 10 MB instead of
#                      the 25 MB wheel);
#   .whl/*.whl         optional: libkvikio-cu13, kvikio-cu13, rapids-logger (kvikio backend).
# Everything else (jax 0.11.2, flax, optax, orbax, transformers, ...) is the machine's own.
set -uo pipefail
export PYTHONUNBUFFERED=1 SSDTRAIN_CUDA_ARCHITECTURES=90
OUT=${OUT:-/tmp/ssdtrain-out}; mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-570}

# --- fail fast: every carried file MaxText needs, before anything is built ---
MX_WHEELS="maxtext qwix aqtp tokamax pydantic pydantic_core annotated_types typing_inspection
  annotated_doc omegaconf antlr4_python3_runtime tensorboardx pathwaysutils fastapi starlette
  uvicorn grain array_record portpicker drjax ml_collections einshape typeguard immutabledict six"
missing=""
for w in $MX_WHEELS; do
  ls .whl/mx/"$w"-*.whl > /dev/null 2>&1 || missing="$missing .whl/mx/$w-*.whl"
done
[ -f .whl/xprof_min.tar.xz ] || missing="$missing .whl/xprof_min.tar.xz"
if [ -n "$missing" ]; then
  echo "device_maxtext: missing:$missing (run with carry [\".whl\"]; see this script's header)" \
    | tee "$OUT/env.txt"
  exit 2
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -m pip uninstall -y -q jax_ssdtrain > /dev/null 2>&1  # a warm machine may hold an install
rm -rf /var/tmp/bench_maxtext /tmp/mx-venv /tmp/pylib /tmp/site
t0=$SECONDS
# kvikio's wheels (optional): importable by CMake's probe and, at run time, by the library.
PYSITE=""
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  PYSITE=/tmp/site
else
  echo "no kvikio wheels in .whl/: POSIX backend only" | tee -a "$OUT/env.txt"
fi
PYTHONPATH="$PYSITE" cmake -S xla_ffi -B build-dev -G Ninja -DSSDTRAIN_CUDA=ON \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -DSSDTRAIN_XLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
  > "$OUT/build.log" 2>&1 && cmake --build build-dev >> "$OUT/build.log" 2>&1 \
  || { echo "device_maxtext: build failed"; tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
# A venv over the machine's packages (its python3 is itself a venv: a .pth makes them visible);
# the carried wheels installed into it come first.
python3 -m venv /tmp/mx-venv
python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
  > "$(/tmp/mx-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/machine.pth"
/tmp/mx-venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/mx/*.whl \
  >> "$OUT/install.log" 2>&1 || { echo "device_maxtext: install failed"; tail -20 "$OUT/install.log"; exit 1; }
mkdir -p /tmp/pylib && tar xJf .whl/xprof_min.tar.xz -C /tmp/pylib \
  || { echo "device_maxtext: .whl/xprof_min.tar.xz does not extract"; exit 1; }
/tmp/mx-venv/bin/python -m pip list >> "$OUT/install.log" 2>&1
echo "MaxText installed in $((SECONDS - t0)) s"
export SSDTRAIN_LIB="$PWD/build-dev/libssdtrain.so" PYTHONPATH="$PWD:/tmp/pylib${PYSITE:+:$PYSITE}"
# Shared by the variants' processes: XLA's GPU autotuning of the same fusions is done once.
# (Setting XLA_FLAGS also keeps MaxText from setting its default HLO dump flags.)
mkdir -p /tmp/xla_autotune_mx
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla_autotune_mx"
/tmp/mx-venv/bin/python -c "import jax, maxtext, jax_ssdtrain.maxtext, jax_ssdtrain._src.native as n
from maxtext.trainers.pre_train import train
print('jax', jax.__version__, jax.devices(), 'maxtext', maxtext.__file__, n.build_info())" \
  > /tmp/mx-import.log 2>&1
rc=$?
grep -v "NO-OP\|^\[transformers\]" /tmp/mx-import.log | tail -15 | tee -a "$OUT/env.txt"
[ $rc = 0 ] || { echo "device_maxtext: MaxText or jax_ssdtrain does not import (above)"; exit 1; }
echo "checked in $((SECONDS - t0)) s; benchmark budget $((LIMIT_S - SECONDS)) s"
/tmp/mx-venv/bin/python scripts/bench_maxtext.py --out "$OUT" --store-dir /var/tmp/bench_maxtext \
  --budget-s $((LIMIT_S - SECONDS)) "$@" 2>&1 | tee "$OUT/bench_maxtext.log"
