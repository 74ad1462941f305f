"""Stored tensors live exactly while a load can still reach them (jax_ssdtrain/_src/lifetimes.py):
counted per execution at compile time, swept when their handle left the execution."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src import lifetimes, native, primitives
from jax_ssdtrain._src.lifetimes import UNCOUNTED


def analyze(jaxpr):
  """lifetimes.analyze with the primitives it counts (the package's lowering hook passes them)."""
  return lifetimes.analyze(
    jaxpr, store_p=primitives.store_p, load_ps=primitives.LOAD_PRIMITIVES, copy_p=primitives.copy_p
  )


POLICY = ssd.offload_policy(["h"], min_bytes=0)
OCCUPANCY = (
  "live_entries",
  "file_bytes_in_use",
  "host_cache_bytes_in_use",
  "host_tier_bytes_in_use",
)


@pytest.fixture
def store(tmp_path):
  with ssd.configured(
    str(tmp_path / "store"),
    capacity_bytes=1 << 30,
    host_cache_bytes=64 << 20,
    host_tier_bytes=64 << 20,
  ):
    ssd.reset_stats()
    yield


def block(w, x):
  return jnp.tanh(checkpoint_name(x @ w, "h"))


def loss(ws, x, policy=POLICY):
  for w in ws:
    x = jax.checkpoint(block, policy=policy)(w, x)
  return jnp.sum(x**2)


def weights(n=3, d=256):
  return [jax.random.normal(jax.random.key(i), (d, d)) / np.sqrt(d) for i in range(n)]


def occupancy():
  native.flush()  # writes that were running when their entry was released finish first
  s = native.stats()  # not ssd.stats()/flush(): those would sweep
  return {k: s[k] for k in OCCUPANCY}


EMPTY = dict.fromkeys(OCCUPANCY, 0)


# ---------------------------------------------------------------------------------------------
# Counted: released at the last load of the execution that stored them, no call from the user


def test_jitted_steps_with_changing_batch_leave_nothing(store):
  ws = weights()
  step = jax.jit(jax.grad(loss))
  ref = jax.jit(
    jax.grad(lambda ws, x: loss(ws, x, jax.checkpoint_policies.save_only_these_names("h")))
  )
  for batch in (64, 32, 17, 64, 5):  # each new shape is a new program with new tag sites
    x = jax.random.normal(jax.random.key(batch), (batch, 256))
    got = jax.block_until_ready(step(ws, x))
    assert occupancy() == EMPTY
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref(ws, x))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  s = native.stats()
  assert s["tensors_written"] == 5 * 3 and s["counted_releases"] == 5 * 3
  assert s["sweeps"] == 0 and s["uncounted_entries"] == 0


def test_hoisted_residual_loaded_every_iteration_then_released(store):
  # A loop-invariant residual (stored once, before the scan) is loaded by each iteration of
  # the backward scan: uses = length; released after the last.
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8

  g = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(x @ w, "h")), policy=POLICY)

  def f(x, ys):  # g(x) inside the loop depends on the loop-invariant x only
    out, _ = jax.lax.scan(lambda c, y: (c + jnp.sum(g(x) * y), None), 0.0, ys)
    return out

  x = jax.random.normal(jax.random.key(1), (8, 64))
  ys = jax.random.normal(jax.random.key(2), (5, 8, 64))
  grad = jax.jit(jax.grad(f))
  uses = analyze(jax.make_jaxpr(jax.grad(f))(x, ys))
  assert list(uses.values()) in ([5], [1])  # [1] where JAX does not hoist the residual
  jax.block_until_ready(grad(x, ys))
  assert occupancy() == EMPTY
  assert native.stats()["tensors_read"] == list(uses.values())[0]


def test_remat3_entries_released(store):
  ws = weights(2, 64)
  x = jax.random.normal(jax.random.key(3), (8, 64))
  with ji.remat3(True):
    jax.block_until_ready(jax.jit(jax.grad(loss))(ws, x))
  assert occupancy() == EMPTY
  assert native.stats()["counted_releases"] == 2


