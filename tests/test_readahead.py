"""Read-ahead never costs extra disk reads: for every host cache size (below one tensor to above
a step) and read-ahead budget (none to unbounded), every byte read from the files is taken by a
load (``disk_bytes_read == disk_loaded_bytes``). Programs: a scan of layers, a residual that scan
hoists out of the loop (stored once, loaded in every layer), loads out of store order, and a
tensor-parallel scan on 4 CPU devices (a subprocess)."""

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import run_worker
from _ffi_common import raw_load, raw_store
from _limits import HANG_S
from _optimizer_readahead import check_state_read_ahead_in_store_order
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd

KiB, MiB = 1 << 10, 1 << 20
KEYS = (
  "bytes_read",
  "disk_bytes_read",
  "disk_loaded_bytes",
  "disk_unused_bytes",
  "forwarded_bytes",
  "prefetch_issued",
  "prefetch_hits",
  "bounce_reads",
)


def sweep(run, directory, tensor, step):
  """Runs `run` (one training step; returns its gradient error) under each host cache
  and read-ahead size (and, on a GPU, device staging size): a warm-up step, then two counted
  steps. One record per combination."""
  caches = (tensor // 2, tensor, 3 * tensor, step // 4, 2 * step)
  budgets = (0, tensor, 4 * tensor, 1 << 30)
  stagings = (0, tensor, 2 * tensor) if jax.default_backend() == "gpu" else (0,)
  out = []
  for cache, budget, staging in itertools.product(caches, budgets, stagings):
    ssd.configure(
      directory,
      capacity_bytes=256 * MiB,
      host_cache_bytes=cache,
      prefetch_bytes=budget,
      staging_bytes=staging,
      io_threads=4,
      chunk_bytes=64 * KiB,
    )
    diff = run()
    ssd.flush()
    ssd.reset_stats()
    diff = max(diff, run(), run())
    ssd.flush()
    s = ssd.stats()
    out.append(
      dict({k: s[k] for k in KEYS}, cache=cache, budget=budget, staging=staging, diff=diff)
    )
  return out


def check(records, step):
  # The same arithmetic as saving on the device on CPU; GPU fusions differ around the calls.
  tol = 1e-5 if jax.default_backend() == "gpu" else 0.0
  for r in records:
    assert r["diff"] <= tol, r
    # The must-have, and more: every program here loads everything it stores, so every read is
    # taken by exactly one load and none is wasted.
    assert r["disk_bytes_read"] <= r["disk_loaded_bytes"], r
    assert r["disk_bytes_read"] == r["disk_loaded_bytes"] and r["disk_unused_bytes"] == 0, r
    assert r["disk_loaded_bytes"] <= r["bytes_read"], r
  small = [r for r in records if r["cache"] < step]
  assert all(r["disk_bytes_read"] > 0 for r in small)  # the premise: loads that read the disk
  assert any(r["prefetch_issued"] and r["prefetch_hits"] for r in small if r["budget"])
  assert any(r["bounce_reads"] for r in small)
  big = [r for r in records if r["cache"] > step]
  assert all(r["disk_bytes_read"] == 0 for r in big), big  # a step fits: all forwarded


@pytest.fixture(autouse=True)
def _scoped_store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB):
    yield


def grad_error(loss, tags, *args):
  """One step of `loss(policy)` offloading `tags`; returns its gradients' error relative to the
  same program saving them on the device."""
  every = tuple(range(len(args)))
  want = jax.jit(
    jax.grad(loss(jax.checkpoint_policies.save_only_these_names(*tags)), argnums=every)
  )(*args)
  ours = jax.jit(jax.grad(loss(ssd.offload_policy(tags, min_bytes=0)), argnums=every))
  return lambda: error(ours(*args), want)


def error(got, want):
  """The largest difference between two gradient trees, relative to the largest element."""
  return max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  )


def test_scan_of_layers(tmp_path):
  L, B, H = 6, 32, 256  # tags of 32 KiB ("a") and 64 KiB ("b") per layer

  def loss(policy):
    def layer(w, x):
      a = checkpoint_name(jnp.tanh(x @ w), "a")
      b = checkpoint_name(jnp.sin(jnp.concatenate([a, x], axis=1)), "b")
      return x + a * b[:, :H]

    f = jax.checkpoint(layer, policy=policy)
    return lambda w, x: jnp.sum(jax.lax.scan(lambda c, wi: (f(wi, c), None), x, w)[0] ** 2)

  w = jax.random.normal(jax.random.key(0), (L, H, H)) / 16
  x = jax.random.normal(jax.random.key(1), (B, H))
  step = L * 96 * KiB
  check(sweep(grad_error(loss, ("a", "b"), w, x), tmp_path / "s", 32 * KiB, step), step)


