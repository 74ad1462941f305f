"""Checkpoints of streamed layer stacks (jax_ssdtrain.checkpointing with
jax_ssdtrain._src.layer_stream's StreamedStack and StreamedOptState): a stack in the store saved
layer by layer and restored into the store bit for bit, a training run resumed from a
checkpoint equal to one never stopped, a checkpoint of another layout refused naming the
difference, a multi-process run refused."""

import _checkpoint_common as ckpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ssdtrain as ssd
from jax_ssdtrain import checkpointing
from jax_ssdtrain._src.layer_stream import StreamedOptState, StreamedStack

MiB = 1 << 20
D, V, OUT = 8, 4, 3  # width, input features, outputs


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=128 * MiB, host_tier_bytes=32 * MiB):
    yield


def _init_layer(key, width=D):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "w": jax.random.normal(k1, (width, width)) / np.sqrt(width),
    "v": (jax.random.normal(k2, (width, width)) / np.sqrt(width)).astype(jnp.bfloat16),
    "b": 0.1 * jax.random.normal(k3, (width,)),
  }


def _block(p, x):
  return x + jnp.tanh(x @ p["w"]) @ p["v"].astype(jnp.float32) + p["b"]


def _embed(ep, batch):
  return batch["x"] @ ep


def _head(hp, y, batch):
  return jnp.mean((y @ hp - batch["y"]) ** 2)


def _batch(i, rows=4):
  return {
    "x": jax.random.normal(jax.random.key(10 + i), (rows, V)),
    "y": jax.random.normal(jax.random.key(20 + i), (rows, OUT)),
  }


def _bytes(tree):
  """Every leaf as bytes (StreamedStacks loaded out of the store), for bit-for-bit equality."""
  tree = jax.tree.map(
    lambda x: ssd.stack_to_tree(x) if isinstance(x, StreamedStack) else x,
    tree,
    is_leaf=lambda x: isinstance(x, StreamedStack),
  )
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {
    jax.tree_util.keystr(p): (np.asarray(x).dtype.name, np.asarray(x).tobytes()) for p, x in flat
  }


@pytest.mark.parametrize("location", ["host", "nvme", "device"])
def test_a_stack_saved_and_restored_bit_for_bit(store, tmp_path, location):
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 3, location=location)
  want = _bytes({"stack": stack})
  manager = ckpt.saved(tmp_path / "ck", 1, {"stack": stack, "step": jnp.int32(7)})
  assert (tmp_path / "ck/1/streamed_stacks").exists() == (location != "device")
  like = jax.eval_shape(
    lambda: {
      "stack": ssd.init_streamed(_init_layer, jax.random.key(5), 3, location=location),
      "step": jnp.int32(0),
    }
  )
  got = checkpointing.restore(manager, like)
  assert isinstance(got["stack"], StreamedStack) and got["stack"].location == stack.location
  assert int(got["step"]) == 7
  assert _bytes({"stack": got["stack"]}) == want
  if location != "device":  # new entries in the store, not the saved handles
    assert not np.array_equal(jax.tree.leaves(got["stack"])[0], jax.tree.leaves(stack)[0])


def _tx():
  return optax.adamw(optax.linear_schedule(2e-2, 5e-3, 3), weight_decay=0.1)


_TX = _tx()  # one tx: the update compiles once


def _fresh(location, seed=0):
  """A train state: the stack, its StreamedOptState (master copy, bfloat16 leaf), the embedding
  and head on the device and their optax state."""
  stack = ssd.init_streamed(_init_layer, jax.random.key(seed), 3, location=location)
  ep = jax.random.normal(jax.random.key(seed + 1), (V, D)) / np.sqrt(V)
  hp = jax.random.normal(jax.random.key(seed + 2), (D, OUT)) / np.sqrt(D)
  return {
    "stack": stack,
    "opt": ssd.init_streamed_optimizer(_TX, stack),
    "side": (ep, hp),
    "side_opt": _TX.init((ep, hp)),
  }


_micro = jax.jit(ssd.value_and_grad_streamed(_embed, _block, _head))


@jax.jit
def _update(state, sums):
  stack, opt = ssd.apply_gradients(_TX, sums[1], state["opt"], state["stack"], scale=0.5)
  side, side_opt = ssd.apply_gradients(
    _TX, (sums[0], sums[2]), state["side_opt"], state["side"], scale=0.5
  )
  return {"stack": stack, "opt": opt, "side": side, "side_opt": side_opt}


def _steps(state, first, last):
  for s in range(first, last):
    sums = None
    for b in (2 * s, 2 * s + 1):  # two micro-batches a step
      ep, hp = state["side"]
      _, sums = _micro(ep, state["stack"], hp, _batch(b), sums)
    state = _update(state, sums)
  return state


@pytest.mark.parametrize("location", ["host", "nvme"])
def test_resume_equals_never_stopping(store, tmp_path, location):
  never_stopped = _bytes(_steps(_fresh(location), 0, 3))
  state = _steps(_fresh(location), 0, 2)
  manager = ckpt.saved(tmp_path / "ck", 2, state)
  assert isinstance(state["opt"], StreamedOptState)
  del state
  resumed = checkpointing.restore(manager, _fresh(location, seed=100))
  got = _bytes(_steps(resumed, 2, 3))
  assert got.keys() == never_stopped.keys()
  for k in got:
    assert got[k] == never_stopped[k], k
  # the restore is not a no-op: the fresh state differs from the resumed one
  assert _bytes(_fresh(location, seed=100)) != _bytes(resumed)


def test_a_checkpoint_of_another_layout_is_refused(store, tmp_path):
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 3)
  manager = ckpt.saved(tmp_path / "ck", 1, {"stack": stack})
  deeper = ssd.init_streamed(_init_layer, jax.random.key(0), 4)
  with pytest.raises(ValueError, match=r"has 3 layers, the stack to restore into 4"):
    checkpointing.restore(manager, {"stack": deeper})
  wider = jax.eval_shape(
    lambda: ssd.init_streamed(lambda k: _init_layer(k, D + 1), jax.random.key(0), 3)
  )
  with pytest.raises(
    ValueError,
    match=r"leaf \['b'\] is float32\[8\], the stack to restore into has \['b'\] float32\[9\]",
  ):
    checkpointing.restore(manager, {"stack": wider})
  opt = jax.eval_shape(lambda: ssd.init_streamed_optimizer(_TX, stack))
  with pytest.raises(ValueError, match=r"a params stack, the one to restore into a opt_state"):
    checkpointing.restore(manager, {"stack": opt.per_layer})


def test_a_multi_process_run_is_refused(store, tmp_path, monkeypatch):
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 3)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  for fn in (checkpointing.save_args, checkpointing.restore_args):
    with pytest.raises(ValueError, match=r"StreamedStack\(params, 3 layers.*one process only"):
      fn({"stack": stack, "step": 1})
  with pytest.raises(TypeError, match=r"expected StreamedStacks in the store, got StreamedStack"):
    checkpointing.StreamedStackHandler().save(
      tmp_path / "x",
      checkpointing.StreamedStackSave(
        [ssd.init_streamed(_init_layer, jax.random.key(0), 2, location="device")]
      ),
    )
