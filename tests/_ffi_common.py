"""The engine's store and load handlers called raw (``jax.ffi.ffi_call``, without jax_ssdtrain's
primitives): shared by test_engine, test_gpu, test_readahead and _rel_common."""

import jax
import jax.numpy as jnp
import numpy as np


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
