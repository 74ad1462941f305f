#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md: builds this checkout for the GPU, then runs the stages named
# on the command line in order, each writing its log and results under OUT.
#
#   bash scripts/gpu.sh [--out DIR] STAGE [STAGE ...]      (from the repository root)
#
# OUT: --out, else $OUT, else /tmp/jax_ssdtrain-gpu. $OUT/summary.log gets one line per stage.
# Each stage has its own time limit (below); long stages take a call of ~10 minutes each.
# `maxtext` stops starting variants LIMIT_S (default 570) seconds after this script started.
#
# Stages (results page section in brackets):
#   tests        the GPU test suite: pytest -m gpu tests                           [Tests]
#   tests4       the multi-device tests on 4 GPUs: pytest -m gpu of test_multidevice,
#                test_optimizer and test_multihost (their 2-GPU tests on the first 2 of the 4,
#                the 4-GPU ones on all; needs 4 GPUs)                                 [Tests]
#   reliability  tests/test_reliability.py through the CUDA handlers               [Tests]
#   jaxlayer     tests/test_jax_layer.py and tests/test_lifetimes.py on the GPU     [Tests]
#   lifetimes    tests/test_lifetimes.py alone (sweeps on the GPU: a quick check)   [Tests]
#   streamtests  the layer stream's and the engine's tests, slow ones included     [Tests]
#   rok          bench_rok, 4096,2048,4,8, every policy                             [rok]
#   rok8192      bench_rok, 8192,2048,2,4, JAX's policies and the host tier         [rok]
#   hostrows     bench_rok, 4096 and 8192 stacks: selective vs the 4 tags in the host tier
#                (the quick check that an engine change keeps the host tier's speed) [rok]
#   hosttier     bench_rok with the link probe and timeline: 32k and 8192 stacks    [host_tier]
#   link         bench_link: plain pinned copies idle and next to running kernels   [link]
#   planner      bench_planner, 4096 stack and gpt-1.3b, host tier                  [planner]
#   planner32k   bench_planner, 2048,32768,1,24 stack                               [planner]
#   planner8192  bench_planner, 8192 stack                                          [planner]
#   plannernvme  bench_planner, 4096 and 8192 stacks, keep/selective/auto/auto_nvme [planner_nvme]
#   cap          bench_planner under device-memory caps, 512,1024,_,96 stack        [planner_cap]
#   emulated     bench_emulated: RAM store capped at 7, 14, 28 GB/s                 [emulated]
#   train        scripts.train, gpt-1.3b: keep vs the 4 tags in the host tier       [train]
#   maxtext      bench_maxtext: MaxText's trainer, its presets and ours (carry .whl/) [maxtext]
#   multigpu     bench_multigpu: 1 vs 2 GPUs, DP and FSDP (needs 2 GPUs)            [multigpu]
#   multigpu4    bench_multigpu --gpus 4: 1 vs 4 GPUs, DP and FSDP (needs 4 GPUs)   [multigpu]
#   multigpu124  bench_multigpu --gpus 1,2,4, gpt-1.3b: layer inputs and AdamW's state in the
#                host tier vs remat (both on the device), DP and FSDP, the collectives'
#                arithmetic; 1, then 4, then 2 within LIMIT_S (needs 4 GPUs)    [multigpu]
#   multihost    tests/test_multihost.py: 2 processes x 1 GPU vs 1 x 2 (needs 2 GPUs) [Tests]
#   optimizer    tests/test_optimizer.py on the GPU, then bench_optimizer (one GPU)  [optimizer]
#   optimizerbench  bench_optimizer alone (one GPU); both write the host and nvme rows' last
#                step of GPU copies as a Chrome trace (--timeline)                  [optimizer]
#   optimizer2   the state sharded over 2 GPUs: its -m gpu test, bench_optimizer --devices 2
#                (needs 2 GPUs)                                                      [optimizer]
#   optimizer4   the same over 4 GPUs: the -m gpu tests (2 and 4 GPUs), bench_optimizer
#                --devices 4 (needs 4 GPUs)                                          [optimizer]
#   checkpoint   bench_checkpoint: Adam's state saved and restored, streamed vs staged, against
#                the checkpoint directory's raw write and read rates (one GPU)       [checkpoint]
#   accumulate   bench_accumulate, gpt-1.3b, accumulation 1/4/16 (one GPU)          [accumulate]
#   fit          bench_fit: the largest GPT JAX alone trains against ours (FIT_ARGS)  [fit]
#   fitnode      bench_fit --mesh dp=4,fsdp: gpt-34b, master weights and AdamW in the host tier
#                (420 GiB), the 4 tags of 8 sequences kept on the devices, 16 micro-batches a step,
#                against its ideal of 2 and 4 layers; XLA may take 92% of each GPU (needs 4 GPUs;
#                ~8 minutes)                                                         [fit_node]
#   fitnodejax   the same arithmetic by JAX alone (the state on the devices, each layer
#                recomputed): gpt-30b, then gpt-20b (needs 4 GPUs)                   [fit_node]
#   longctx      bench_long_context on one GPU: the Llama model's training step at long sequences,
#                per policy (JAX's remat and pinned-host offload, the layer inputs in our host tier
#                and files), AdamW on the device or in the host tier, against the ideal of 2 and 4
#                layers; LC_ARGS: its arguments (preset, --seq, --policies, --find-longest, ...):
#                one call's worth each                                           [long_context]
#   layerstream  bench_layer_stream on one GPU: gpt-13b, parameters and gradients streamed from
#                the host tier (in place, 10 steps), against the ideal of 2 and 4 layers; LS_ARGS:
#                more arguments (e.g. --micro-batches 8), LS13_TIER: its host tier (300GiB)
#                                                                               [layer_stream]
#   layerstream30  the same for gpt-30b (a call of its own): the host tier (LS30_TIER, 455GiB
#                of a 503 GiB machine: 450 GiB in place) spilling to the files, a bfloat16 sum,
#                3 steps                                                         [layer_stream]
#   maxtextfsdp  bench_maxtext --fsdp 2: MaxText's policies and ours over 2 GPUs
#                (needs 2 GPUs; carry .whl/ as for maxtext)                          [maxtext_fsdp]
#   maxtextfsdpqkv  the same for the query/key/value projections (their nvme variant moves a
#                third of the bytes of minimal's, which do not fit one call on one disk) [maxtext_fsdp]
#   maxtextfsdp4  bench_maxtext --fsdp 4: MaxText's trainer with FSDP over the 4 GPUs of a node,
#                its remat policies and its pinned-host offload against our host tier
#                (needs 4 GPUs; carry .whl/ as for maxtext)                        [maxtext_fsdp]
#
# What must be carried to the GPU machine besides the checkout (git-ignored, e.g. in .whl/):
#   .whl/*.whl            optional: libkvikio-cu13, kvikio-cu13, rapids-logger wheels: the build
#                         then links kvikio (used when GPUDirect Storage is active); without
#                         them the engine's POSIX backend is built, which is what the results ran.
#   .whl/mx/*.whl         for `maxtext`: MaxText and the packages it imports that the machine
#                         lacks (`pip download --no-deps`, ~25 MB; list in MX_WHEELS below);
#   .whl/xprof_min.tar.xz for `maxtext`: xprof's Python files and its profiler plugin library
#                         (tokamax imports xprof when MaxText is imported), with fire and
#                         termcolor, which xprof imports.
#   shared/tools/storage_probe.py  optional, for `rok`: the raw O_DIRECT probe of the store
#                         directory behind the "x probe" column (skipped when absent).
# Everything else (jax, flax, optax, orbax, cmake, ninja, nvcc) is the machine's own.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 SSDTRAIN_CUDA_ARCHITECTURES=${SSDTRAIN_CUDA_ARCHITECTURES:-90}
OUT=${OUT:-/tmp/jax_ssdtrain-gpu}
LIMIT_S=${LIMIT_S:-570}
if [ "${1:-}" = "--out" ]; then OUT=$2; shift 2; fi
STAGES=("$@")
KNOWN=(tests tests4 reliability jaxlayer lifetimes streamtests rok rok8192 hostrows hosttier link
  planner planner32k planner8192 plannernvme cap emulated train maxtext multigpu multigpu4 multigpu124
  multihost optimizer optimizerbench optimizer2 optimizer4 checkpoint accumulate fit fitnode
  fitnodejax longctx layerstream layerstream30 maxtextfsdp maxtextfsdpqkv maxtextfsdp4)