# ---------------------------------------------------------------------------------------------
# Handles that leave their execution: kept while an array holds them, then swept


def test_vjp_across_jits_lives_while_loadable(store):
  ws = weights(3, 64)
  x = jax.random.normal(jax.random.key(4), (16, 64))
  f = jax.jit(loss)
  _, vjp = jax.vjp(f, ws, x)
  _, ref_vjp = jax.vjp(
    jax.jit(lambda ws, x: loss(ws, x, jax.checkpoint_policies.save_only_these_names("h"))), ws, x
  )
  first = vjp(jnp.float32(1.0))
  _, other = jax.vjp(f, ws, 2 * x)  # another forward of the same program in between
  ssd.collect()  # and a sweep: nothing loadable may go
  second = vjp(jnp.float32(2.0))  # applied twice
  for got, want in ((first, ref_vjp(jnp.float32(1.0))), (second, ref_vjp(jnp.float32(2.0)))):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert native.stats()["live_entries"] == 6  # two forwards' entries, both still loadable
  del vjp
  gc.collect()
  assert ssd.collect() == 3  # the first forward's: no array holds their handles any more
  jax.block_until_ready(other(jnp.float32(1.0)))
  del other
  gc.collect()
  assert ssd.collect() == 3
  assert occupancy() == EMPTY


def test_eager_grad_swept_by_flush_and_by_itself(store):
  ws = weights(3, 64)
  x = jax.random.normal(jax.random.key(5), (16, 64))
  for _ in range(3):
    jax.block_until_ready(jax.grad(loss)(ws, x))  # eager: every store is its own execution
  assert native.stats()["uncounted_entries"] == 9
  ssd.flush()
  assert occupancy() == EMPTY
  # Without any call: past 64 uncounted entries a sweep is due; the next eager store (or the
  # background thread) runs it, so the store stays bounded.
  for _ in range(40):
    jax.block_until_ready(jax.grad(loss)(ws, x))
  assert native.stats()["sweeps"] >= 2
  assert native.stats()["live_entries"] < 64 + 3


def test_eager_remat3_grad_swept(store):
  # JAX's eager remat3 path left the trace of the backward's jaxpr alive, holding our handles
  # as its constants: no sweep could ever free them (found by JAX's RematTest under remat3).
  ws = weights(3, 64)
  x = jax.random.normal(jax.random.key(8), (16, 64))
  with ji.remat3(True):
    for _ in range(2):
      jax.block_until_ready(jax.grad(loss)(ws, x))
    _, vjp = jax.vjp(loss, ws, x)
    gc.collect()
    ssd.flush()
    assert native.stats()["live_entries"] == 3  # the held vjp's entries only
    jax.block_until_ready(vjp(jnp.float32(1.0)))
    del vjp
  gc.collect()
  ssd.flush()
  assert occupancy() == EMPTY


def test_eager_remat3_grad_of_scan_swept(store):
  # The same trace held a scan's stacked handles, which no rem of ours binds (found by the
  # relaxed variant of JAX's ActivationOffloadingTest test_remat_scan_jaxpr_offloadable).
  ws = jnp.stack(weights(4, 32))
  x = jax.random.normal(jax.random.key(9), (8, 32))

  def scanned(ws, x):
    y, _ = jax.lax.scan(lambda c, w: (block(w, c), None), x, ws)
    return jnp.sum(y**2)

  with ji.remat3(True):
    f = jax.checkpoint(scanned, policy=POLICY)
    for _ in range(2):
      jax.block_until_ready(jax.grad(f)(ws, x))
  assert native.stats()["tensors_written"] == 8
  gc.collect()
  ssd.flush()
  assert occupancy() == EMPTY


