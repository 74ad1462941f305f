#!/usr/bin/env bash
# device call C: the optimizer store on the GPU (tests, then the benchmark)
export PYTHONUNBUFFERED=1
G=/tmp/g; rm -rf $G; mkdir -p $G/c
python3 -m pip uninstall -y -q jax_ssdtrain > /dev/null 2>&1
cmake -S xla_ffi -B build-gpu -G Ninja -DSSDTRAIN_CUDA=ON -DSSDTRAIN_CUDA_ARCHITECTURES=90 \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -DSSDTRAIN_XLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
  > $G/c/build.log 2>&1 && cmake --build build-gpu >> $G/c/build.log 2>&1 || { tail -20 $G/c/build.log; exit 1; }
export SSDTRAIN_LIB=$PWD/build-gpu/libssdtrain.so PYTHONPATH=$PWD
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -ra -p no:cacheprovider tests/test_optimizer.py > $G/c/tests.log 2>&1; echo "tests rc $?"; tail -3 $G/c/tests.log
timeout 300 python3 -m scripts.bench_optimizer --store-dir /var/tmp/opt --out $G/c/bench > $G/c/bench.log 2>&1; echo "bench rc $?"; tail -15 $G/c/bench.log
cd $G && tar czf $OUT/all.tgz . ; ls -la $OUT
