"""jax_ssdtrain.checkpointing: Orbax checkpoints whose optimizer state is written straight from
the store, chunk by chunk, and restored into it the same way (scripts.training's save and
restore, and resuming bit for bit, are in test_optimizer.py)."""

import tracemalloc

import _checkpoint_common as ckpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _common import run_module

import jax_ssdtrain as ssd
from jax_ssdtrain import checkpointing
from jax_ssdtrain._src.optimizer import OffloadedState, OptimizerOffloadError

MiB = 1 << 20
CHUNK = 64 << 10


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=512 * MiB, host_tier_bytes=128 * MiB):
    yield


def _params(rows=1024, leaves=4, seed=0):
  keys = jax.random.split(jax.random.key(seed), leaves + 1)
  p = {f"w{i}": jax.random.normal(k, (rows, 256)) for i, k in enumerate(keys[:-1])}
  p["bias"] = jax.random.normal(keys[-1], (16,))  # below min_bytes: kept on the device
  return p


def _stepped(tx, params, steps=2):
  state = tx.init(params)
  grads = jax.tree.map(lambda p: 0.01 * jnp.cos(p), params)
  for _ in range(steps):
    _, state = jax.jit(tx.update)(grads, state, params)
  return state


def _host_leaves(tree):
  """Every leaf of ``tree`` as NumPy, each OffloadedState read out of the store."""
  return [
    np.asarray(x)
    for x in jax.tree.leaves(
      jax.tree.map(
        lambda x: ssd.state_to_host(x) if isinstance(x, OffloadedState) else x,
        tree,
        is_leaf=lambda x: isinstance(x, OffloadedState),
      )
    )
  ]


def _assert_leaves_equal(tree, want):
  """``tree``'s leaves (OffloadedStates read out of the store) equal ``want`` bit for bit."""
  for got, w in zip(_host_leaves(tree), want, strict=True):
    np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("location", ["host", "nvme", "device"])
def test_save_and_restore_a_tree_with_state_in_the_store(store, tmp_path, location):
  tx = ssd.offload_optimizer(optax.adamw(1e-3), location=location, chunk_bytes=CHUNK)
  params = _params()
  tree = {
    "params": params,
    "opt": _stepped(tx, params),
    "step": np.asarray(2, np.int32),
    "none": None,
  }
  manager = ckpt.saved(tmp_path / "ckpt", 2, tree)

  like = {"params": params, "opt": tx.init(params), "step": np.asarray(0, np.int32), "none": None}
  restored = checkpointing.restore(manager, like)
  assert isinstance(restored["opt"], OffloadedState) and restored["none"] is None
  assert restored["opt"].location == location
  _assert_leaves_equal(restored, _host_leaves(tree))
  # the restored state updates as the saved one does
  grads = jax.tree.map(jnp.ones_like, params)
  a = jax.jit(tx.update)(grads, restored["opt"], params)
  b = jax.jit(tx.update)(grads, tree["opt"], params)
  _assert_leaves_equal(a, _host_leaves(b))


def test_save_never_holds_the_whole_state_in_host_memory(store, tmp_path):
  # 4 leaves of 1 MiB with Adam's two moments (8 MiB of state) in chunks of 64 KiB: the save
  # holds about one chunk at a time; reading the state into host memory first (state_to_host,
  # what scripts.training's checkpoints did) holds all 8 MiB.
  tx = ssd.offload_optimizer(optax.adam(1e-3), location="host", chunk_bytes=CHUNK)
  params = _params()
  state = _stepped(tx, params)
  manager = ckpt.manager(tmp_path / "ckpt")

  def peak(fn):
    tracemalloc.start()
    try:
      fn()
      return tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()

  def save(step):
    manager.save(step, args=checkpointing.save_args({"opt": state}))
    # Orbax finalises a save on threads of its own: none may run past tracemalloc.stop() (a
    # race in CPython 3.11's tracemalloc crashed the process), nor past this test's store
    manager.wait_until_finished()

  save(0)  # compiles the chunk loads
  streamed = peak(lambda: save(1))
  manager.close()
  staged = peak(lambda: ssd.state_to_host(state))
  stored = state.layout.stored_bytes
  assert stored == 8 * MiB
  assert staged >= stored, (staged, stored)  # the measure sees whole-state copies
  print(f"peak traced: streamed {streamed} B, staged {staged} B, state {stored} B")
  assert streamed < stored / 4, (streamed, stored)