def test_dropped_vjp_is_swept(store):
  ws = weights(2, 64)
  x = jax.random.normal(jax.random.key(6), (16, 64))
  jax.vjp(jax.jit(loss), ws, x)  # never applied
  gc.collect()
  assert native.stats()["live_entries"] == 2
  ssd.collect()
  assert occupancy() == EMPTY


# ---------------------------------------------------------------------------------------------
# The compile-time count itself


def _uses(fn, *args):
  return sorted(analyze(jax.make_jaxpr(fn)(*args)).values())


def test_analysis_counts():
  ws = weights(2, 32)
  x = jnp.ones((4, 32))
  assert _uses(jax.grad(loss), ws, x) == [1, 1]

  def scanned(ws, x):  # stacked handles: one entry per iteration, each loaded once
    y, _ = jax.lax.scan(
      lambda c, w: (jax.checkpoint(block, policy=POLICY)(w, c), None), x, jnp.stack(ws)
    )
    return jnp.sum(y)

  assert _uses(jax.grad(scanned), ws, x) == [1]

  def nested(ws, xs):  # scan of micro-batches around a scan of layers (grad accumulation)
    g = jax.grad(scanned)
    acc, _ = jax.lax.scan(
      lambda a, x: (jax.tree.map(jnp.add, a, g(ws, x)), None), jax.tree.map(jnp.zeros_like, ws), xs
    )
    return acc

  assert _uses(nested, ws, jnp.ones((3, 4, 32))) == [1]
  assert _uses(jax.jit(jax.grad(loss)), ws, x) == [1, 1]  # through a nested jit
  assert _uses(jax.vmap(jax.grad(loss), (None, 0)), ws, jnp.ones((2, 4, 32))) == [1, 1]


def test_analysis_gives_up_where_it_cannot_count():
  ws = weights(1, 32)
  x = jnp.ones((4, 32))
  # The handle leaves the program (a vjp's residuals): swept, not counted.
  assert _uses(lambda ws, x: jax.vjp(lambda ws: loss(ws, x), ws)[1], ws, x) == [UNCOUNTED]

  def in_cond(ws, x, p):
    return jax.lax.cond(p, lambda: jax.grad(loss)(ws, x), lambda: jax.tree.map(jnp.zeros_like, ws))

  assert _uses(in_cond, ws, x, True) == [UNCOUNTED]


def test_lowering_passes_the_count_to_the_store():
  ws = weights(1, 32)
  text = jax.jit(jax.grad(loss)).lower(ws, jnp.ones((4, 32))).as_text()
  assert "ssdtrain_store" in text and "uses = 1" in text
  text = (
    jax.jit(lambda ws, x: jax.vjp(lambda ws: loss(ws, x), ws)[1])
    .lower(ws, jnp.ones((4, 32)))
    .as_text()
  )
  assert "uses = -1" in text


# ---------------------------------------------------------------------------------------------
# Soak: many steps, several programs, nothing grows


def test_soak_shapes_programs_eager_and_jit(store):
  ws = weights(3, 32)
  train = jax.jit(jax.grad(loss))
  evaluate = jax.jit(loss)  # no backward: stores nothing
  shapes = (8, 5, 3)
  after_first_round = None
  for step in range(1000):
    x = jnp.full((shapes[step % 3], 32), 0.01 * (step % 7))
    if step % 50 == 49:
      jax.block_until_ready(jax.grad(loss)(ws, x))  # eager now and then
    elif step % 4 == 3:
      jax.block_until_ready(evaluate(ws, x))
    else:
      jax.block_until_ready(train(ws, x))
    if step % 100 == 99:
      ssd.flush()
      now = occupancy()
      if after_first_round is None:
        after_first_round = now
      assert now == after_first_round == EMPTY, (step, now)
  s = native.stats()
  assert s["tensors_written"] > 2000 and s["live_entries"] == 0


