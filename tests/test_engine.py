"""Tests of the native engine (libssdtrain.so) through jax.ffi.ffi_call and its C ABI.

The tests without the ``gpu`` mark call the handlers on JAX's default device: the CPU handlers
where JAX has no GPU (or runs with ``JAX_PLATFORMS=cpu``), the CUDA handlers where its default
device is a GPU. They must pass with both a CPU-only and a CUDA-enabled build of the library.
The ``gpu`` tests at the end put their arrays on a GPU and are skipped where JAX has none.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import gpus
from _ffi_common import chain, same, settled_stats
from _ffi_common import raw_load as load
from _ffi_common import raw_store as store
from _limits import HANG_S

from jax_ssdtrain._src import options

try:
  from jax_ssdtrain._src import native
except ImportError as e:  # pragma: no cover - only when the package itself is broken
  if "native library not found" in str(e):
    raise
  import importlib.util
  import pathlib

  _p = pathlib.Path(__file__).resolve().parents[1] / "jax_ssdtrain" / "_src" / "native.py"
  _spec = importlib.util.spec_from_file_location("_ssdtrain_native_for_tests", _p)
  native = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(native)

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _targets():
  native.register_targets()
  yield
  native.shutdown()


def settings(tmp_path, **kw):
  """Every engine key (the engine has no defaults), from the option table: small sizes, the
  store in tmp_path/store, ``kw`` (StoreConfig fields) over them."""
  fields = dict(
    directories=[str(tmp_path / "store")],
    capacity_bytes=256 * MiB,
    host_cache_bytes=16 * MiB,
    host_tier_bytes=8 * MiB,
    staging_bytes=8 * MiB,
    io_threads=4,
    chunk_bytes=64 * 1024,
    o_direct=None,
    prefetch_bytes=8 * MiB,
    forwarding=True,
  )
  fields.update(kw)
  config = options.check(options.StoreConfig(**options.read_changes(fields)))
  return options.engine_options(config, config.directories)


def cfg(tmp_path, **kw):
  sent = settings(tmp_path, **kw)
  native.configure(sent)
  return sent


def rand(shape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  if np.issubdtype(np.dtype(dtype), np.integer):
    info = np.iinfo(dtype)
    return jnp.asarray(rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True))
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def drain():
  native.release_all()
  return native.stats()


def wait_writes(timeout=HANG_S):
  t0 = time.monotonic()
  while native.stats()["writes_in_flight"]:
    assert time.monotonic() - t0 < timeout, "writes did not finish"
    time.sleep(0.005)
  return native.stats()


# ---------------------------------------------------------------------------


def test_build_info():
  info = native.build_info()
  assert info["cuda"] in (0, 1) and info["kvikio"] in (0, 1)
  major, minor = info["ffi_api"].split(".")
  assert int(major) == 0 and int(minor) >= 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8])
@pytest.mark.parametrize("jit", [False, True])
def test_round_trip_dtypes(tmp_path, dtype, jit):
  cfg(tmp_path)
  x = rand((37, 129), dtype, seed=3)

  def f(x):
    h = store(x, site=7, name="rt")
    return h, load(h, x, site=7, name="rt")

  if jit:
    f = jax.jit(f)
  h, y = f(x)
  assert h.shape == (2,) and h.dtype == jnp.uint32
  same(y, x)
  # A second load of the same handle (scan-hoisted residual / vjp applied twice) works.
  same(load(h, x, site=7, name="rt"), x)


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * 4096 + 5, 64 * 1024 + 1, 3 * MiB + 7])
def test_round_trip_odd_sizes(tmp_path, nbytes):
  cfg(tmp_path, chunk_bytes=8192)
  x = rand((nbytes,), np.uint8, seed=nbytes)
  h = store(x, site=2, name="odd")
  same(load(h, x, site=2, name="odd"), x)
  s = drain()
  assert s["bytes_written"] == nbytes and s["bytes_read"] == nbytes
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == nbytes


def test_zero_size(tmp_path):
  cfg(tmp_path)
  x = jnp.zeros((0, 4), jnp.float32)
  h = store(x, site=3)
  same(load(h, x, site=3), x)


def test_jit_chain_many_sites(tmp_path):
  cfg(tmp_path)
  xs = [rand((64, 64), jnp.float32, seed=i) for i in range(6)]

  @jax.jit
  def f(*xs):  # each entry loaded once in the execution that stored it: uses=1
    hs = [store(x, site=10 + i, name=f"n{i}", uses=1) for i, x in enumerate(xs)]
    return [
      load(h, x, site=10 + i, name=f"n{i}") for i, (h, x) in reversed(list(enumerate(zip(hs, xs))))
    ]

  for _ in range(2):
    ys = f(*xs)
    for y, x in zip(ys, reversed(xs)):
      same(y, x)
    native.flush()  # released at their last load (a write still running finishes first)
    s = native.stats()
    assert s["live_entries"] == 0 and s["file_bytes_in_use"] == 0, s
  assert native.stats()["counted_releases"] == 12


@pytest.mark.parametrize("prefetch", [0, 4 * MiB])
def test_eviction_and_disk_reads(tmp_path, prefetch):
  # 48 tensors of 256 KiB = 12 MiB through a 1 MiB host cache.
  cfg(tmp_path, host_cache_bytes=1 * MiB, prefetch_bytes=prefetch, chunk_bytes=64 * 1024)
  xs = [rand((64, 1024), jnp.float32, seed=i) for i in range(48)]
  hs = [store(x, site=100 + i, name=f"e{i}") for i, x in enumerate(xs)]
  for i in reversed(range(48)):
    same(load(hs[i], xs[i], site=100 + i, name=f"e{i}"), xs[i])
  s = drain()
  total = 48 * 64 * 1024 * 4
  assert s["bytes_written"] == total and s["tensors_written"] == 48
  assert s["bytes_read"] == total and s["tensors_read"] == 48
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == total
  assert s["disk_bytes_read"] > 0 and s["disk_tensors_read"] > 0
  assert s["host_cache_bytes_peak"] <= 1 * MiB
  assert s["prefetch_hits"] + s["prefetch_misses"] + s["forwarded_tensors"] == 48
  if prefetch:
    assert s["prefetch_hits"] > 0
  else:
    assert s["prefetch_misses"] > 0 and s["prefetch_hits"] == 0
  assert s["write_seconds"] > 0 and s["read_seconds"] > 0


@pytest.mark.parametrize("pause", [0.0, 0.3])
@pytest.mark.parametrize("reset", [False, True])
def test_forwarded_entries_written_back_for_another_program(tmp_path, reset, pause):
  # Program A stores 4 x 64 KiB and loads them at once: with one throttled I/O thread the
  # first write is running and the other three are still queued, so forwarding skips them
  # and the 256 KiB cache holds A's only copies. Program B (other sites) must still get the
  # cache: those three are written after all, evicted, and A's later loads read the file.
  # B's stores come at once or `pause` seconds apart (longer than a write at the cap: B's own
  # entries are written and evictable by the next store; a loaded machine does this too).
  # On a GPU, a staging arena smaller than any tensor sends every copy through the host cache
  # (a larger one keeps A's copies on the device, and its loads never reach the cache or files).
  cfg(
    tmp_path,
    host_cache_bytes=256 * 1024,
    staging_bytes=4096,
    chunk_bytes=64 * 1024,
    io_threads=1,
    prefetch_bytes=0,
    bandwidth_cap=512 * 1024,
  )
  native.reset_stats()
  xa = [rand((64 * 1024,), np.uint8, seed=10 + i) for i in range(4)]
  xb = [rand((64 * 1024,), np.uint8, seed=20 + i) for i in range(4)]
  ha = [store(x, site=700 + i, name="a") for i, x in enumerate(xa)]
  for i in reversed(range(4)):
    same(load(ha[i], xa[i], site=700 + i, name="a"), xa[i])
  skipped = wait_writes()["write_skipped_tensors"]
  assert skipped >= 1  # forwarded: the premise of the test
  if reset:  # the counters must not wrap below zero when the skips predate the reset
    native.reset_stats()
  hb = []
  for i, x in enumerate(xb):
    hb.append(jax.block_until_ready(store(x, site=800 + i, name="b")))
    time.sleep(pause)
  s = wait_writes()
  assert s["write_skipped_tensors"] == 0 and s["write_skipped_bytes"] == 0
  assert s["disk_tensors_written"] == (4 + skipped if reset else 8), (skipped, s)
  assert s["bounce_writes"] == 0
  assert s["host_cache_bytes_peak"] <= 256 * 1024
  for i in reversed(range(4)):  # A again (a second pullback): from the file where evicted
    same(load(ha[i], xa[i], site=700 + i, name="a"), xa[i])
    same(load(hb[i], xb[i], site=800 + i, name="b"), xb[i])
  s = drain()
  assert s["disk_tensors_read"] >= 3 and s["live_entries"] == 0


def test_tensor_larger_than_host_cache(tmp_path):
  cfg(tmp_path, host_cache_bytes=64 * 1024, chunk_bytes=64 * 1024)
  x = rand((3 * MiB + 13,), np.uint8, seed=5)
  h = store(x, site=4, name="big")
  same(load(h, x, site=4, name="big"), x)
  s = drain()
  assert s["disk_bytes_written"] == x.size and s["disk_bytes_read"] == x.size


def test_host_tier(tmp_path):
  cfg(tmp_path, host_tier_bytes=1 * MiB)
  xs = [rand((128, 1024), jnp.uint8, seed=i) for i in range(4)]  # 4 x 128 KiB
  hs = [store(x, site=20 + i, tier=1, name="ht") for i, x in enumerate(xs)]
  s = native.stats()
  assert s["host_tier_bytes_in_use"] == 4 * 128 * 1024
  for i, (h, x) in enumerate(zip(hs, xs)):
    same(load(h, x, site=20 + i, tier=1, name="ht"), x)
  s = drain()
  assert s["disk_bytes_written"] == 0 and s["disk_bytes_read"] == 0
  assert s["bytes_written"] == 4 * 128 * 1024 and s["host_tier_bytes_in_use"] == 0
  assert s["host_tier_bytes_peak"] == 4 * 128 * 1024
  big = rand((2 * MiB,), jnp.uint8)
  with pytest.raises(Exception, match="host tier full"):
    jax.block_until_ready(store(big, site=30, tier=1, name="toobig"))


def test_stats_exact_mixed(tmp_path):
  cfg(tmp_path, host_tier_bytes=2 * MiB)
  native.reset_stats()
  sizes = [1, 100, 4096, 5000, 70000, 300000]
  nvme = host = 0
  for i, n in enumerate(sizes):
    x = rand((n,), np.uint8, seed=i)
    tier = i % 2
    h = store(x, site=40 + i, tier=tier)
    if tier:
      host += n
    else:
      nvme += n
    if i % 3 == 0:
      same(load(h, x, site=40 + i, tier=tier), x)
  s = drain()
  assert s["bytes_written"] == nvme + host
  assert s["tensors_written"] == len(sizes)
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == nvme
  assert s["tensors_read"] == 2 and s["bytes_read"] == sizes[0] + sizes[3]
  assert s["live_entries"] == 0 and s["file_bytes_in_use"] == 0
  assert s["host_cache_bytes_in_use"] == 0 and s["host_tier_bytes_in_use"] == 0
  native.reset_stats()
  s = native.stats()
  assert s["bytes_written"] == 0 and s["disk_bytes_written"] == 0


def test_lifetime_rule(tmp_path):
  cfg(tmp_path)
  x1 = rand((1000,), jnp.float32, seed=1)
  x2 = rand((1000,), jnp.float32, seed=2)
  # Counted: released at its `uses`-th load, not before.
  h1 = store(x1, site=5, name="life", uses=2)
  same(load(h1, x1, site=5, name="life"), x1)
  h_other = store(x2, site=6, name="other", uses=-1)
  h_again = store(x2, site=5, name="life", uses=-1)  # another store at the site changes nothing
  same(load(h1, x1, site=5, name="life"), x1)
  with pytest.raises(Exception, match="released") as ei:
    jax.block_until_ready(load(h1, x1, site=5, name="life"))
  assert "life" in str(ei.value) and "site 5" in str(ei.value)
  # Uncounted: any number of loads; kept until a sweep or release_all().
  for _ in range(3):
    same(load(h_other, x2, site=6, name="other"), x2)
  same(load(h_again, x2, site=5, name="life"), x2)
  assert native.stats()["live_entries"] == 2
  # A sweep keeps what a live handle names and releases the rest.
  keep = np.asarray(h_other).reshape(1, 2)
  assert native.sweep(keep, native.stats()["next_seq"]) == 1
  same(load(h_other, x2, site=6, name="other"), x2)
  with pytest.raises(Exception, match="released"):
    jax.block_until_ready(load(h_again, x2, site=5, name="life"))
  # A store nobody loads (uses=0) keeps nothing and returns the null handle.
  s0 = native.stats()
  h0 = store(x1, site=9, name="unused", uses=0)
  assert np.asarray(h0).tolist() == [0, 0]
  s1 = native.stats()
  assert s1["live_entries"] == s0["live_entries"] and s1["unused_stores"] == s0["unused_stores"] + 1
  with pytest.raises(Exception, match="invalid or stale"):
    jax.block_until_ready(load(h0, x1, site=9, name="unused"))
  native.release_all()
  with pytest.raises(Exception, match="released"):
    jax.block_until_ready(load(h_other, x2, site=6, name="other"))


def test_bad_handles(tmp_path):
  cfg(tmp_path)
  x = rand((256,), jnp.float32)
  h = store(x, site=9, name="bad")
  corrupted = h.at[1].set(h[1] ^ jnp.uint32(0x5A5A))
  with pytest.raises(Exception, match="invalid or stale ssdtrain handle"):
    jax.block_until_ready(load(corrupted, x, site=9, name="bad"))
  with pytest.raises(Exception, match="invalid or stale ssdtrain handle"):
    jax.block_until_ready(load(jnp.zeros((2,), jnp.uint32), x, site=9, name="bad"))
  # Wrong output size.
  with pytest.raises(Exception, match="bytes"):
    jax.block_until_ready(load(h, jnp.zeros((255,), jnp.float32), site=9, name="bad"))
  with pytest.raises(Exception, match="bytes"):
    jax.block_until_ready(
      load(
        h,
        jnp.zeros((256,), jnp.float64 if jax.config.jax_enable_x64 else jnp.int16),
        site=9,
        name="bad",
      )
    )
  # Same size, different dtype is a bit-exact reinterpretation (allowed).
  y = load(h, jnp.zeros((256,), jnp.int32), site=9, name="bad")
  same(jax.lax.bitcast_convert_type(y, jnp.float32), x)
  # Wrong site.
  with pytest.raises(Exception, match="site"):
    jax.block_until_ready(load(h, x, site=10, name="bad"))
  # Still loadable correctly afterwards.
  same(load(h, x, site=9, name="bad"), x)
  # Reconfiguring makes old handles stale, and the error says why.
  cfg(tmp_path)
  with pytest.raises(
    Exception, match="stale ssdtrain handle.*belongs to a store that was replaced"
  ):
    jax.block_until_ready(load(h, x, site=9, name="bad"))


def test_invalid_tier(tmp_path):
  cfg(tmp_path)
  with pytest.raises(Exception, match="tier"):
    jax.block_until_ready(store(jnp.ones(4), site=1, tier=3))


def test_invalid_load_order(tmp_path):
  cfg(tmp_path)
  x = jnp.ones(4)
  h = store(x, site=1)
  with pytest.raises(Exception, match="exact=7 names no load order"):
    jax.block_until_ready(load(h, x, site=1, exact=7))
  same(load(h, x, site=1), x)  # the entry is still there


def test_invalid_stream_dir(tmp_path):
  cfg(tmp_path)
  x = jnp.ones(4)
  with pytest.raises(Exception, match="stream_dir=5 names no layer order"):
    jax.block_until_ready(store(x, site=1, stream_pass=1, stream_dir=5))
  h = store(x, site=1, stream_pass=1, stream_dir=1)
  with pytest.raises(Exception, match="stream_dir=-2 names no layer order"):
    jax.block_until_ready(load(h, x, site=1, exact=3, stream_pass=2, stream_dir=-2))
  same(load(h, x, site=1, exact=3, stream_pass=2, stream_dir=1), x)


@pytest.mark.parametrize(
  "store_dir, load_dir", [(0, 0), (1, 0), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1)]
)
def test_streamed_loads_predicted_from_the_second_where_both_directions_are_given(
  tmp_path, store_dir, load_dir
):
  # A store pass of N "layers" (in its direction's layer order), then a pass loading them in its
  # own: the engine predicts each load after the pass's first where both passes give their
  # direction, after its second where either does not (the second shows it); the CPU reads
  # every handle and counts the predictions that match it.
  cfg(tmp_path)
  n = 6
  xs = [rand((64,), jnp.float32, seed=i) for i in range(n)]
  order = lambda d: list(range(n)) if d >= 0 else list(range(n))[::-1]

  @jax.jit
  def put(xs):
    hs, prev = {}, None
    for i in order(store_dir):
      # x + 0.0 * h (XLA folds an integer product with 0: it would not order the stores)
      x = xs[i] if prev is None else xs[i] + prev[0].astype(jnp.float32) * 0.0
      hs[i] = prev = store(x, site=5, stream_pass=1, stream_dir=store_dir)
    return [hs[i] for i in range(n)]

  @jax.jit
  def get(hs):
    out, prev = {}, None
    for i in order(load_dir):
      h = hs[i] if prev is None else hs[i] + (prev[0] * 0).astype(jnp.uint32)
      out[i] = prev = load(h, xs[0], site=5, exact=3, stream_pass=2, stream_dir=load_dir)
    return [out[i] for i in range(n)]

  hs = jax.block_until_ready(put(xs))
  before = native.stats()
  got = jax.block_until_ready(get(hs))
  for a, b in zip(got, xs):
    same(a, b)
  s = native.stats()
  assert s["handle_mismatches"] == before["handle_mismatches"]
  both = store_dir != 0 and load_dir != 0
  assert s["speculative_loads"] - before["speculative_loads"] == (n - 1 if both else n - 2)


def test_ordered_loads_predicted_per_chunk_size_wherever_the_short_chunk_was_stored(tmp_path):
  # A leaf's full chunks are stored and loaded in a scan's order, its shorter last chunk outside
  # the scan, where XLA runs it before, between or after them (on XLA:CPU as its threads fall):
  # here it is stored second and loaded first. The loads after the execution's first are
  # predicted in store order among the entries of their size, and every prediction is right.
  cfg(tmp_path)
  full = [rand((64,), jnp.float32, seed=i) for i in range(4)]
  tail = rand((40,), jnp.float32, seed=9)

  @jax.jit
  def put(full, tail):
    hs = [store(full[0], site=7)]
    ht = store(tail + hs[0][0].astype(jnp.float32) * 0.0, site=7)
    prev = ht
    for x in full[1:]:
      prev = store(x + prev[0].astype(jnp.float32) * 0.0, site=7)
      hs.append(prev)
    return hs, ht

  @jax.jit
  def get(hs, ht):
    t = load(ht, tail, site=7, exact=2)
    out, prev = [], t
    for h in hs:
      h = h + (prev[0] * 0).astype(jnp.uint32)
      out.append(prev := load(h, full[0], site=7, exact=2))
    return out, t

  hs, ht = jax.block_until_ready(put(full, tail))
  before = native.stats()
  got, t = jax.block_until_ready(get(hs, ht))
  same(t, tail)
  for a, b in zip(got, full):
    same(a, b)
  s = native.stats()
  assert s["handle_mismatches"] == before["handle_mismatches"], "a load predicted wrong"
  assert s["speculative_loads"] - before["speculative_loads"] == len(full)  # all but the first


def test_capacity_enospc(tmp_path):
  cfg(tmp_path, capacity_bytes=1 * MiB)
  ok = store(rand((512 * 1024,), jnp.uint8), site=1, name="fits")
  jax.block_until_ready(ok)
  with pytest.raises(Exception, match="No space|ENOSPC") as ei:
    jax.block_until_ready(store(rand((768 * 1024,), jnp.uint8), site=2, name="toolarge"))
  assert "toolarge" in str(ei.value)
  # The engine keeps working after the error.
  x = rand((1000,), jnp.uint8)
  same(load(store(x, site=3), x, site=3), x)


def test_configure_validation(tmp_path):
  f = tmp_path / "afile"
  f.write_text("x")
  base = settings(tmp_path, directories=[str(tmp_path / "d")])
  with pytest.raises(OSError, match="afile"):
    native.configure({**base, "directories": str(f)})
  with pytest.raises(OSError, match="afile"):
    native.configure({**base, "directories": str(f / "sub")})
  with pytest.raises(ValueError, match="unknown key 'bogus_key'"):
    native.configure({**base, "bogus_key": 1})
  for key, val in [
    ("capacity_bytes", 0),
    ("capacity_bytes", 4095),
    ("host_cache_bytes", -5),
    ("io_threads", 0),
    ("io_threads", 257),
    ("chunk_bytes", 1000),
    ("chunk_bytes", 4096 + 1),
    ("o_direct", 3),
    ("on_full", 2),
    ("device_groups", -1),
    ("capacity_bytes", "lots"),
  ]:
    with pytest.raises(ValueError, match=f"'{key}': {val}|'{key}' is not an integer: '{val}'"):
      native.configure({**base, key: val})
  # Zero is allowed where it means "off".
  native.configure(
    {**base, "host_tier_bytes": 0, "prefetch_bytes": 0, "staging_bytes": 0, "forwarding": 0}
  )
  x = rand((5000,), jnp.uint8)
  same(load(store(x, site=1), x, site=1), x)


def test_files_private_and_removed(tmp_path):
  d = tmp_path / "deep" / "store"
  cfg(tmp_path, directories=[str(d)])
  assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
  assert stat.S_IMODE(os.stat(tmp_path / "deep").st_mode) == 0o700
  x = rand((300000,), jnp.uint8)
  h = store(x, site=1)
  same(load(h, x, site=1), x)
  paths = native.file_paths()
  assert len(paths) == 1
  for p in paths:
    if p.endswith("(unlinked)"):
      assert os.listdir(d) == []
    else:
      assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
  native.shutdown()
  assert os.listdir(d) == []
  assert native.file_paths() == []
  # The store fds are closed: no open fd of this process points into the directory.
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
    assert not target.startswith(str(d)), target


def test_striping_two_directories(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  cfg(tmp_path, directories=[str(a), str(b)], chunk_bytes=64 * 1024, forwarding=False)
  xs = [rand((1 * MiB,), jnp.uint8, seed=i) for i in range(4)]
  hs = [store(x, site=i) for i, x in enumerate(xs)]
  jax.block_until_ready(hs)
  s = wait_writes()
  assert s["directories"] == 2
  assert s["file0_bytes_written"] > 0 and s["file1_bytes_written"] > 0
  assert s["file0_bytes_written"] + s["file1_bytes_written"] == 4 * MiB
  assert len(native.file_paths()) == 2
  assert os.listdir(a) == [] and os.listdir(b) == []
  # Reads from both files, through a tiny cache.
  cfg(
    tmp_path,
    directories=[str(a), str(b)],
    chunk_bytes=64 * 1024,
    host_cache_bytes=64 * 1024,
    prefetch_bytes=0,
  )
  hs = [store(x, site=i) for i, x in enumerate(xs)]
  for i in reversed(range(4)):
    same(load(hs[i], xs[i], site=i), xs[i])
  s = drain()
  assert s["file0_bytes_read"] > 0 and s["file1_bytes_read"] > 0


def test_forwarding_off_writes_everything(tmp_path):
  cfg(tmp_path, forwarding=False)
  xs = [rand((50000,), jnp.uint8, seed=i) for i in range(8)]
  hs = [store(x, site=i) for i, x in enumerate(xs)]
  for i in reversed(range(8)):
    same(load(hs[i], xs[i], site=i), xs[i])
  s = drain()
  assert s["write_skipped_bytes"] == 0 and s["disk_bytes_written"] == 8 * 50000


def test_two_threads(tmp_path):
  cfg(tmp_path, host_cache_bytes=2 * MiB, prefetch_bytes=1 * MiB)

  @jax.jit
  def step(xs, base):
    del base
    return xs

  errors = []

  def worker(tid):
    try:
      xs = [rand((32, 1024), jnp.float32, seed=100 * tid + i) for i in range(12)]
      for _ in range(4):
        hs = [store(x, site=1000 * tid + i, name=f"w{tid}") for i, x in enumerate(xs)]
        for i in reversed(range(12)):
          same(load(hs[i], xs[i], site=1000 * tid + i, name=f"w{tid}"), xs[i])
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  ts = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  assert not errors, errors
  s = drain()
  assert s["tensors_written"] == 2 * 4 * 12 and s["tensors_read"] == 2 * 4 * 12
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == s["bytes_written"]


def test_scan_hoisted_multiple_loads(tmp_path):
  cfg(tmp_path)
  x = rand((128,), jnp.float32)

  @jax.jit
  def f(x):
    h = store(x, site=77, name="hoist")

    def body(c, _):
      return c + load(h, x, site=77, name="hoist"), None

    return jax.lax.scan(body, jnp.zeros_like(x), None, length=5)[0]

  np.testing.assert_allclose(np.asarray(f(x)), 5 * np.asarray(x), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(f(x)), 5 * np.asarray(x), rtol=1e-6)


# ---------------------------------------------------------------------------
# GPU (CUDA handlers). Skipped where JAX has no GPU.
# ---------------------------------------------------------------------------


def _on_gpu(x):
  return jax.device_put(x, gpus()[0])


@pytest.mark.gpu
@pytest.mark.parametrize("staging", [0, 4 * MiB, 64 * MiB])
@pytest.mark.parametrize("host_cache", [256 * 1024, 64 * MiB])
def test_gpu_round_trip(tmp_path, staging, host_cache):
  assert native.build_info()["cuda"] == 1
  cfg(tmp_path, staging_bytes=staging, host_cache_bytes=host_cache, prefetch_bytes=2 * MiB)
  shapes = [(1,), (4097,), (3 * 4096 + 5,), (256, 1024), (1, 3 * MiB + 3)]
  dtypes = [jnp.uint8, jnp.bfloat16, jnp.float32, jnp.int32, jnp.float16]
  xs = [_on_gpu(rand(s, d, seed=i)) for i, (s, d) in enumerate(zip(shapes, dtypes))]
  hs = [store(x, site=500 + i, name=f"g{i}") for i, x in enumerate(xs)]
  assert all(h.devices() == {gpus()[0]} for h in hs)
  for i in reversed(range(len(xs))):
    same(load(hs[i], xs[i], site=500 + i, name=f"g{i}"), xs[i])
  # Second load of the same handle.
  same(load(hs[0], xs[0], site=500, name="g0"), xs[0])
  s = drain()
  total = sum(int(x.nbytes) for x in xs)
  assert s["bytes_written"] == total
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == total


@pytest.mark.gpu
@pytest.mark.parametrize("staging", [0, 2 * MiB, 64 * MiB])
def test_gpu_stream_order_under_buffer_reuse(tmp_path, staging):
  # Intermediates inside one jit share buffers; each store must capture the
  # value at its point in the stream.
  cfg(tmp_path, staging_bytes=staging, host_cache_bytes=4 * MiB, prefetch_bytes=4 * MiB)
  n = 12

  @jax.jit
  def fwd(x):
    hs = []
    for i in range(n):
      x = jnp.sin(x) * 1.5 + i
      hs.append(store(x, site=600 + i, name=f"s{i}"))
    return hs, x

  ref = jax.jit(lambda x: chain(x, n))

  x0 = _on_gpu(rand((512, 1024), jnp.float32))
  want = ref(x0)
  for _ in range(3):
    hs, _ = fwd(x0)

    @jax.jit
    def bwd(hs):
      return [load(hs[i], want[i], site=600 + i, name=f"s{i}") for i in reversed(range(n))]

    got = bwd(hs)
    for g, w in zip(got, reversed(want)):
      same(g, w)
  s = drain()
  assert s["tensors_written"] == 3 * n and s["tensors_read"] == 3 * n


@pytest.mark.gpu
def test_gpu_errors(tmp_path):
  cfg(tmp_path, capacity_bytes=1 * MiB)
  x = _on_gpu(rand((1000,), jnp.float32))
  h = store(x, site=1, name="ge", uses=1)  # released after its one (successful) load
  with pytest.raises(Exception, match="bytes"):
    jax.block_until_ready(load(h, _on_gpu(jnp.zeros((999,), jnp.float32)), site=1, name="ge"))
  with pytest.raises(Exception, match="invalid or stale"):
    jax.block_until_ready(load(h.at[1].add(jnp.uint32(1)), x, site=1, name="ge"))
  same(load(h, x, site=1, name="ge"), x)
  with pytest.raises(Exception, match="released"):
    jax.block_until_ready(load(h, x, site=1, name="ge"))
  with pytest.raises(Exception, match="No space|ENOSPC"):
    jax.block_until_ready(store(_on_gpu(jnp.zeros((2 * MiB,), jnp.uint8)), site=2, name="big"))


@pytest.mark.gpu
def test_gpu_host_tier_and_forwarding(tmp_path):
  cfg(tmp_path, host_tier_bytes=8 * MiB, staging_bytes=64 * MiB, host_cache_bytes=64 * MiB)
  xs = [_on_gpu(rand((256, 1024), jnp.float32, seed=i)) for i in range(4)]
  hs = [store(x, site=700 + i, tier=i % 2, name="f") for i, x in enumerate(xs)]
  for i in reversed(range(4)):
    same(load(hs[i], xs[i], site=700 + i, tier=i % 2, name="f"), xs[i])
  s = drain()
  assert s["staging_forwarded_tensors"] == 4
  assert s["staging_bytes_peak"] > 0 and s["staging_bytes_in_use"] == 0
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == 2 * 256 * 1024 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("forwarding", [True, False])
@pytest.mark.parametrize("staging", [3 * MiB, 64 * MiB])
def test_gpu_lazy_host_copies(tmp_path, forwarding, staging):
  """Host-tier stores keep their newest copies in staging only (forwarding on): each tensor
  crosses the link to the host at most once, those loaded from staging before their copy was
  needed never do, and every load returns the stored bytes, also when staging reuse forces a
  deferred copy out and when an entry is loaded twice."""
  cfg(
    tmp_path,
    staging_bytes=staging,
    host_tier_bytes=32 * MiB,
    prefetch_bytes=2 * MiB,
    forwarding=forwarding,
  )
  n, shape = 12, (256, 1024)  # 1 MiB each
  nbytes = 4 * shape[0] * shape[1]

  @jax.jit
  def fwd(x):
    hs = []
    for i in range(n):
      x = jnp.sin(x) * 1.5 + i
      hs.append(store(x, site=900 + i, tier=1, name=f"h{i}", uses=-1 if i == 0 else 1))
    return hs

  ref = jax.jit(lambda x: chain(x, n))

  x0 = _on_gpu(rand(shape, jnp.float32))
  want = ref(x0)
  native.reset_stats()
  hs = fwd(x0)

  @jax.jit
  def bwd(hs):
    return [load(hs[i], want[i], site=900 + i, tier=1, name=f"h{i}") for i in reversed(range(n))]

  for g, w in zip(bwd(hs), reversed(want)):
    same(g, w)
  same(load(hs[0], want[0], site=900, tier=1, name="h0"), want[0])  # loaded twice (uncounted)
  native.release_all()  # the uncounted entry too: every deferred copy is settled
  s = settled_stats()
  total = n * nbytes
  assert s["live_entries"] == 0 and s["staging_bytes_in_use"] == 0 and s["d2h_deferred_bytes"] == 0
  assert s["link_d2h_bytes"] + s["d2h_elided_bytes"] == total, s
  if forwarding:
    assert s["d2h_elided_bytes"] > 0
    if staging >= 64 * MiB:  # everything fits: nothing crosses the link either way
      assert s["link_d2h_bytes"] == 0 and s["link_h2d_bytes"] == 0
  else:
    assert s["d2h_elided_bytes"] == 0 and s["link_d2h_bytes"] == total
  # Each op's count and bytes are those of the copies issued; times come from CUDA events.
  assert s["gpu_stage_in_bytes"] == total and s["gpu_stage_in_count"] == n
  assert s["gpu_load_staged_bytes"] + s["gpu_load_host_bytes"] == total + nbytes
  if s["link_d2h_bytes"]:
    assert s["link_d2h_busy_seconds"] > 0 and s["link_d2h_GBps"] > 0


@pytest.mark.gpu
def test_gpu_timeline(tmp_path):
  cfg(tmp_path, staging_bytes=64 * MiB, host_tier_bytes=16 * MiB)
  native.timeline()
  t0 = time.monotonic()
  xs = [_on_gpu(rand((256, 1024), jnp.float32, seed=i)) for i in range(3)]
  hs = [store(x, site=950 + i, tier=1, name=f"tl {i}", uses=1) for i, x in enumerate(xs)]
  for i in reversed(range(3)):
    same(load(hs[i], xs[i], site=950 + i, tier=1, name=f"tl {i}"), xs[i])
  t1 = time.monotonic()
  recs = native.timeline()
  assert {r["op"] for r in recs} >= {"stage_in", "load_staged"}
  for r in recs:
    assert t0 - 0.01 <= r["start"] <= r["end"] <= t1 + 0.01, r
    assert r["device"] == 0 and r["name"].startswith("tl_")
  assert sum(r["bytes"] for r in recs if r["op"] == "stage_in") == 3 * 1024 * 1024
  assert native.timeline() == []  # read once


@pytest.mark.gpu
def test_gpu_probe_link():
  for host in native.LINK_HOST_KINDS:
    rates = native.probe_link(0, 64 * MiB, 3, host)
    assert min(rates[:4]) > 0.5, (host, rates)  # GB/s: any PCIe or NVLink-C2C link
    # 4 rounds (one untimed) of 2 copies alone and 2 at once: >= 12 copy times
    assert rates.copy_seconds >= 12 * 64 * MiB / 1e9 / max(rates[:4]) * 0.9, rates
  calls = []
  rates = native.probe_link(0, 64 * MiB, 2, "registered", on_ready=lambda: calls.append(1))
  assert calls == [1] and rates.copy_seconds > 0, rates

  def fails():
    raise KeyError("from on_ready")

  with pytest.raises(KeyError, match="from on_ready"):  # after the copies, not lost in C
    native.probe_link(0, MiB, 1, on_ready=fails)
  with pytest.raises(TypeError, match="on_ready"):
    native.probe_link(0, MiB, 1, on_ready=3)
  with pytest.raises(ValueError, match="host"):
    native.probe_link(0, MiB, 1, "pageable")
  with pytest.raises(ValueError, match="no GPU 99"):
    native.probe_link(99, MiB, 1)


def test_probe_link_needs_a_gpu():
  if gpus():
    pytest.skip("a GPU is present (test_gpu_probe_link covers it)")
  calls = []
  with pytest.raises(OSError, match="link"):
    native.probe_link(0, MiB, 1, on_ready=lambda: calls.append(1))
  assert calls == []  # no buffers, so never ready
  assert native.timeline() == []  # no CUDA handler ran


def test_measure_links_checks_its_arguments_and_needs_a_gpu():
  from jax_ssdtrain import probe

  with pytest.raises(ValueError, match="distinct CUDA ordinals"):
    probe.measure_links([0, 0], MiB)
  with pytest.raises(ValueError, match="distinct CUDA ordinals"):
    probe.measure_links([], MiB)
  with pytest.raises(ValueError, match="host"):
    probe.measure_links([0], MiB, host="pageable")
  if not gpus():  # every thread fails alike; the caller gets the cause, not a broken barrier
    with pytest.raises(OSError, match="link"):
      probe.measure_links([0, 1], MiB, repeats=1)


@pytest.mark.gpu
def test_gpu_measure_links_all_at_once():
  from jax_ssdtrain import probe

  devices = list(range(len(gpus())))
  rs = probe.measure_links(devices, 64 * MiB, repeats=2)
  assert [r.device for r in rs] == devices and all(r.size == 64 * MiB for r in rs)
  assert all(min(r.d2h_gbps, r.h2d_gbps, r.duplex_d2h_gbps, r.duplex_h2d_gbps) > 0.5 for r in rs)
  with pytest.raises(ValueError, match="no GPU 99"):  # one GPU's error, the others released
    probe.measure_links([0, 99], MiB, repeats=1)


# --- ssdtrain_copy (primitives.opaque_copy): the optimizer's copy XLA cannot see through ---


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint32", "bool"])
@pytest.mark.parametrize("shape", [(), (1,), (7, 3), (1031,), (64, 129)])
def test_opaque_copy_is_the_value_bit_for_bit(dtype, shape):
  from jax_ssdtrain._src.primitives import opaque_copy

  x = (jax.random.uniform(jax.random.key(0), shape) * 200 - 100).astype(dtype)
  after = jnp.arange(5.0)
  for effect in (True, False):
    got = jax.jit(lambda x, a: opaque_copy(x, a, effect=effect))(x, after)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_opaque_copy_is_a_custom_call_that_waits_for_its_other_operands():
  from jax_ssdtrain._src.primitives import opaque_copy

  def f(x, y):
    return opaque_copy(x * 2, jnp.sin(y)) + 1

  hlo = jax.jit(f).lower(jnp.ones(4), jnp.ones(3)).as_text()
  (line,) = [ln for ln in hlo.splitlines() if "ssdtrain_copy" in ln]
  # x * 2 and sin(y) are its two operands; XLA sees nothing of what it does with them
  assert re.search(r"@ssdtrain_copy\(%[\w#]+, %[\w#]+\)", line), line
  compiled = jax.jit(f).lower(jnp.ones(4), jnp.ones(3)).compile().as_text()
  assert "ssdtrain_copy" in compiled  # not folded away (x * 2 + 1 would fuse without it)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(jnp.ones(4), jnp.ones(3))), 3.0)