def test_a_save_is_complete_when_save_returns(store, tmp_path, monkeypatch):
  # Orbax may run a handler's save on a thread of its own; a state updated in place consumes
  # the chunks the save reads, so the save must be over when manager.save returns. A slow read
  # of the store (half a second before the first chunk) shows whether it is.
  import time

  tx = ssd.offload_optimizer(optax.adam(1e-3), location="host", chunk_bytes=CHUNK, in_place=True)
  params = _params()
  state = _stepped(tx, params, 1)
  want = _host_leaves({"opt": state})
  real = checkpointing.stream_out

  def slow(*args):
    time.sleep(0.5)
    return real(*args)

  monkeypatch.setattr(checkpointing, "stream_out", slow)
  manager = ckpt.manager(tmp_path / "ckpt")
  manager.save(1, args=checkpointing.save_args({"opt": state}))
  update = jax.jit(tx.update, donate_argnums=1)
  _, later = update(jax.tree.map(jnp.ones_like, params), state, params)  # consumes its chunks
  jax.block_until_ready(later)
  manager.wait_until_finished()
  _assert_leaves_equal(checkpointing.restore(manager, {"opt": later}), want)


def test_a_checkpoint_of_another_layout_is_refused(store, tmp_path):
  tx = ssd.offload_optimizer(optax.adam(1e-3), location="host", chunk_bytes=CHUNK)
  params = _params()
  manager = ckpt.saved(tmp_path / "ckpt", 1, {"opt": _stepped(tx, params)})

  other_shapes = _params(rows=512)
  with pytest.raises(OptimizerOffloadError, match=r"w0.*float32\[1024, 256\].*another layout"):
    checkpointing.restore(manager, {"opt": tx.init(other_shapes)})
  momentum = ssd.offload_optimizer(optax.sgd(0.1, momentum=0.9), location="host")
  with pytest.raises(OptimizerOffloadError, match="another structure"):
    checkpointing.restore(manager, {"opt": momentum.init(params)})
  with pytest.raises(OptimizerOffloadError, match="holds 1 optimizer state"):
    checkpointing.restore(manager, {"a": tx.init(params), "b": tx.init(params)})


@pytest.mark.parametrize("fails", ["when_issued", "when_waited"])
def test_a_failed_write_leaves_the_last_checkpoint(store, tmp_path, monkeypatch, fails):
  # A save keeps several chunks' writes in flight: a write may fail as it is issued, or later,
  # in its future (the disk fills while it runs). Either way the save raises and the last
  # checkpoint stays the latest.
  tx = ssd.offload_optimizer(optax.adam(1e-3), location="nvme", chunk_bytes=CHUNK)
  params = _params()
  first = _stepped(tx, params, 1)
  manager = ckpt.saved(tmp_path / "ckpt", 1, {"opt": first})
  want = _host_leaves({"opt": first})

  real_open, writes = checkpointing._open, []

  class Failed:  # a write future that fails when waited for
    def result(self):
      raise OSError(28, "No space left on device (injected)")

  class FullDisk:  # the third chunk written fails as a full disk would
    def __init__(self, array):
      self.array = array

    def __getitem__(self, index):
      return FullDisk(self.array[index])

    def write(self, value):
      writes.append(value.shape)
      if len(writes) == 3:
        if fails == "when_issued":
          raise OSError(28, "No space left on device (injected)")
        return Failed()
      return self.array.write(value)

  monkeypatch.setattr(checkpointing, "_open", lambda *a, **k: FullDisk(real_open(*a, **k)))
  with pytest.raises(OSError, match="injected"):
    manager.save(2, args=checkpointing.save_args({"opt": _stepped(tx, params, 2)}))
    manager.wait_until_finished()
  monkeypatch.undo()
  assert manager.latest_step() == 1
  restored = checkpointing.restore(ckpt.manager(tmp_path / "ckpt"), {"opt": tx.init(params)})
  _assert_leaves_equal(restored, want)