def test_a_sweep_whose_snapshot_was_donated_releases_nothing(store, monkeypatch):
  # The sweeper snapshots the live arrays, then waits for them. Were an array of the snapshot
  # donated to a program dispatched meanwhile, that program may still load the entries the
  # array held, and its own results are not in the snapshot: the sweep must release nothing
  # (it did release them once, when waiting skipped the donated array as a failed one).
  from jax_ssdtrain._src import lifetimes

  ws = weights(3, 64)
  x = jax.random.normal(jax.random.key(4), (16, 64))
  _, vjp = jax.vjp(jax.jit(loss), ws, x)  # entries held by the arrays of vjp's residuals
  held = [a for a in jax.tree.leaves(vjp) if isinstance(a, jax.Array) and a.dtype == jnp.uint32]
  jax.block_until_ready(held)
  assert held and native.stats()["live_entries"] == 3
  snapshot = lifetimes.live_arrays()
  jax.jit(lambda hs: [h + 0 for h in hs], donate_argnums=0)(held)  # donated after the snapshot
  monkeypatch.setattr(lifetimes, "live_arrays", lambda s=snapshot: s)
  assert ssd.collect() == 0
  assert native.stats()["live_entries"] == 3
  monkeypatch.undo()
  del vjp, held, snapshot
  gc.collect()
  assert ssd.collect() == 3


def test_a_background_sweep_during_a_dispatch_releases_nothing(store, monkeypatch):
  # The window of the dispatch itself: the donated state is deleted (and no longer listed), the
  # step's results do not exist yet (the dispatch has not returned), its loads may still come.
  # A sweep on another thread can fall in it (seen on the GPU: 2 H200, bench_optimizer and
  # bench_accumulate, 2026-11-25, "activation was already released"); the background sweeper
  # releases only what the sweep before it also found unreferenced.
  import optax

  from jax_ssdtrain._src import lifetimes

  tx = ssd.offload_optimizer(optax.sgd(1e-2, momentum=0.9), min_bytes=0, chunk_bytes=4096)
  params = {"w": jnp.ones((64, 64))}
  step = jax.jit(lambda s: tx.update(params, s, params)[1], donate_argnums=0)
  state = jax.block_until_ready(step(tx.init(params)))
  monkeypatch.setattr(lifetimes, "_previous", None)
  lifetimes._sweep(background=True)  # the sweep before: the state's handles are live
  real = lifetimes.live_arrays
  before = {id(a) for a in real()}
  results = jax.block_until_ready(step(state))  # the state donated; its results hidden below
  monkeypatch.setattr(lifetimes, "live_arrays", lambda: [a for a in real() if id(a) in before])
  lifetimes._sweep(background=True)  # may release the init's version, dead at both sweeps
  per_version = results.handles[0].shape[0]
  stats = native.stats()
  assert stats["live_entries"] == 2 * per_version  # the step's input and its results
  assert stats["retired_entries"] == per_version  # the init's version: retired, not released
  monkeypatch.undo()
  assert ssd.collect() == 2 * per_version  # on this thread: the input and the retired version
  assert native.stats()["retired_entries"] == 0
  del results


