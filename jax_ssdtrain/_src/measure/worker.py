"""The child process of ``disk.measure``: ``python -m jax_ssdtrain._src.measure.worker REQUEST``
configures a store of its own in the request's directory, times the engine writing and reading
it back, then (``raw``) plain O_DIRECT on the same directory, and prints the result as one JSON
line. In a process of its own so that the caller's store is left alone."""

from __future__ import annotations

import errno as _errno
import json
import os
import sys
import time
import warnings

import numpy as np

from jax_ssdtrain._src import config, native
from jax_ssdtrain._src.measure.disk import raw_rates, stripe_directories
from jax_ssdtrain._src.options import GiB, MiB


def work(req: dict) -> dict:
  """The engine measurement, then (raw=True) the raw one: ``ProbeResult``'s fields."""
  size, tensor, threads = req["size"], req["tensor_bytes"], req["threads"]
  n = size // tensor
  cache = min(1 * GiB, max(4 * tensor, size // 4))
  stripes = req.get("stripes", 1)
  dirs = stripe_directories(req["directory"], stripes)
  made = [d for d in dirs if not os.path.isdir(d)]
  for d in made:
    os.makedirs(d)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # no O_DIRECT on tmpfs: recorded below
    config.configure(
      dirs,
      capacity_bytes=n * tensor + 16 * MiB * stripes,
      io_threads=threads,
      host_cache_bytes=cache,
      prefetch_bytes=cache // 2,
      host_tier_bytes=0,
      forwarding=False,
      on_full="error",
      verify=False,
      bandwidth_cap=req["bandwidth_cap"],
    )
  src = np.random.default_rng(0).integers(0, 256, tensor, dtype=np.uint8)
  dst = np.zeros_like(src)
  try:
    # Untimed pass: the file space and host cache exist before timing (a training step
    # overwrites the space of the previous one).
    for i in range(n):
      native.store_host(src.ctypes.data, tensor, i)
    config.flush()
    config.release_all()
    config.reset_stats()
    t0 = time.perf_counter()
    handles = [native.store_host(src.ctypes.data, tensor, i) for i in range(n)]
    config.flush()
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in reversed(range(n)):  # the order of a backward pass
      native.load_host(handles[i], dst.ctypes.data, tensor, i)
    t_read = time.perf_counter() - t0
    s = config.stats()
    if not np.array_equal(src, dst):
      raise OSError(_errno.EIO, "probe: the bytes read back differ from those written")
    if s["disk_bytes_read"] < n * tensor:
      raise OSError(
        _errno.EIO,
        f"probe: only {s['disk_bytes_read']} of {n * tensor} bytes were read from the store file",
      )
  finally:
    config.shutdown()
    for d in made:
      try:
        os.rmdir(d)
      except OSError:
        pass
  out = dict(
    directory=req["directory"],
    device=req["device"],
    size=n * tensor,
    threads=threads,
    stripes=stripes,
    tensor_bytes=tensor,
    bandwidth_cap=req["bandwidth_cap"],
    write_gbps=n * tensor / t_write / 1e9,
    read_gbps=n * tensor / t_read / 1e9,
    engine_write_gbps=s["write_GBps"],
    engine_read_gbps=s["read_GBps"],
    o_direct=bool(s["o_direct"]),
    backend=str(s["backend"]),
    measured_at=time.time(),
  )
  if req["raw"]:
    w, r, direct = raw_rates(req["directory"], n * tensor, threads)
    out |= dict(raw_write_gbps=w, raw_read_gbps=r, raw_o_direct=direct)
  return out


if __name__ == "__main__":
  print(json.dumps(work(json.loads(sys.argv[1]))), flush=True)