def test_a_plain_orbax_checkpoint_is_named_as_such(store, tmp_path):
  tx = ssd.offload_optimizer(optax.adam(1e-3), location="host", chunk_bytes=CHUNK)
  params = _params()
  manager = ckpt.manager(tmp_path / "ckpt")
  manager.save(1, args=ocp.args.StandardSave({"opt": ssd.state_to_host(tx.init(params))}))
  manager.wait_until_finished()
  with pytest.raises(ValueError, match="one unnamed item.*state_from_host"):
    checkpointing.restore(manager, {"opt": tx.init(params)})


def test_arguments_name_what_they_expect(tmp_path):
  handler = checkpointing.OptimizerStateHandler()
  from etils import epath

  with pytest.raises(TypeError, match=r"OptimizerStateSave.states: expected OffloadedStates"):
    handler.save(epath.Path(tmp_path), checkpointing.OptimizerStateSave([{"mu": 1}]))
  with pytest.raises(FileNotFoundError, match="no optimizer state layout"):
    handler.metadata(epath.Path(tmp_path))


@pytest.mark.slow  # a benchmark's smoke run in its own process (.ci/run's slow stage)
def test_bench_checkpoint_tiny(tmp_path):
  import json

  out = ["--out", tmp_path, "--ckpt-dir", tmp_path / "ckpt", "--store-dir", tmp_path / "store"]
  run_module("scripts.bench_checkpoint", "--tiny", *out)
  (path,) = tmp_path.glob("checkpoint_cpu_*.json")
  doc = json.loads(path.read_text())
  assert [r["variant"] for r in doc["rows"]] == ["streamed", "staged"]
  assert all(r["save_gbps"] > 0 and r["restore_gbps"] > 0 for r in doc["rows"])
  assert doc["disk"]["raw_write_gbps"] > 0
  assert not list((tmp_path / "ckpt").glob("streamed_*"))  # each repeat's checkpoint removed


def test_restore_into_an_abstract_state_made_by_eval_shape(store, tmp_path):
  # As frameworks restore: the target is jax.eval_shape of the initialisation (no state made,
  # nothing stored), and the restored state then serves the step compiled for init's state.
  tx = ssd.offload_optimizer(optax.adamw(1e-3), location="host", chunk_bytes=CHUNK)
  params = _params()
  tree = {"params": params, "opt": _stepped(tx, params)}
  want = _host_leaves(tree)
  manager = ckpt.saved(tmp_path / "ckpt", 2, tree)
  abstract = jax.eval_shape(lambda p: {"params": p, "opt": tx.init(p)}, params)
  assert jax.tree.structure(abstract) == jax.tree.structure(tree)
  restored = checkpointing.restore(manager, like=abstract)
  _assert_leaves_equal(restored, want)
  grads = jax.tree.map(jnp.ones_like, params)
  update = jax.jit(tx.update)
  u1, _ = update(grads, tree["opt"], params)
  u2, _ = update(grads, restored["opt"], params)
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_jitted_with_out_shardings(store):
  # jax.jit(tx.init, out_shardings=...) with the shardings of jax.eval_shape(tx.init, ...).
  tx = ssd.offload_optimizer(optax.adamw(1e-3), location="host", chunk_bytes=CHUNK)
  params = _params()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: device, jax.eval_shape(tx.init, params))
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  assert jax.tree.structure(state) == jax.tree.structure(shardings)
  _assert_leaves_equal(state, _host_leaves(tx.init(params)))
