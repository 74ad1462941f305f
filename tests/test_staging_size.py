"""The staging arena's size under ``staging_bytes="auto"``: the rule (options/staging.py), the
option, the engine line it reaches, and the size a program that stores chooses on the CPU."""

import errno
import logging
import warnings

import jax
import jax.numpy as jnp
import pytest
from _common import gpus
from _ffi_common import random_bytes, raw_load, raw_store, same, settled_stats
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import attributes, config, lifetimes, native, options, primitives
from jax_ssdtrain._src.options import device_free, staging

MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# The rule


def test_layers_start_where_a_name_repeats():
  stores = [("x", 4), ("qkv", 12), ("mlp", 16), ("x", 4), ("qkv", 12), ("mlp", 16), ("x", 1)]
  assert staging.layers_of(stores) == [[4, 12, 16], [4, 12, 16], [1]]
  assert staging.layers_of([("a", 1), ("b", 2), ("c", 3)]) == [[1, 2, 3]]
  assert staging.layers_of([]) == []


def test_arena_holds_the_largest_layer_within_the_budget():
  layers = [[1 * GiB, 3 * GiB, 1 * GiB, 4 * GiB], [2 * GiB]]
  assert staging.arena_bytes(layers, budget=None) == 9 * GiB  # the largest layer's bytes
  assert staging.arena_bytes(layers, budget=6 * GiB) == 6 * GiB  # capped by the budget
  assert staging.arena_bytes(layers, budget=2 * GiB) == 2 * GiB  # below the largest tensor
  assert staging.arena_bytes([[5 * MiB + 1]], budget=None, floor=0) == 6 * MiB  # MiB multiples
  assert staging.arena_bytes([[5 * MiB]], budget=None) == staging.FLOOR_BYTES  # the floor
  assert staging.arena_bytes([[5 * MiB]], budget=256 * MiB) == 256 * MiB  # floor under budget
  assert staging.arena_bytes([], budget=None, floor=0) == 0
  assert staging.arena_bytes([[GiB]], budget=-5) == 0


def test_arena_refuses_what_is_not_a_size():
  with pytest.raises(ValueError, match=r"layers\[1\]: expected sizes in bytes.*1.5"):
    staging.arena_bytes([[1], [1.5]], budget=None)
  with pytest.raises(ValueError, match="budget: expected a size in bytes or None, got '1G'"):
    staging.arena_bytes([[1]], budget="1G")


def test_device_budget_is_half_of_what_the_program_leaves():
  # XLA's pool preallocated: CUDA's free memory is outside it, all of it the arena's to share
  assert staging.device_budget(7 * GiB) == 7 * GiB // 2
  assert staging.device_budget(7 * GiB, xla_more_bytes=-3 * GiB) == 7 * GiB // 2
  # a growing pool: what XLA still takes from CUDA for the program is not the arena's
  assert staging.device_budget(100 * GiB, xla_more_bytes=60 * GiB) == 20 * GiB
  assert staging.device_budget(10 * GiB, xla_more_bytes=12 * GiB) == 0


class _Executable:
  """What program_budget reads of a compiled program, on a fake device."""

  def __init__(self, stats):
    self.stats = stats

  def get_compiled_memory_stats(self):
    return type("Analysis", (), {"temp_size_in_bytes": 30 * GiB, "output_size_in_bytes": GiB})()

  def local_devices(self):
    stats = self.stats
    return [
      type("Device", (), {"id": 0, "local_hardware_id": 0, "memory_stats": lambda d: stats})()
    ]


def test_program_budget_reads_the_device(monkeypatch):
  monkeypatch.setattr(device_free, "cuda_free_bytes", lambda ids: {0: 40 * GiB})
  grown = {"bytes_in_use": 20 * GiB, "pool_bytes": 25 * GiB, "bytes_limit": 130 * GiB}
  # XLA still takes 20 + 30 + 1 - 25 = 26 GiB from CUDA: half of the 14 GiB left
  assert device_free.program_budget(_Executable(grown)) == 7 * GiB
  preallocated = {"bytes_in_use": 20 * GiB, "pool_bytes": 130 * GiB, "bytes_limit": 130 * GiB}
  assert device_free.program_budget(_Executable(preallocated)) == 20 * GiB
  assert device_free.program_budget(_Executable(None)) is None  # the CPU reports nothing
  monkeypatch.setattr(device_free, "cuda_free_bytes", lambda ids: None)
  assert device_free.program_budget(_Executable(grown)) is None  # no CUDA runtime
  assert device_free.program_budget(None) is None


