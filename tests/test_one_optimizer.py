"""One optimizer analysis for both wings: a list of optax transformations through
``offload_optimizer`` and through a streamed stack (``init_streamed_optimizer``), each accepted by
both or refused by both with the same cause (the transformation and the operation that couple
the state of several parameters), or, where the stack's one layer on the device is the cause,
accepted by ``offload_optimizer`` and refused by the stack naming that cause; and the room and
site arithmetic the two share."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import nested_norms

import jax_ssdtrain as ssd
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    yield


def _init_layer(key):
  k1, k2 = jax.random.split(key)
  return {"up": jax.random.normal(k1, (16, 32)), "scale": 1.0 + jax.random.normal(k2, (16,))}


def _cross_shapes() -> optax.GradientTransformation:
  """Each parameter's momentum moved by a slice of another's: the state of two parameters of
  different shapes read together, elementwise (no reduction a pass could compute first)."""

  def init(params):
    return {"m": jax.tree.map(jnp.zeros_like, params)}

  def update(updates, state, params=None):
    m = state["m"]
    up = m["up"] + updates["up"] + m["scale"][..., :, None]
    scale = m["scale"] + updates["scale"] + m["up"][..., :, 0]
    new = {"up": up, "scale": scale}
    return jax.tree.map(lambda x: -1e-3 * x, new), {"m": new}

  return optax.GradientTransformation(init, update)


# Accepted by both wings.
ACCEPTED = {
  "adam": lambda: optax.adam(1e-2),
  "adamw_schedule": lambda: optax.adamw(optax.linear_schedule(2e-2, 5e-3, 3), weight_decay=0.1),
  "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-3),
  "rmsprop": lambda: optax.rmsprop(1e-3),
  "clip_elementwise": lambda: optax.chain(optax.clip(1.0), optax.adam(1e-3)),
  "masked": lambda: optax.masked(optax.adam(1e-3), {"up": True, "scale": False}),
  "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
  "scale_by_schedule": lambda: optax.chain(
    optax.scale_by_adam(), optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 3))
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
}

# Refused by both, with the same cause: (transformation, operation) in the messages.
REFUSED_BY_BOTH = {
  "nested_norms": (nested_norms, ("nested_norms", "add")),
  "cross_shapes": (_cross_shapes, ("_cross_shapes", "add")),
}

# Accepted by offload_optimizer (the gradients are whole on the device, a reduction pass may run
# first, a group may run whole), refused by the stack (one layer on the device, one pass): the
# regex its message matches, naming the transformation, the operation and the way out.
REFUSED_BY_THE_STACK = {
  "clip_by_global_norm": (
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    r"the transformation 'clip_by_global_norm' .*its add operation \(of each parameter's "
    r"reduce_sum\) reads the state of several parameters together .*clip_global_norm=max_norm",
  ),
  "lamb": (
    lambda: optax.lamb(1e-3),
    r"cannot be streamed layer by layer: its reduce_sum operation .*across its layers.*trust "
    r"ratio",
  ),
  "noisy_sgd": (
    lambda: optax.noisy_sgd(1e-3),
    r"layer by layer: its \w+ operation makes an array of the stacked layers' shape .*the same "
    r"in every layer",
  ),
  "adafactor": (
    lambda: optax.adafactor(1e-2),
    r"the transformation 'clip_by_block_rms' .*layer by layer: its reduce_sum operation",
  ),
}


def _stack_outcome(tx, stack):
  try:
    ssd.init_streamed_optimizer(tx, stack)
  except ValueError as err:
    return err
  return None


def _offload_outcome(tx, params):
  wrapped = ssd.offload_optimizer(tx, location="device", min_bytes=0, chunk_bytes=4096)
  try:
    state = wrapped.init(params)
    jax.eval_shape(wrapped.update, params, state, params)  # the plan is made on tracing
  except ValueError as err:
    return err
  return None


def _cause(err: Exception) -> tuple[str, str]:
  text = str(err)
  found = re.search(r"^the transformation '([^']+)' \(.*?cannot be streamed.*?: its (\w+) ", text)
  assert found, text
  return found.group(1), found.group(2)


@pytest.fixture
def trees(store):
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 2, location="device")
  return stack, jax.vmap(_init_layer)(jax.random.split(jax.random.key(0), 2))


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_by_both(trees, name):
  stack, params = trees
  tx = ACCEPTED[name]()
  assert _offload_outcome(tx, params) is None
  assert _stack_outcome(tx, stack) is None


@pytest.mark.parametrize("name", sorted(REFUSED_BY_BOTH))
def test_refused_by_both_with_one_cause(trees, name):
  stack, params = trees
  make, cause = REFUSED_BY_BOTH[name]
  offloaded, streamed = _offload_outcome(make(), params), _stack_outcome(make(), stack)
  assert isinstance(offloaded, OptimizerOffloadError), offloaded
  assert isinstance(streamed, OptimizerOffloadError), streamed
  assert _cause(offloaded) == _cause(streamed) == cause
  assert "offload_optimizer's tx" in str(offloaded)
  assert "init_streamed_optimizer's tx" in str(streamed)
  assert "clip_global_norm=" in str(streamed)  # the stack's way out, offload_optimizer's its own
  assert "min_bytes" in str(offloaded)


@pytest.mark.parametrize("name", sorted(REFUSED_BY_THE_STACK))
def test_refused_by_the_stack_alone_naming_the_cause(trees, name):
  stack, params = trees
  make, pattern = REFUSED_BY_THE_STACK[name]
  assert _offload_outcome(make(), params) is None
  err = _stack_outcome(make(), stack)
  assert isinstance(err, OptimizerOffloadError), err
  assert re.search(pattern, str(err)), str(err)
  # apply_gradients on the stack goes through the same analysis: the same refusal
  sums = ssd.map_stack(lambda p: p, stack, kind="grad_sum")
  state = ssd.init_streamed_optimizer(optax.adam(1e-3), stack)
  with pytest.raises(OptimizerOffloadError) as raised:
    ssd.apply_gradients(make(), sums, state, stack)
  assert re.search(pattern, str(raised.value)), str(raised.value)


def test_site_of_is_the_derived_site():
  # offload_optimizer's chunk sites are remat.derived_site's hash of what the chunk holds, the
  # values they had (a changed hash would make saved layouts disagree with new ones)
  from jax_ssdtrain._src.optimizer.layout import LeafLayout, site_of
  from jax_ssdtrain._src.remat import derived_site

  leaf = LeafLayout("[0].mu['w']", (64, 8), np.dtype(np.float32), bounds=((0, 32), (32, 64)))
  assert site_of(leaf, 1) == -748353263947158618
  key = (1, leaf.path, leaf.shape, "float32", leaf.bounds, None)
  assert site_of(leaf, 1) == derived_site(key)


def test_offloaded_room_rounds_each_chunk_to_the_entry_alignment(store):
  # a chunk of 100 float32 rows of 3 takes 4096 bytes in the store, not 1200: the layout's room
  # is the one the streamed stack's check counts (store_space.entry_bytes)
  from jax_ssdtrain._src.optimizer.layout import Options, make_layout, room_bytes
  from jax_ssdtrain._src.store_space import ENTRY_ALIGN, entry_bytes

  params = {"w": jnp.zeros((100, 3))}
  shapes = jax.eval_shape(optax.adam(1e-3).init, params)
  opts = Options(ssd.Location.HOST, min_bytes=0, chunk_bytes=4096)
  layout = make_layout(shapes, opts, "adam", params)
  assert entry_bytes(1200) == ENTRY_ALIGN == 4096
  assert room_bytes(layout) == 2 * 2 * ENTRY_ALIGN  # mu and nu, one chunk each, two versions


def test_offloaded_room_counts_the_free_space_where_capacity_is_unset(tmp_path, monkeypatch):
  # capacity_bytes unset: offload_optimizer's check counts 90% of the free space, as the
  # stack's check and the store do (it checked nothing before)
  from jax_ssdtrain._src import store_space

  monkeypatch.setattr(store_space, "free_bytes_total", lambda dirs: 10 * MiB)
  with ssd.configured(tmp_path / "s", host_tier_bytes=4 * MiB):
    tx = ssd.offload_optimizer(optax.adam(1e-3), location="nvme")
    with pytest.raises(OptimizerOffloadError, match=r"90% of the store directories' free space"):
      tx.init({"w": jnp.zeros((1024, 1024))})  # 8 MiB of state, 16 with the new version
