"""The engine's store and load handlers called raw (``jax.ffi.ffi_call``, without jax_ssdtrain's
primitives): shared by test_engine, test_gpu, test_readahead, test_large_tensors,
test_staging_size and _rel_common; with what the engine's tests check their results with (bit
for bit equality, the GPU copies settled)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from _limits import HANG_S

from jax_ssdtrain._src import native


def same(a, b):
  """``a`` and ``b`` bit for bit: one dtype, one shape, the same bytes."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  assert a.tobytes() == b.tobytes()


def random_bytes(nbytes, seed, device):
  """``nbytes`` random bytes (uint8) on ``device``."""
  return jax.device_put(np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8), device)


def settled_stats(timeout=HANG_S):
  """Stats once every timed GPU copy completed (the copy streams run behind the host)."""
  t0 = time.monotonic()
  while (s := native.stats())["gpu_pending_brackets"]:
    assert time.monotonic() - t0 < timeout, "GPU copies did not complete"
    time.sleep(0.005)
  return s


def chain(x, n):
  """The intermediates of n steps of x -> sin(x) * 1.5 + i (what the GPU tests store)."""
  out = []
  for i in range(n):
    x = jnp.sin(x) * 1.5 + i
    out.append(x)
  return out


def raw_store(x, site=1, tier=0, name="t", uses=-1, stream_pass=0, stream_dir=0):
  """``ssdtrain_store`` of ``x``: its handle (uint32[2])."""
  return jax.ffi.ffi_call(
    "ssdtrain_store", jax.ShapeDtypeStruct((2,), jnp.uint32), has_side_effect=True
  )(
    x,
    site=np.int64(site),
    tier=np.int32(tier),
    name=name,
    uses=np.int64(uses),
    stream_pass=np.int64(stream_pass),
    stream_dir=np.int32(stream_dir),
  )


def raw_load(h, like, site=1, tier=0, name="t", *, exact=0, consume=0, stream_pass=0, stream_dir=0):
  """``ssdtrain_load`` of the handle ``h`` into an array of ``like``'s shape and dtype (a call
  with a side effect, which XLA neither removes nor merges with another)."""
  return jax.ffi.ffi_call(
    "ssdtrain_load", jax.ShapeDtypeStruct(like.shape, like.dtype), has_side_effect=True
  )(
    h,
    site=np.int64(site),
    tier=np.int32(tier),
    name=name,
    exact=np.int32(exact),
    consume=np.int32(consume),
    stream_pass=np.int64(stream_pass),
    stream_dir=np.int32(stream_dir),
  )
