#!/usr/bin/env bash
# One device-machine call: the ROK rows of BENCHMARKS.md section 2 that the engine split must
# keep (host tier: 4 names; sweep 1: layer input to nvme) for this checkout and for an older
# tree carried in .old8a/ (git archive of the commit before), side by side in one run.
#   bash scripts/device_rok_compare.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 SSDTRAIN_CUDA_ARCHITECTURES=90
OUT=${OUT:-/tmp/ssdtrain-out}; mkdir -p "$OUT"
python3 -m pip uninstall -y -q jax_ssdtrain > /dev/null 2>&1  # a warm machine may hold an install
# Both trees built the same way and imported from their own directory (no pip install: an
# editable install's import hook would shadow the other tree).
cmake -S xla_ffi -B build-dev -G Ninja -DSSDTRAIN_CUDA=ON -DPython_EXECUTABLE="$(command -v python3)" \
  -DSSDTRAIN_XLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
  > "$OUT/build.log" 2>&1 && cmake --build build-dev >> "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
(cd .old8a && cmake -S xla_ffi -B build -G Ninja -DSSDTRAIN_CUDA=ON -DPython_EXECUTABLE="$(command -v python3)" \
  && cmake --build build) >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
ARGS=(--shape 4096,2048,4,8 --policies selective,ssd_host_named,ssd_nvme_sweep_1
      --ssd staging_bytes=2560MiB --ssd prefetch_bytes=2560MiB --no-probe --check-budget-s 15)
run() {  # run LABEL [env...]
  local label=$1; shift
  env "$@" python3 "${BENCH:-scripts/bench_rok.py}" "${ARGS[@]}" --store-dir "/var/tmp/rok_$label" \
    --out "/tmp/rok/$label" > "$OUT/rok_$label.log" 2>&1
  cp /tmp/rok/"$label"/*.json "$OUT/rok_$label.json" 2>/dev/null
  echo "== $label"; tail -6 "$OUT/rok_$label.log"
}
run new SSDTRAIN_LIB="$PWD/build-dev/libssdtrain.so" PYTHONPATH="$PWD"
BENCH=.old8a/scripts/bench_rok.py run old SSDTRAIN_LIB="$PWD/.old8a/build/libssdtrain.so" PYTHONPATH="$PWD/.old8a"
run new2 SSDTRAIN_LIB="$PWD/build-dev/libssdtrain.so" PYTHONPATH="$PWD"