# ---------------------------------------------------------------------------------------------
# The option and the engine line


def test_auto_is_the_default_and_parses(monkeypatch):
  assert ssd.StoreConfig().staging_bytes is None
  assert ssd.StoreConfig().staging_max_bytes == 16 * GiB
  opt = options.BY_NAME["staging_bytes"]
  assert opt.read("auto") is None and opt.read(" AUTO ") is None and opt.read(None) is None
  assert opt.read("2GiB") == 2 * GiB and opt.read(0) == 0
  assert opt.read_text("auto") is None and opt.read_text("512MiB") == 512 * MiB
  with pytest.raises(ValueError, match="staging_bytes: cannot read 'lots' as a size"):
    ssd.configure(staging_bytes="lots")
  with pytest.raises(ValueError, match="staging_max_bytes: cannot read 'auto' as a size"):
    ssd.configure(staging_max_bytes="auto")
  monkeypatch.setenv("SSDTRAIN_STAGING", "auto")
  monkeypatch.setenv("SSDTRAIN_STAGING_MAX", "3GiB")
  cfg = options.from_environment()
  assert (cfg.staging_bytes, cfg.staging_max_bytes) == (None, 3 * GiB)
  monkeypatch.setenv("SSDTRAIN_STAGING", "1.5GiB")
  assert options.from_environment().staging_bytes == 3 * GiB // 2


def test_the_chosen_size_reaches_the_engine_lines(tmp_path):
  auto = options.StoreConfig()
  dirs = (str(tmp_path),)
  assert options.engine_options(auto, dirs)["staging_bytes"] == str(staging.FLOOR_BYTES)
  lines = options.engine_options(auto, dirs, staging_bytes=9 * GiB)
  assert lines["staging_bytes"] == str(9 * GiB)
  assert "staging_max_bytes" not in lines  # Python's alone: the engine refuses unknown keys
  explicit = options.StoreConfig(staging_bytes=3 * MiB)
  assert options.engine_options(explicit, dirs, staging_bytes=9 * GiB)["staging_bytes"] == str(
    3 * MiB
  )
  assert "staging_bytes=9663676416\n" in options.engine_text(lines)


# ---------------------------------------------------------------------------------------------
# A program that stores sizes the arena (CPU: the size the engine is configured with)


@pytest.fixture
def small_floor(monkeypatch):
  """A floor of 0, so that the test's small layers size the arena; a fresh process state."""
  for name in ("SSDTRAIN_STAGING", "SSDTRAIN_STAGING_MAX"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(staging, "FLOOR_BYTES", 0)
  config.reset_to_unconfigured()
  yield
  config.reset_to_unconfigured()


def _step(layers, rows):
  def loss(w, x):
    for _ in range(layers):
      x = checkpoint_name(jnp.sin(x @ w), "h")
      x = checkpoint_name(jnp.cos(x), "g")
    return jnp.sum(x * x)

  policy = ssd.offload_policy(["h", "g"], min_bytes=0)
  f = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))
  return lambda: f(jnp.ones((256, 256)) * 0.01, jnp.ones((rows, 256))).block_until_ready()


def test_a_program_lists_its_stores_at_lowering():
  def body(x, _):
    x = checkpoint_name(jnp.sin(x), "h")
    return checkpoint_name(jnp.cos(x), "g"), None

  def loss(x):
    return jnp.sum(jax.lax.scan(body, x, None, length=6)[0])

  policy = ssd.offload_policy(["h", "g"], min_bytes=0)
  jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(loss, policy=policy)))(jnp.ones((64, 32)))
  counted = lifetimes.analyze(
    jaxpr, store_p=primitives.store_p, load_ps=primitives.LOAD_PRIMITIVES, copy_p=primitives.copy_p
  )
  stores = lifetimes.program_stores(jaxpr, store_p=primitives.store_p, counted=counted)
  nvme = attributes.TIER_NVME  # offload_policy's default location
  assert stores == [("h", 64 * 32 * 4, nvme), ("g", 64 * 32 * 4, nvme)]  # the scan body once