if [ ${#STAGES[@]} -eq 0 ]; then
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d'
  exit 2
fi
for stage in "${STAGES[@]}"; do
  [[ " ${KNOWN[*]} " == *" $stage "* ]] \
    || { echo "gpu.sh: unknown stage '$stage' (bash scripts/gpu.sh for the list)" >&2; exit 2; }
done
mkdir -p "$OUT"
PY=${PYTHON:-python3}
log() { echo "$@" | tee -a "$OUT/summary.log"; }

# --- build: the checkout's CUDA handlers against the machine's jaxlib; no pip install (a warm
# machine may hold an older install: removed so that this checkout is imported) ---
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
$PY -m pip uninstall -y -q jax_ssdtrain > /dev/null 2>&1
SITE=""
if ls .whl/*.whl > /dev/null 2>&1; then  # kvikio's wheels: importable by CMake's probe and at run time
  SITE=/tmp/jax_ssdtrain-site
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
fi
t0=$SECONDS
PYTHONPATH="$SITE" cmake -S xla_ffi -B build-gpu -G Ninja -DSSDTRAIN_CUDA=ON \
  -DPython_EXECUTABLE="$(command -v "$PY")" \
  -DSSDTRAIN_XLA_FFI_INCLUDE_DIR="$($PY -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
  > "$OUT/build.log" 2>&1 && cmake --build build-gpu >> "$OUT/build.log" 2>&1 \
  || { echo "gpu.sh: build failed"; tail -30 "$OUT/build.log"; exit 1; }
export SSDTRAIN_LIB="$PWD/build-gpu/libssdtrain.so" PYTHONPATH="$PWD${SITE:+:$SITE}"
$PY -c "import jax, jax_ssdtrain._src.native as n; print('jax', jax.__version__, jax.devices(), n.build_info())" \
  | tee -a "$OUT/env.txt"
log "built in $((SECONDS - t0)) s"

# run NAME LIMIT_S COMMAND...: COMMAND's output in OUT/NAME.log, a summary line
run() {
  local name=$1 limit=$2; shift 2
  local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  log "== $name (rc $?, $((SECONDS - t)) s): $(tail -1 "$OUT/$name.log")"
}
# gpus N STAGE: whether this machine has N GPUs (else the stage is logged as not run)
gpus() {
  local have
  have=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
  [ "$have" -ge "$1" ] && return 0
  log "== $2: not run, needs $1 GPUs, this machine has $have"
  return 1
}
ROK=(--steps 10 --warmup 3)
LINK=(--ssd prefetch_bytes=2560MiB --ssd host_tier_bytes=32GiB --timeline --link-probe --no-probe)
planner() {  # planner NAME STAGING bench_planner args...: predicted vs measured, host tier
  local name=$1 staging=$2; shift 2
  SSDTRAIN_STAGING=$staging SSDTRAIN_HOST_TIER=32GiB run "$name" 280 $PY -m scripts.bench_planner \
    --no-cap --store-dir /var/tmp/plan --stack-policies selective,auto,host_all \
    --out "$OUT/$name" "$@"
}

# maxtext_fsdp NAME VARIANTS [N]: bench_maxtext --fsdp N (default 2) over N GPUs, within LIMIT_S
maxtext_fsdp() {
  maxtext_venv || return 0
  PYTHONPATH="$PYTHONPATH:/tmp/mx-pylib" \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla_autotune_mx" \
    run "$1" $((LIMIT_S - SECONDS)) /tmp/mx-venv/bin/python -m scripts.bench_maxtext \
    --fsdp "${3:-2}" --out "$OUT/$1" --store-dir /var/tmp/bench_maxtext_fsdp \
    --budget-s $((LIMIT_S - SECONDS - 20)) --ssd staging_bytes=4GiB --ssd host_tier_bytes=24GiB \
    --variants "$2"
}

# maxtext_venv: MaxText's venv over the machine's packages, from the carried wheels (1: missing)
maxtext_venv() {
  MX_WHEELS="maxtext qwix aqtp tokamax pydantic pydantic_core annotated_types typing_inspection
    annotated_doc omegaconf antlr4_python3_runtime tensorboardx pathwaysutils fastapi
    starlette uvicorn grain array_record portpicker drjax ml_collections einshape typeguard
    immutabledict six opentelemetry_api typing_extensions"
  missing=""
  for w in $MX_WHEELS; do
    ls .whl/mx/"$w"-*.whl > /dev/null 2>&1 || missing="$missing .whl/mx/$w-*.whl"
  done
  [ -f .whl/xprof_min.tar.xz ] || missing="$missing .whl/xprof_min.tar.xz"
  if [ -n "$missing" ]; then
    log "== maxtext: not run, missing:$missing (carry .whl/, see this script's header)"
    return 1
  fi
  # a venv over the machine's packages (its python3 is itself a venv: a .pth makes them
  # visible), the carried wheels installed into it first
  rm -rf /tmp/mx-venv /tmp/mx-pylib
  $PY -m venv /tmp/mx-venv
  $PY -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$(/tmp/mx-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/machine.pth"
  /tmp/mx-venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/mx/*.whl \
    >> "$OUT/install.log" 2>&1 || { log "== maxtext: install failed (install.log)"; return 1; }
  mkdir -p /tmp/mx-pylib && tar xJf .whl/xprof_min.tar.xz -C /tmp/mx-pylib \
    || { log "== maxtext: .whl/xprof_min.tar.xz does not extract"; return 1; }
}

for stage in "${STAGES[@]}"; do
  case "$stage" in
    tests)
      run tests 900 $PY -m pytest -q -ra -s -p no:cacheprovider -m gpu tests ;;
    tests4)
      gpus 4 tests4 || continue
      run tests4 600 $PY -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_multidevice.py \
        tests/test_optimizer.py tests/test_multihost.py ;;
    reliability)
      SSDTRAIN_TEST_PLATFORM=cuda run reliability 900 $PY -m pytest -q -ra -p no:cacheprovider \
        tests/test_reliability.py ;;
    jaxlayer)
      run jaxlayer 400 $PY -m pytest -q -ra -p no:cacheprovider tests/test_jax_layer.py \
        tests/test_lifetimes.py ;;
    lifetimes)
      run lifetimes 300 $PY -m pytest -q -ra -p no:cacheprovider tests/test_lifetimes.py ;;
    streamtests)
      run streamtests 400 $PY -m pytest -q -ra -p no:cacheprovider -m "slow or not slow" \
        tests/test_layer_stream.py tests/test_layer_stream_checkpoint.py tests/test_engine.py ;;
    rok)
      run rok 900 $PY -m scripts.bench_rok --shape 4096,2048,4,8 "${ROK[@]}" \
        --policies 'keep,recompute,selective,jax_host_layer_in,jax_host_named,ssd_host_named,ssd_nvme_layer_in,ssd_nvme_sweep_*' \
        --check-budget-s 40 --ssd staging_bytes=2560MiB --ssd prefetch_bytes=2560MiB \
        --store-dir /var/tmp/rok --out "$OUT/rok" ;;
    rok8192)
      run rok8192 600 $PY -m scripts.bench_rok --shape 8192,2048,2,4 "${ROK[@]}" \
        --policies keep,recompute,selective,jax_host_named,ssd_host_named --check-budget-s 20 \
        --ssd staging_bytes=2560MiB --ssd prefetch_bytes=2560MiB --no-probe \
        --store-dir /var/tmp/rok --out "$OUT/rok8192" ;;
    hostrows)
      for shape in 4096,2048,4,8 8192,2048,2,4; do
        run "hostrows_${shape%%,*}" 240 $PY -m scripts.bench_rok --shape "$shape" "${ROK[@]}" \
          --policies selective,ssd_host_named --no-check --no-probe --ssd staging_bytes=2560MiB \
          --ssd prefetch_bytes=2560MiB --store-dir /var/tmp/rok --out "$OUT/hostrows_${shape%%,*}"
      done ;;
    hosttier)  # 2.5 GiB of staging against 14 GiB (32k) and 768 MiB (8192); then one table
      run hosttier_32k 280 $PY -m scripts.bench_rok --shape 2048,32768,1,24 --no-check "${ROK[@]}" \
        "${LINK[@]}" --ssd staging_bytes=2560MiB --store-dir /var/tmp/rok_32k \
        --policies 'selective,ssd_host_named,ssd_host_named:staging_bytes=14GiB' \
        --out "$OUT/hosttier_32k"
      run hosttier_8192 240 $PY -m scripts.bench_rok --shape 8192,2048,2,4 --no-check "${ROK[@]}" \
        "${LINK[@]}" --ssd staging_bytes=2560MiB --store-dir /var/tmp/rok_8192 \
        --policies 'recompute,selective,ssd_host_named,ssd_host_named:staging_bytes=768MiB' \
        --out "$OUT/hosttier_8192"
      # shellcheck disable=SC2046  # one JSON per run, no spaces in the names
      run hosttier 60 $PY -m scripts.bench_rok --out "$OUT/hosttier" --replot \
        $(ls "$OUT"/hosttier_32k/rok_*.json "$OUT"/hosttier_8192/rok_*.json | grep -v /rok_timeline_) ;;
    link)
      run link 180 $PY -m scripts.bench_link --out "$OUT/link" ;;
    planner)
      planner planner 8GiB --shape 4096,2048,4,8 --presets gpt-1.3b ;;
    planner32k)  # keep does not fit this stack on an 80 GB GPU
      planner planner32k 16GiB --shape 2048,32768,1,24 --no-presets ;;
    planner8192)
      planner planner8192 2560MiB --shape 8192,2048,2,4 --no-presets ;;
    plannernvme)
      run plannernvme 600 $PY -m scripts.bench_planner --store-dir /var/tmp/plan --no-presets \
        --no-cap --out "$OUT/plannernvme" ;;
    cap)
      SSDTRAIN_STAGING=64MiB SSDTRAIN_HOST_TIER=16GiB run cap 600 $PY -m scripts.bench_planner \
        --no-stack --no-presets --store-dir /var/tmp/plan --cap-shape 512,1024,1,96 \
        --cap-batches 1,2,4,8,16,32 --cap-gb 3.5 --cap-at recompute \
        --cap-policies keep,recompute,selective,jax_host_layer_in,ssd_host_layer_in \
        --steps 10 --warmup 2 --out "$OUT/cap" ;;
    emulated)
      run emulated 300 $PY -m scripts.bench_emulated --caps 7,14,28 --points 2,3,4 --no-disk \
        --budget-s 240 --out "$OUT/emulated" ;;
    train)  # the same command with two placements; each writes its summary as JSON
      for placement in "keep:--remat-policy keep" \
                       "host:--locations layer_in=host,qkv=host,attn=host,mlp_up=host"; do
        name=${placement%%:*}
        # shellcheck disable=SC2086  # the placement's flags split on purpose
        SSDTRAIN_STAGING=6GiB SSDTRAIN_HOST_TIER=16GiB run "train_$name" 240 $PY -m scripts.train \
          --model gpt --preset gpt-1.3b --batch 8 --seq-len 1024 --steps 30 --log-every 30 \
          ${placement#*:} --store-dir "/var/tmp/train_$name" --summary-json "$OUT/train_$name.json"
      done ;;
    maxtext)
      maxtext_venv || continue
      # XLA's autotuning of the same fusions shared by the variants' processes (setting
      # XLA_FLAGS also keeps MaxText from setting its HLO dump flags)
      PYTHONPATH="$PYTHONPATH:/tmp/mx-pylib" \
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla_autotune_mx" \
        run maxtext $((LIMIT_S - SECONDS)) /tmp/mx-venv/bin/python -m scripts.bench_maxtext \
        --out "$OUT/maxtext" --store-dir /var/tmp/bench_maxtext --budget-s $((LIMIT_S - SECONDS - 20)) \
        --ssd staging_bytes=4GiB --ssd host_tier_bytes=16GiB --variants \
        "minimal,minimal_offloaded@host:staging_bytes=2GiB,minimal_offloaded@host:staging_bytes=1GiB,minimal_offloaded,save_qkv_proj,qkv_proj_offloaded,qkv_proj_offloaded@host:staging_bytes=1GiB,qkv_proj_offloaded@host,minimal_offloaded@host:staging_bytes=3GiB,minimal_offloaded@host,full" ;;
    multigpu)
      run multigpu 600 $PY -m scripts.bench_multigpu --policies offload,offload_host,remat --batch-per-gpu 32 \
        --out "$OUT/multigpu" ;;
    multigpu4)
      gpus 4 multigpu4 || continue
      run multigpu4 600 $PY -m scripts.bench_multigpu --gpus 4 --policies offload,offload_host,remat \
        --batch-per-gpu 32 --out "$OUT/multigpu4" ;;
    multigpu124)  # 10 configurations; the host tier holds DP's 4 replicas of the 10.5 GB state
      gpus 4 multigpu124 || continue
      run multigpu124 $((LIMIT_S - SECONDS)) $PY -m scripts.bench_multigpu --gpus 1,2,4 \
        --preset gpt-1.3b --policies offload_host,remat --batch-per-gpu 16 --host-tier 128GiB \
        --budget-s $((LIMIT_S - SECONDS - 15)) --out "$OUT/multigpu124" ;;
    multihost)
      run multihost 300 $PY -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_multihost.py ;;
    optimizer)
      run optimizer_tests 300 $PY -m pytest -q -ra -p no:cacheprovider tests/test_optimizer.py
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run optimizer 300 $PY -m scripts.bench_optimizer \
        --store-dir /var/tmp/opt --timeline --out "$OUT/optimizer" ;;
    optimizerbench)
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run optimizer 300 $PY -m scripts.bench_optimizer \
        --store-dir /var/tmp/opt --timeline --out "$OUT/optimizer" ;;
    optimizer2)
      run optimizer2_tests 300 $PY -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_optimizer.py
      run optimizer2 300 $PY -m scripts.bench_optimizer --devices 2 --store-dir /var/tmp/opt2 \
        --out "$OUT/optimizer2" ;;
    optimizer4)
      gpus 4 optimizer4 || continue
      run optimizer4_tests 300 $PY -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_optimizer.py
      run optimizer4 300 $PY -m scripts.bench_optimizer --devices 4 --store-dir /var/tmp/opt4 \
        --out "$OUT/optimizer4" ;;
    checkpoint)
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run checkpoint 300 $PY -m scripts.bench_checkpoint \
        --ckpt-dir /var/tmp/ckpt --store-dir /var/tmp/ckpt-store --out "$OUT/checkpoint" ;;
    accumulate)
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run accumulate 500 $PY -m scripts.bench_accumulate \
        --preset gpt-1.3b --accum 1,4,16 --store-dir /var/tmp/acc --out "$OUT/accumulate" ;;
    fit)  # FIT_ARGS: bench_fit's arguments (presets, ways, store sizes): one call's worth each
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run fit $((LIMIT_S - SECONDS)) \
        $PY -m scripts.bench_fit --store-dir /var/tmp/fit --out "$OUT/fit" ${FIT_ARGS:-} ;;
    fitnode)
      gpus 4 fitnode || continue
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 run fitnode $((LIMIT_S - SECONDS)) $PY -m scripts.bench_fit \
        --mesh dp=4,fsdp --batch 8 --accum 16 --accum-dtype bfloat16 --steps 4 --presets gpt-34b \
        --ways ours_master_inplace_keep --ideal --ideal-layers 2,4 --timeout $((LIMIT_S - SECONDS - 30)) \
        --store-dir /var/tmp/fitnode --ssd SSDTRAIN_HOST_TIER=420GiB --out "$OUT/fitnode" ;;
    fitnodejax)
      gpus 4 fitnodejax || continue
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 run fitnodejax $((LIMIT_S - SECONDS)) $PY -m scripts.bench_fit \
        --mesh dp=4,fsdp --batch 8 --accum 16 --accum-dtype bfloat16 --steps 4 \
        --presets gpt-30b,gpt-20b --ways jax_master_remat --timeout $((LIMIT_S - SECONDS - 30)) \
        --out "$OUT/fitnodejax" ;;
    longctx)  # LC_ARGS: bench_long_context's arguments; the rows end within LIMIT_S
      # shellcheck disable=SC2086  # LC_ARGS splits on purpose
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run longctx $((LIMIT_S - SECONDS)) \
        $PY -m scripts.bench_long_context --store-dir /var/tmp/longctx \
        --budget-s $((LIMIT_S - SECONDS - 20)) --out "$OUT/longctx" ${LC_ARGS:-} ;;
    layerstream)  # LS_ARGS: more bench_layer_stream arguments; the store on the local disk
      # shellcheck disable=SC2086  # LS_ARGS splits on purpose
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run layerstream $((LIMIT_S - SECONDS)) \
        $PY -m scripts.bench_layer_stream --preset gpt-13b --location host --in-place --steps 10 \
        --ssd "SSDTRAIN_HOST_TIER=${LS13_TIER:-300GiB}" --store-dir /var/tmp/ls13 \
        --timeout $((LIMIT_S - SECONDS - 90)) --out "$OUT/layerstream" ${LS_ARGS:-} ;;
    layerstream30)
      # shellcheck disable=SC2086  # LS_ARGS splits on purpose
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} run layerstream30 $((LIMIT_S - SECONDS)) \
        $PY -m scripts.bench_layer_stream --preset gpt-30b --location host,nvme --in-place \
        --sum-dtype bfloat16 --steps 3 --ssd "SSDTRAIN_HOST_TIER=${LS30_TIER:-455GiB}" \
        --store-dir /var/tmp/ls30 --timeout $((LIMIT_S - SECONDS - 90)) \
        --out "$OUT/layerstream30" ${LS_ARGS:-} ;;
    maxtextfsdp)  # FSDP over both GPUs: MaxText's policies and ours
      maxtext_fsdp maxtextfsdp \
        "minimal,minimal_offloaded@host,minimal_offloaded,minimal_offloaded@nvme,full" ;;
    maxtextfsdpqkv)
      maxtext_fsdp maxtextfsdpqkv \
        "save_qkv_proj,qkv_proj_offloaded@nvme,qkv_proj_offloaded@host,qkv_proj_offloaded" ;;
    maxtextfsdp4)
      gpus 4 maxtextfsdp4 || continue
      maxtext_fsdp maxtextfsdp4 "minimal,minimal_offloaded,minimal_offloaded@host,full" 4 ;;
  esac
done
log "total $SECONDS s; results under $OUT"