def test_hoisted_residual_loaded_in_every_layer(tmp_path):
  L, B, H = 6, 32, 256  # "inv" (32 KiB) is stored once and loaded L times; "a" once per layer

  def loss(policy):
    def layer(w, c, y):
      inv = checkpoint_name(jnp.sin(y) * 2, "inv")  # loop-invariant: scan hoists it
      a = checkpoint_name(jnp.tanh(c @ w), "a")
      return c + a * inv

    f = jax.checkpoint(layer, policy=policy)
    return lambda w, x, y: jnp.sum(jax.lax.scan(lambda c, wi: (f(wi, c, y), None), x, w)[0] ** 2)

  w = jax.random.normal(jax.random.key(0), (L, H, H)) / 16
  x = jax.random.normal(jax.random.key(1), (B, H))
  y = jax.random.normal(jax.random.key(2), (B, H))
  step = (L + 1) * 32 * KiB
  records = sweep(grad_error(loss, ("a", "inv"), w, x, y), tmp_path / "s", 32 * KiB, step)
  # The premise: inv is loaded more often than stored (2 counted steps of L + L loads).
  assert all(r["bytes_read"] == 2 * 2 * L * 32 * KiB for r in records), records[0]
  check(records, step)


def ffi_store(x, site):
  return raw_store(x, site=site, name=f"s{site}")


def ffi_load(h, like, site):
  return raw_load(h, like, site=site, name=f"s{site}")


def test_stores_while_the_cache_holds_reads_ahead(tmp_path):
  # 12 tensors of 32 KiB through a cache of 4: after the newest four are loaded, read-ahead has
  # filled the cache with reads no load has taken. Stores then (a recomputation storing in the
  # backward pass) must neither evict those reads nor wait for them: they write through.
  ssd.configure(
    tmp_path / "s",
    capacity_bytes=64 * MiB,
    host_cache_bytes=128 * KiB,
    prefetch_bytes=1 << 30,
    staging_bytes=0,
    io_threads=2,
    chunk_bytes=64 * KiB,
  )
  xs = [jnp.arange(8 * KiB, dtype=jnp.float32) + i for i in range(16)]
  hs = [ffi_store(x, 950 + i) for i, x in enumerate(xs[:12])]
  ssd.flush()
  for i in (11, 10, 9, 8):
    np.testing.assert_array_equal(ffi_load(hs[i], xs[i], 950 + i), xs[i])
  ssd.flush()
  held = ssd.stats()
  assert held["disk_bytes_read"] - held["disk_loaded_bytes"] == 4 * 32 * KiB, held  # premise

  done = []
  t = threading.Thread(
    target=lambda: done.append(
      jax.block_until_ready([ffi_store(x, 950 + i) for i, x in enumerate(xs) if i >= 12])
    ),
    daemon=True,
  )
  t.start()
  t.join(HANG_S)
  assert done, "stores hung behind reads ahead"
  hs += done[0]
  s = ssd.stats()
  assert s["bounce_writes"] - held["bounce_writes"] == 4, s
  for i in list(range(15, 11, -1)) + list(range(7, -1, -1)):
    np.testing.assert_array_equal(ffi_load(hs[i], xs[i], 950 + i), xs[i])
  ssd.flush()
  s = ssd.stats()
  assert s["disk_bytes_read"] == s["disk_loaded_bytes"] and s["disk_unused_bytes"] == 0, s