def test_stores_only_later_programs_load_do_not_size_the_arena():
  def save(x):  # as an optimizer's state: loaded by later executions, oldest first
    y = jnp.sin(x)
    kept = primitives.store_p.bind(y, site=7, tier=1, name="state", uses=lifetimes.LATER_IN_ORDER)
    never = primitives.store_p.bind(y, site=8, tier=1, name="unused", uses=0)
    return kept[1], never[1]

  jaxpr = jax.make_jaxpr(save)(jnp.ones((64, 32)))
  assert lifetimes.program_stores(jaxpr, store_p=primitives.store_p) == []
  escaping = jax.make_jaxpr(
    lambda x: primitives.store_p.bind(x, site=9, tier=1, name="h", uses=None)
  )
  # a handle that leaves its program (uncounted): its loads come later, its store is in flight
  stores = lifetimes.program_stores(escaping(jnp.ones((8,))), store_p=primitives.store_p)
  assert stores == [("h", 32, 1)]  # (name, bytes, tier)


def test_first_program_sizes_the_arena(small_floor, caplog):
  with caplog.at_level(logging.INFO, logger="jax_ssdtrain"):
    _step(layers=3, rows=1024)()  # two tags of 1 MiB a layer
  assert ssd.stats()["staging_bytes"] == 2 * MiB
  assert native.engine_config()["staging_bytes"] == str(2 * MiB)
  chosen = [r.getMessage() for r in caplog.records if "staging_bytes=auto" in r.getMessage()]
  assert len(chosen) == 1 and "a 2MiB staging arena" in chosen[0], chosen


def test_an_open_store_that_stored_nothing_opens_again_larger(small_floor, tmp_path):
  ssd.configure(tmp_path / "s")
  assert ssd.stats()["staging_bytes"] == 0  # the floor: nothing run yet
  _step(layers=2, rows=2048)()
  assert ssd.stats()["staging_bytes"] == 4 * MiB
  _step(layers=2, rows=1024)()  # a smaller program: the arena never shrinks
  assert ssd.stats()["staging_bytes"] == 4 * MiB


def test_an_arena_that_holds_entries_grows(small_floor):
  _step(layers=2, rows=1024)()
  ssd.flush()  # on a GPU the step's last entries are released after its outputs are ready
  assert ssd.stats()["staging_bytes"] == 2 * MiB and ssd.stats()["live_entries"] == 0
  keep = jax.jit(lambda x: primitives.store_p.bind(x, site=77, tier=1, name="kept", uses=None))
  handle = keep(jnp.ones((4096,)))[1].block_until_ready()  # an entry: its handle escapes
  ssd.flush()
  assert ssd.stats()["live_entries"] == 1
  _step(layers=2, rows=4096)()  # 8 MiB a layer
  assert ssd.stats()["staging_bytes"] == 8 * MiB
  assert native.engine_config()["staging_bytes"] == str(8 * MiB)
  del handle


def test_an_arena_that_cannot_grow_is_warned_about_once(small_floor, monkeypatch):
  _step(layers=2, rows=1024)()

  def busy(nbytes):
    raise OSError(errno.EBUSY, "the staging arena of GPU 0 is not grown: a copy in flight")

  monkeypatch.setattr(native, "grow_staging", busy)
  with pytest.warns(RuntimeWarning, match="needs a 8MiB staging arena.*could not grow.*in flight"):
    _step(layers=2, rows=4096)()
  assert ssd.stats()["staging_bytes"] == 2 * MiB
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _step(layers=2, rows=8192)()  # warned once
  assert ssd.stats()["staging_bytes"] == 2 * MiB


def test_the_engine_grows_its_arena_and_never_shrinks_it(tmp_path):
  with ssd.configured(tmp_path / "s", staging_bytes="2MiB"):
    native.grow_staging(1 * MiB)
    assert native.engine_config()["staging_bytes"] == str(2 * MiB)
    native.grow_staging(6 * MiB)
    assert native.engine_config()["staging_bytes"] == str(6 * MiB)
    assert ssd.stats()["staging_bytes"] == 6 * MiB


