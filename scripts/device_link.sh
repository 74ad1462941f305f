#!/usr/bin/env bash
# One device-machine call: the host tier against the PCIe link (issue: move offloaded bytes at
# the speed of the link). Builds the checkout (sm_90, the machine's jaxlib headers), runs the
# GPU engine tests, probes the link and runs bench_rok.py rows with the engine's timeline.
#
#   bash scripts/device_link.sh [STAGE ...]     stages: tests 4096 32k 8192 gpt13 ... (default: tests 4096 32k 8192 gpt13)
#
# Results: $OUT/link.log (the tables), $OUT/results.tgz (JSON, PNG, Chrome traces, logs).
set -uo pipefail
export PYTHONUNBUFFERED=1 SSDTRAIN_CUDA_ARCHITECTURES=90
OUT=${OUT:-/tmp/ssdtrain-out}; mkdir -p "$OUT"
RES=/tmp/link-results; rm -rf "$RES"; mkdir -p "$RES"
STAGES=("$@"); [ ${#STAGES[@]} -eq 0 ] && STAGES=(tests 4096 32k 8192 gpt13)
log() { echo "$@" | tee -a "$OUT/link.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RES/env.txt"
python3 -m pip uninstall -y -q jax_ssdtrain > /dev/null 2>&1  # a warm machine may hold an install
t0=$SECONDS
cmake -S xla_ffi -B build-dev -G Ninja -DSSDTRAIN_CUDA=ON -DPython_EXECUTABLE="$(command -v python3)" \
  -DSSDTRAIN_XLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
  > "$RES/build.log" 2>&1 && cmake --build build-dev >> "$RES/build.log" 2>&1 \
  || { tail -30 "$RES/build.log"; cp "$RES/build.log" "$OUT/"; exit 1; }
log "built in $((SECONDS - t0)) s"
export SSDTRAIN_LIB="$PWD/build-dev/libssdtrain.so" PYTHONPATH="$PWD"
python3 -c "import jax, jax_ssdtrain._src.native as n; print('jax', jax.__version__, jax.devices(), n.build_info())" \
  | tee -a "$RES/env.txt"
rok() {  # rok NAME TIMEOUT_S bench_rok.py args...
  local name=$1 limit=$2; shift 2
  local t=$SECONDS
  timeout "$limit" python3 scripts/bench_rok.py --no-probe --store-dir "/var/tmp/rok_$name" \
    --out "$RES/$name" "$@" > "$RES/rok_$name.log" 2>&1
  log "== $name (rc $?, $((SECONDS - t)) s)"; grep -E "^shape|^[0-9]+,|^link probe|FAIL" "$RES/rok_$name.log" | tee -a "$OUT/link.log"
}
planner() {  # planner NAME STAGING bench_planner.py args...: predicted vs measured, the planner
  local name=$1 staging=$2; shift 2   # sizing the staging arena (at most STAGING)
  local t=$SECONDS
  SSDTRAIN_STAGING=$staging SSDTRAIN_HOST_TIER=32GiB timeout 240 python3 scripts/bench_planner.py \
    --no-cap --store-dir /var/tmp/plan --out "$RES/$name" --stack-policies selective,auto,host_all \
    "$@" > "$RES/$name.log" 2>&1
  log "== $name (rc $?, $((SECONDS - t)) s)"; grep -E "^\[|^\|" "$RES/$name.log" | tee -a "$OUT/link.log"
}
COMMON=(--ssd prefetch_bytes=2560MiB --ssd host_tier_bytes=32GiB --timeline --link-probe --steps 10 --warmup 3)
for stage in "${STAGES[@]}"; do
  case "$stage" in
    tests)
      t=$SECONDS
      timeout 150 python3 -m pytest -q -ra -x -p no:cacheprovider -m gpu tests/test_engine.py \
        > "$RES/tests_engine_gpu.log" 2>&1
      log "== GPU engine tests (rc $?, $((SECONDS - t)) s): $(tail -1 "$RES/tests_engine_gpu.log")" ;;
    4096)
      rok 4096 200 --shape 4096,2048,4,8 --check-budget-s 5 "${COMMON[@]}" --ssd staging_bytes=2560MiB \
        --policies 'selective,ssd_host_named,ssd_host_named:forwarding=off,ssd_host_named:staging_bytes=768MiB' ;;
    32k)
      rok 32k 220 --shape 2048,32768,1,24 --no-check "${COMMON[@]}" --ssd staging_bytes=2560MiB \
        --policies 'selective,ssd_host_named,ssd_host_named:staging_bytes=14GiB' ;;
    8192)  # with the 2.5 GiB arena the step's 2.42 GB never leave the device; 768 MiB makes them
      rok 8192 200 --shape 8192,2048,2,4 --no-check "${COMMON[@]}" --ssd staging_bytes=2560MiB \
        --policies 'recompute,selective,ssd_host_named,ssd_host_named:staging_bytes=768MiB' ;;
    gpt13rok)  # the gpt-1.3b layer stack (H,S,B,L = 2048,1024,8,24) in bench_rok
      rok gpt13rok 200 --shape 2048,1024,8,24 --no-check "${COMMON[@]}" --ssd staging_bytes=4GiB \
        --policies 'keep,selective,ssd_host_named,ssd_host_named:staging_bytes=2GiB' ;;
    planner32k)  # the 32k stack (keep does not fit)
      planner planner32k 16GiB --shape 2048,32768,1,24 --no-presets ;;
    linkload)  # plain pinned copies idle and next to a matmul loop and an HBM-bound loop
      t=$SECONDS
      timeout 120 python3 scripts/bench_link.py --out "$RES/linkload" > "$RES/linkload.log" 2>&1
      log "== linkload (rc $?, $((SECONDS - t)) s)"; grep -E "^\|" "$RES/linkload.log" | tee -a "$OUT/link.log" ;;
    planner8192)  # the 8192 stack: a small arena suffices where the link keeps up
      planner planner8192 2560MiB --shape 8192,2048,2,4 --no-presets ;;
    planner)  # the 4096 stack and the gpt-1.3b preset
      planner planner 8GiB --shape 4096,2048,4,8 --presets gpt-1.3b ;;
    jaxlayer)  # the JAX-facing layer on the GPU backend: higher-order reloads, lifetimes
      t=$SECONDS
      timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/test_jax_layer.py \
        tests/test_lifetimes.py > "$RES/tests_jax_layer_gpu.log" 2>&1
      log "== JAX layer + lifetimes on GPU (rc $?, $((SECONDS - t)) s): $(tail -1 "$RES/tests_jax_layer_gpu.log")" ;;
    reliability)  # faults, verify, on_full, kill -9, concurrency, soak through the CUDA handlers
      t=$SECONDS
      SSDTRAIN_TEST_PLATFORM=cuda timeout 420 python3 -m pytest -q -ra -p no:cacheprovider \
        tests/test_reliability.py > "$RES/tests_reliability_gpu.log" 2>&1
      log "== reliability (rc $?, $((SECONDS - t)) s): $(tail -1 "$RES/tests_reliability_gpu.log")" ;;
    fastarrays)  # a striped RAM store under 28 and 56 GB/s caps, beside raw pwrite/pread of it
      for cap in 28GB/s 56GB/s; do
        t=$SECONDS
        timeout 150 python3 -m jax_ssdtrain.probe /dev/shm/fa --stripes 16 --threads 8,16 \
          --size 8GiB --bandwidth-cap "$cap" --refresh > "$RES/probe_shm_${cap%%GB*}.log" 2>&1
        log "== probe /dev/shm cap $cap (rc $?, $((SECONDS - t)) s)"; tee -a "$OUT/link.log" < "$RES/probe_shm_${cap%%GB*}.log" | head -12
      done
      rm -rf /dev/shm/fa ;;
    gpt13)  # scripts/train.py, gpt-1.3b: keep vs the 4 tags in the host tier
      for run in "keep:--remat-policy keep" \
                 "host6g:--locations layer_in=host,qkv=host,attn=host,mlp_up=host"; do
        name=${run%%:*}; t=$SECONDS
        SSDTRAIN_STAGING=6GiB SSDTRAIN_HOST_TIER=16GiB timeout 200 python3 scripts/train.py \
          --model gpt --preset gpt-1.3b --batch 8 --seq-len 1024 --steps 30 --log-every 30 ${run#*:} \
          --store-dir "/var/tmp/train_$name" > "$RES/train_$name.log" 2>&1
        log "== gpt13 $name (rc $?, $((SECONDS - t)) s): $(grep '^done' "$RES/train_$name.log")"
      done ;;
  esac
  tar czf "$OUT/results.tgz" -C "$RES" .  # after each stage: a call cut short keeps what ran
done
log "total $((SECONDS - t0)) s"