def test_loads_out_of_store_order(tmp_path):
  # Stores 18 tensors of three sizes, then loads them newest first in groups of three whose
  # order inside the group is shuffled (as XLA orders the loads of one layer), loading the
  # first tensor stored again after each group (a residual used by every layer).
  sizes = [(16 + 16 * (i % 3)) * KiB for i in range(18)]
  xs = [jnp.arange(n // 4, dtype=jnp.float32) + i for i, n in enumerate(sizes)]
  order = [j for g in range(5, -1, -1) for j in (3 * g + 1, 3 * g + 2, 3 * g)]

  def run():
    hs = [ffi_store(x, 900 + i) for i, x in enumerate(xs)]
    diff = 0.0
    for k, i in enumerate(order):
      for j in (i, 0) if k % 3 == 2 else (i,):
        y = ffi_load(hs[j], xs[j], 900 + j)
        diff = max(diff, float(np.max(np.abs(np.asarray(y) - np.asarray(xs[j])))))
    return diff

  step = sum(sizes)
  check(sweep(run, tmp_path / "s", 16 * KiB, step), step)


@pytest.mark.slow  # 4 devices; the read-ahead order is checked on one in the README's command
def test_tensor_parallel_on_4_devices(tmp_path):
  records = run_worker("_readahead_worker.py", JAX_PLATFORMS="cpu", SSD_RA_DIR=tmp_path / "s")
  check(records, 4 * 6 * 96 * KiB)


def test_optimizer_state_is_read_ahead_in_its_store_order(tmp_path):
  # A step loads the optimizer state in the order the step before stored it (chunk by chunk,
  # leaf by leaf), the reverse of activations: after each load the read-ahead takes the
  # entries that execution stored next. The newest-first read-ahead of activations took this
  # step's own new state (or the old state's last chunks): no load found its chunk read ahead.
  # On the CPU backend on every machine; test_gpu runs the same check through the CUDA handlers.
  check_state_read_ahead_in_store_order(tmp_path, jax.devices("cpu")[0])


def _scan_step(tags, location):
  """One jitted gradient step of a 6-layer scan storing "a" (32 KiB) and "b" (64 KiB) a layer
  at ``location``."""
  L, B, H = 6, 32, 256

  def layer(w, x):
    a = checkpoint_name(jnp.tanh(x @ w), "a")
    b = checkpoint_name(jnp.sin(jnp.concatenate([a, x], axis=1)), "b")
    return x + a * b[:, :H]

  f = jax.checkpoint(layer, policy=ssd.offload_policy(tags, location=location, min_bytes=0))
  loss = lambda w, x: jnp.sum(jax.lax.scan(lambda c, wi: (f(wi, c), None), x, w)[0] ** 2)
  w = jax.random.normal(jax.random.key(0), (L, H, H)) / 16
  x = jax.random.normal(jax.random.key(1), (B, H))
  step = jax.jit(jax.grad(loss))
  return lambda: jax.block_until_ready(step(w, x))


def test_a_file_tensor_too_large_to_read_ahead_is_warned_about_once(tmp_path):
  import warnings

  # 64 KiB tensors to the files, a 48 KiB host cache: never read ahead, and said once
  ssd.configure(tmp_path / "t", host_cache_bytes="48KiB", prefetch_bytes="1MiB")
  step = _scan_step(("b",), "nvme")
  with pytest.warns(
    RuntimeWarning, match=r"tensor of 64KiB to the files.*host_cache_bytes='128KiB'"
  ):
    step()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step()  # warned once per configuration
    ssd.flush()
    s = ssd.stats()
    assert s["disk_bytes_read"] > 0 and s["prefetch_issued"] == 0, s  # what the warning says
    # the cache it names reads them ahead
    ssd.configure(tmp_path / "r", host_cache_bytes="128KiB", prefetch_bytes="128KiB")
    step = _scan_step(("b",), "nvme")
    step(), step()
    ssd.flush()
    assert ssd.stats()["prefetch_issued"] > 0, ssd.stats()
    # the same tensors in the host tier, or under an unbounded read-ahead off: nothing to say
    ssd.configure(tmp_path / "u", host_cache_bytes="48KiB", host_tier_bytes="16MiB")
    _scan_step(("a", "b"), "host")()
    ssd.configure(tmp_path / "v", host_cache_bytes="48KiB", prefetch_bytes=0)
    _scan_step(("a", "b"), "nvme")()
    # a cache and a budget that hold the largest tensor: nothing to say
    ssd.configure(tmp_path / "w", host_cache_bytes="256KiB", prefetch_bytes="64KiB")
    _scan_step(("a", "b"), "host,nvme")()
  # the budget, not only the cache, binds; host,nvme spills to the files
  ssd.configure(tmp_path / "x", host_cache_bytes="1MiB", prefetch_bytes="60KiB")
  with pytest.warns(RuntimeWarning, match=r"prefetch_bytes \(60KiB\)"):
    _scan_step(("b",), "host,nvme")()


def test_the_read_ahead_rule_counts_file_tensors_in_pages():
  from jax_ssdtrain._src import attributes
  from jax_ssdtrain._src.config import StoreConfig, too_large_to_read_ahead

  nvme, host, both = attributes.TIER_NVME, attributes.TIER_HOST, attributes.TIER_HOST_THEN_NVME
  cfg = StoreConfig(host_cache_bytes=8192, prefetch_bytes=1 << 20)
  assert too_large_to_read_ahead([("a", 8192, nvme), ("b", 1 << 20, host)], cfg) == 0
  assert too_large_to_read_ahead([("a", 8193, nvme)], cfg) == 12288  # 3 pages of 4 KiB
  assert too_large_to_read_ahead([("a", 4096, nvme), ("b", 9000, both)], cfg) == 12288
  cfg = StoreConfig(host_cache_bytes=1 << 20, prefetch_bytes=4096)
  assert too_large_to_read_ahead([("a", 4097, nvme)], cfg) == 8192
  assert too_large_to_read_ahead([("a", 4097, nvme)], StoreConfig(prefetch_bytes=0)) == 0