def test_explicit_staging_and_the_cap_keep_their_meaning(small_floor, tmp_path):
  ssd.configure(tmp_path / "s", staging_bytes="3MiB")
  _step(layers=2, rows=4096)()
  assert ssd.stats()["staging_bytes"] == 3 * MiB
  config.reset_to_unconfigured()
  ssd.configure(tmp_path / "t", staging_max_bytes="5MiB")
  with pytest.warns(RuntimeWarning, match="leaves a 5MiB staging arena, smaller than the largest"):
    _step(layers=1, rows=8192)()  # tensors of 8 MiB: the cap leaves 5 MiB
  assert ssd.stats()["staging_bytes"] == 5 * MiB
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _step(layers=1, rows=8192)()  # warned once


# ---------------------------------------------------------------------------------------------
# GPU: an arena that holds copies grows between programs


@pytest.mark.gpu
def test_gpu_arena_grows_keeping_the_copies_it_held(tmp_path):
  """Host-tier stores whose copies sit in a 4 MiB arena (the newest with its host copy
  deferred): growing it to 16 MiB issues their host copies first, and every one loads back bit
  for bit; a 12 MiB tensor then goes through the new arena whole."""
  ssd.configure(tmp_path / "s", staging_bytes="4MiB", host_tier_bytes="64MiB")
  dev = gpus()[0]
  xs = [random_bytes(3 * MiB + 5, i, dev) for i in range(3)]
  hs = [raw_store(x, site=11 + i, tier=1, name=f"kept{i}", uses=1) for i, x in enumerate(xs)]
  jax.block_until_ready(hs)
  assert settled_stats()[f"device{dev.id}_staging_bytes"] == 4 * MiB
  native.grow_staging(16 * MiB)
  s = settled_stats()
  assert s[f"device{dev.id}_staging_bytes"] == 16 * MiB and s["staging_bytes_in_use"] == 0
  assert native.engine_config()["staging_bytes"] == str(16 * MiB)
  for i, (h, x) in enumerate(zip(hs, xs)):
    same(raw_load(h, x, site=11 + i, tier=1, name=f"kept{i}"), x)
  native.reset_stats()
  big = random_bytes(12 * MiB, 9, dev)
  h = raw_store(big, site=20, tier=1, name="big", uses=1)
  same(raw_load(h, big, site=20, tier=1, name="big"), big)
  s = settled_stats()
  assert s["staging_direct_stores"] == 0 and s["stall_seconds"] == 0, s
  native.release_all()
  config.reset_to_unconfigured()


@pytest.mark.gpu
def test_gpu_auto_arena_grows_for_the_larger_program(small_floor, tmp_path):
  """A small program's arena (2 MiB), an entry kept in it, then a program of 8 MiB layers: the
  arena grows before it runs, its stores fit whole, and its gradient is the device's bit for
  bit."""
  ssd.configure(tmp_path / "s")
  _step(layers=2, rows=1024)()
  keep = jax.jit(lambda x: primitives.store_p.bind(x, site=78, tier=1, name="kept", uses=None))
  handle = keep(jnp.ones((4096,)))[1]
  native.reset_stats()
  _step(layers=2, rows=4096)()
  s = settled_stats()
  assert ssd.stats()["staging_bytes"] == 8 * MiB
  assert ssd.device_stats()[0]["staging_bytes"] == 8 * MiB
  assert s["staging_direct_stores"] == 0, s

  def loss(w, x):
    for _ in range(2):
      x = checkpoint_name(jnp.sin(x @ w), "h")
      x = checkpoint_name(jnp.cos(x), "g")
    return jnp.sum(x * x)

  w, x = jnp.ones((256, 256)) * 0.01, jnp.ones((4096, 256))
  offload = ssd.offload_policy(["h", "g"], min_bytes=0, location="host")
  save = jax.checkpoint_policies.save_only_these_names("h", "g")  # the device's own saving
  offloaded, g = (jax.jit(jax.grad(jax.checkpoint(loss, policy=p)))(w, x) for p in (offload, save))
  assert jnp.array_equal(offloaded, g)
  del handle
