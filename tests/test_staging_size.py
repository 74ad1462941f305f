"""The staging arena's size under ``staging_bytes="auto"``: the rule (options/staging.py), the
option, the engine line it reaches, and the size a program that stores chooses on the CPU."""

import logging
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import config, lifetimes, native, options, primitives
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
  assert stores == [("h", 64 * 32 * 4), ("g", 64 * 32 * 4)]  # the scan body once: one layer


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
  assert stores == [("h", 32)]


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


def test_an_arena_that_holds_entries_is_not_resized(small_floor):
  _step(layers=2, rows=1024)()
  assert ssd.stats()["staging_bytes"] == 2 * MiB
  with pytest.warns(RuntimeWarning, match="needs a 8MiB staging arena.*not grown once it holds"):
    _step(layers=2, rows=4096)()
  assert ssd.stats()["staging_bytes"] == 2 * MiB


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
