#!/usr/bin/env bash
# One device-machine call: the ROK rows of BENCHMARKS.md section 2 that the engine split must
# keep (host tier: 4 names; sweep 1: layer input to nvme) for this checkout and for an older
# tree carried in .old8a/ (git archive of the commit before), side by side in one run.
#   bash scripts/device_rok_compare.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 SSDTRAIN_CUDA_ARCHITECTURES=90
OUT=${OUT:-/tmp/ssdtrain-out}; mkdir -p "$OUT"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
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
run new
BENCH=.old8a/scripts/bench_rok.py run old SSDTRAIN_LIB="$PWD/.old8a/build/libssdtrain.so" PYTHONPATH="$PWD/.old8a"
run new2
