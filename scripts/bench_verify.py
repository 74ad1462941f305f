"""Store/load throughput with verify (crc32c) on and off, CPU (native FFI calls).

    python -m scripts.bench_verify [--mib 256] [--iters 5] [--dir DIR]

Loads read the file back (forwarding off, host cache smaller than the tensor). Prints one line
per setting; writes nothing.
"""

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_ssdtrain as ssd
from jax_ssdtrain._src import attributes  # the handlers' attribute codes (ssdtrain/attributes.h)


def call(target, shape, dtype, *args):
  # A store's handle leaves this eager call: uncounted (released by a sweep once dropped).
  no_pass = {"stream_pass": np.int64(0), "stream_dir": np.int32(attributes.STREAM_NONE)}
  if target == "ssdtrain_store":
    extra = {"uses": np.int64(attributes.USES_UNCOUNTED), **no_pass}
  else:
    extra = {"exact": np.int32(attributes.LOAD_ACTIVATION), "consume": np.int32(0), **no_pass}
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype), has_side_effect=True)(
    *args, site=np.int64(1), tier=np.int32(attributes.TIER_NVME), name="bench", **extra
  )


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--dir", default=None)
  a = ap.parse_args()
  n = a.mib << 20
  x = jnp.asarray(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8))
  base = a.dir or tempfile.mkdtemp(prefix="bench_verify-")
  for verify in (False, True):
    ssd.configure(
      directory=base,
      capacity_bytes=4 * n,
      forwarding=False,
      verify=verify,
      host_cache_bytes=64 << 20,
      prefetch_bytes=0,
    )
    w, r = [], []
    for i in range(a.iters + 1):
      t0 = time.perf_counter()
      h = jax.block_until_ready(call("ssdtrain_store", (2,), jnp.uint32, x))
      ssd.flush()
      t1 = time.perf_counter()
      y = jax.block_until_ready(call("ssdtrain_load", x.shape, x.dtype, h))
      t2 = time.perf_counter()
      if i:  # first iteration warms up
        w.append(t1 - t0)
        r.append(t2 - t1)
      ssd.release_all()
    assert bool(jnp.array_equal(x, y))
    s = ssd.stats()
    print(
      f"verify={int(verify)} o_direct={s['o_direct']} {a.mib} MiB: store+write "
      f"{n / np.median(w) / 1e9:.2f} GB/s, load(read) {n / np.median(r) / 1e9:.2f} GB/s "
      f"(median of {a.iters})"
    )
  ssd.shutdown()


if __name__ == "__main__":
  main()