def test_sweeps_that_fall_inside_one_dispatch_retire_what_the_step_still_loads(store, monkeypatch):
  # Where XLA runs a program while dispatching it (the GPU; seen there with the optimizer state
  # in nvme, 2026-11-25: its writes through a bounce buffer made a dispatch seconds long) two
  # background sweeps fall inside one dispatch: both find the donated state unreferenced.
  # Here both run in a callback that the state's handles pass through before the loads.
  import optax
  from jax.experimental import io_callback

  from jax_ssdtrain._src import lifetimes

  tx = ssd.offload_optimizer(optax.sgd(1e-2, momentum=0.9), min_bytes=0, chunk_bytes=4096)
  params = {"w": jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)}
  grads = jax.tree.map(lambda p: 0.5 * p, params)
  real = lifetimes.live_arrays
  before: set[int] = set()

  def sweep_twice(state):
    monkeypatch.setattr(lifetimes, "live_arrays", lambda: [a for a in real() if id(a) in before])
    lifetimes._sweep(background=True)  # the state is donated and the results are hidden:
    lifetimes._sweep(background=True)  # dead at two sweeps in a row
    monkeypatch.setattr(lifetimes, "live_arrays", real)
    return state

  def update(state):
    state = io_callback(sweep_twice, state, state, ordered=True)
    return tx.update(grads, state, params)[1]

  step = jax.jit(update, donate_argnums=0)
  state = jax.block_until_ready(step(tx.init(params)))
  per_version = state.handles[0].shape[0]
  monkeypatch.setattr(lifetimes, "_previous", None)
  lifetimes._sweep(background=True)  # the state's handles are live here
  before.update(id(a) for a in real())
  revived = native.stats()["revived_entries"]
  state = jax.block_until_ready(step(state))  # its loads find the retired entries
  assert native.stats()["revived_entries"] - revived == per_version

  on_device = ssd.offload_optimizer(
    optax.sgd(1e-2, momentum=0.9), location="device", min_bytes=0, chunk_bytes=4096
  )
  device_step = jax.jit(lambda s: on_device.update(grads, s, params)[1])
  expected = device_step(device_step(on_device.init(params)))
  got = ssd.optimizer_state(state)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(ssd.optimizer_state(expected))):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def _escaping_store(tier: int):
  """A jitted store whose handle leaves the execution (an uncounted entry, for sweeps)."""
  from jax_ssdtrain._src.primitives import store_p

  return jax.jit(lambda x: store_p.bind(x, site=991, tier=tier, name="t", uses=None)[1])


@pytest.mark.parametrize("bandwidth_cap", [None, "2MB/s"])
def test_a_retired_entry_gives_its_room_to_the_next_store(tmp_path, bandwidth_cap, monkeypatch):
  # Retired entries hold their room until a store needs it (oldest first): they never fill it.
  # A retired entry whose write is still running gives its room back when the write ends: the
  # store waits for it (capped at 2 MB/s, the four writes take half a second; a loaded CI
  # machine once got here before they had ended, and the store called the space full).
  from jax_ssdtrain._src import lifetimes

  # The test's own sweeps only: a background sweep between them moves what they retire.
  monkeypatch.setattr(native, "sweep_requested", lambda: False)
  with ssd.configured(
    str(tmp_path / "s"),
    capacity_bytes=1 << 20,
    host_cache_bytes=1 << 20,
    bandwidth_cap=bandwidth_cap,
  ):
    store = _escaping_store(0)
    x = jnp.ones((64, 1024), jnp.float32)  # 256 KiB: four fill the file space
    for _ in range(3):
      jax.block_until_ready([store(x) for _ in range(4)])  # dropped at once
      lifetimes._sweep(background=True)
      lifetimes._sweep(background=True)
      assert native.stats()["retired_entries"] == 4
    stats = native.stats()
    assert stats["retired_reclaimed"] == 8
    assert stats["file_bytes_in_use"] == 1 << 20
    assert ssd.collect() == 4


def test_a_reconfigured_store_forgets_the_last_background_sweep(tmp_path):
  # The background sweeper compares each sweep with the one before; a new engine numbers its
  # entries from 1 again, so a snapshot of the old one would let its first sweep act alone.
  from jax_ssdtrain._src import lifetimes

  with ssd.configured(str(tmp_path / "a")):
    store = _escaping_store(1)
    jax.block_until_ready([store(jnp.ones(8)) for _ in range(3)])
    lifetimes._sweep(background=True)
    with ssd.configured(str(tmp_path / "b")):
      jax.block_until_ready(store(jnp.ones(8)))
      assert lifetimes._sweep(background=True) == 0  # the first sweep of this engine
      assert lifetimes._sweep(background=True) == 1
