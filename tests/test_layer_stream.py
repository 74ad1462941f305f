"""A scanned layer stack streamed from the store (jax_ssdtrain._src.layer_stream):
parameters initialised layer by layer into the store, a micro-step whose blocks load
their parameters and add their gradients into a running sum in the store, the sum read back and
the update written back; against the same program with the stack on the device (bit for bit)
and against ``jax.value_and_grad`` of the same model (within a tolerance); the compiled step's
memory; bad input."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import assert_bitwise, init_layer

import jax_ssdtrain as ssd
from jax_ssdtrain._src.layer_stream import StreamedStack

MiB = 1 << 20
D, V, OUT = 16, 6, 5  # width, input features, outputs


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    yield


def _init_layer(key, dtype=jnp.float32, width=D):
  return init_layer(key, dtype, width)


def _block(p, x):
  h = jax.nn.gelu(x @ p["mlp"]["up"])
  return x + (h @ p["mlp"]["down"]) * p["scale"]


def _embed(ep, batch):
  return (batch["x"] @ ep).astype(ep.dtype)


def _head(hp, y, batch):
  return jnp.mean((y.astype(jnp.float32) @ hp - batch["y"]) ** 2)


def _side(dtype=jnp.float32):
  ep = (jax.random.normal(jax.random.key(1), (V, D)) / np.sqrt(V)).astype(dtype)
  hp = jax.random.normal(jax.random.key(2), (D, OUT)) / np.sqrt(D)
  return ep, hp


def _batches(n, rows=4):
  return [
    {
      "x": jax.random.normal(jax.random.key(10 + i), (rows, V)),
      "y": jax.random.normal(jax.random.key(20 + i), (rows, OUT)),
    }
    for i in range(n)
  ]


def _sgd(p, g):
  return jax.tree.map(lambda a, b: (a.astype(jnp.float32) - 0.1 * b).astype(a.dtype), p, g)


# Results by arguments (NumPy arrays, no handles): a configuration compiles and runs once per
# session whichever test asks for it first (CPU compilation dominates these tests' time).
_RUNS = {}


def _run(location, layers=4, micro=3, dtype=jnp.float32, save_inputs="device", sum_dtype=None):
  """Micro-steps over ``micro`` batches, then an SGD update written back; returns everything
  the step produced, read back to NumPy."""
  sum_name = None if sum_dtype is None else jnp.dtype(sum_dtype).name
  key = (location, layers, micro, jnp.dtype(dtype).name, save_inputs, sum_name)
  if key not in _RUNS:
    _RUNS[key] = _run_uncached(location, layers, micro, dtype, save_inputs, sum_dtype)
  return _RUNS[key]


def _run_uncached(location, layers, micro, dtype, save_inputs, sum_dtype):
  extra = {} if sum_dtype is None else {"sum_dtype": sum_dtype}
  stack = ssd.init_streamed(
    lambda k: _init_layer(k, dtype), jax.random.key(0), layers, location=location
  )
  step = jax.jit(
    ssd.value_and_grad_streamed(_embed, _block, _head, save_inputs=save_inputs, **extra),
    donate_argnums=4,
  )
  ep, hp = _side(dtype)
  sums, losses = None, []
  for batch in _batches(micro):
    loss, sums = step(ep, stack, hp, batch, sums)
    losses.append(loss)
  new = ssd.map_stack(_sgd, stack, sums[1])
  out = {
    "losses": losses,
    "embed": sums[0],
    "head": sums[2],
    "stack_sum": ssd.stack_to_tree(sums[1]),
    "params": ssd.stack_to_tree(stack),
    "updated": ssd.stack_to_tree(new),
  }
  return jax.tree.map(np.asarray, out)


def _vmap_init(layers, dtype=jnp.float32, key=0):
  return jax.vmap(lambda k: _init_layer(k, dtype))(jax.random.split(jax.random.key(key), layers))


def _assert_init_close(got, want):
  # init_streamed's scan and vmap's batched init may fuse ``1 + 0.1 * n`` differently (an FMA):
  # an ulp apart.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)


def _reference(stacked, micro, dtype=jnp.float32):
  """``jax.value_and_grad`` of the same model with every parameter on the device."""
  ep, hp = _side(dtype)

  def model(ep, sp, hp, batch):
    x = _embed(ep, batch)
    x, _ = jax.lax.scan(lambda x, p: (_block(p, x), None), x, sp)
    return _head(hp, x, batch)

  grad = jax.jit(jax.value_and_grad(model, argnums=(0, 1, 2)))
  losses, total = [], None
  for batch in _batches(micro):
    loss, g = grad(ep, stacked, hp, batch)
    g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
    losses.append(loss)
    total = g if total is None else jax.tree.map(jnp.add, total, g)
  return losses, total


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("location", ["host", "nvme"])
def test_store_equals_device_bit_for_bit(store, location):
  # Loss, embedding and head sums, the stack's gradient sum over 3 micro-batches, the params as
  # stored and after an update written back: the store's program equals the device reference's.
  assert_bitwise(_run(location), _run("device"))


@pytest.mark.slow  # the README's command keeps the float32 and nvme bit-for-bit cases
def test_bfloat16_stack_saved_inputs_in_store(store):
  # bfloat16 parameters with a float32 sum, the block inputs saved in the host tier.
  device = _run("device", layers=3, micro=2, dtype=jnp.bfloat16)
  assert_bitwise(_run("host", layers=3, micro=2, dtype=jnp.bfloat16, save_inputs="host"), device)
  assert device["stack_sum"]["scale"].dtype == np.float32
  assert device["updated"]["scale"].dtype == jnp.bfloat16


@pytest.mark.slow
def test_bfloat16_sum(store):
  # A bfloat16 sum on request, in the files.
  half = _run("nvme", layers=3, micro=2, dtype=jnp.bfloat16, sum_dtype=jnp.bfloat16)
  assert_bitwise(half, _run("device", layers=3, micro=2, dtype=jnp.bfloat16, sum_dtype="bfloat16"))
  assert half["stack_sum"]["mlp"]["up"].dtype == jnp.bfloat16


# depth 2 by default (the first and the last layer, no scan); 1 and 4 under -m slow
@pytest.mark.parametrize(
  "layers", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_equals_value_and_grad_of_the_same_model(store, layers):
  # float32: the per-layer backward against jax.grad through the scanned model, summed over 3
  # micro-batches; within 1e-5 relative, 1e-5 absolute (XLA may fuse and order the two programs'
  # sums differently: on an H100 one element of 2048 at 4 layers differed by 1.2e-6 of 0.011).
  # Depth 1 and 2 have no scan in the backward pass (the last and first layers are outside it).
  got = _run("host", layers=layers, micro=3)
  _assert_init_close(got["params"], _vmap_init(layers))
  stacked = got["params"]
  losses, (g_embed, g_stack, g_head) = _reference(stacked, 3)
  tol = dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["losses"], losses, **tol)
  np.testing.assert_allclose(got["embed"], g_embed, **tol)
  np.testing.assert_allclose(got["head"], g_head, **tol)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), got["stack_sum"], g_stack)
  want = jax.tree.map(np.asarray, _sgd(stacked, g_stack))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), got["updated"], want)


def test_bfloat16_within_tolerance_of_value_and_grad(store):
  # bfloat16 parameters and activations: the same arithmetic in another association; the sums
  # (float32) agree to bfloat16's precision.
  got = _run("device", layers=3, micro=2, dtype=jnp.bfloat16)  # the store's, bit for bit
  losses, (g_embed, g_stack, g_head) = _reference(got["params"], 2, jnp.bfloat16)
  np.testing.assert_allclose(got["losses"], losses, rtol=2e-2)
  for a, b in zip(jax.tree.leaves(got["stack_sum"]), jax.tree.leaves(g_stack)):
    np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * float(np.max(np.abs(b))))


@pytest.mark.parametrize("layers", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_whole_train_step_in_one_jit(store, layers):
  # Two micro-steps and the update in one program: the first micro-step's sums are loaded by
  # the second in the same execution, the second's by the update (depth 3: each sum entry is
  # stored in places that run once each, so its one load is counted and releases it; depth 4:
  # the scan stores it 2 times, the others once, so sweeps release it). Bit for bit the device
  # reference's.
  def run(location):
    stack = ssd.init_streamed(_init_layer, jax.random.key(0), layers, location=location)
    micro = ssd.value_and_grad_streamed(_embed, _block, _head)

    @jax.jit
    def train_step(ep, stack, hp, batches, lr):
      sums = None
      for b in batches:
        loss, sums = micro(ep, stack, hp, b, sums)
      sgd = lambda p, g: jax.tree.map(lambda a, c: a - lr * c, p, g)
      return loss, ssd.map_stack(sgd, stack, sums[1]), ep - lr * sums[0], hp - lr * sums[2]

    ep, hp = _side()
    loss, new, ep, hp = train_step(ep, stack, hp, _batches(2), jnp.float32(0.1))
    return jax.tree.map(np.asarray, (loss, ssd.stack_to_tree(new), ep, hp))

  ssd.reset_stats()
  host = run("host")
  counted = ssd.stats()["counted_releases"]  # the two sums' entries, 3 leaves a layer each
  assert counted == (2 * 3 * layers if layers == 3 else 0)
  assert_bitwise(host, run("device"))
  ssd.collect()
  stats = ssd.stats()  # nothing holds a handle any more: the sweep releases every entry
  assert stats["live_entries"] == 0 and stats["host_tier_bytes_in_use"] == 0, stats


def test_in_place_holds_one_version(store):
  # in_place: the step's loads of the old sum and the update's loads of the old parameters and
  # the sum are their entries' last. The results are the device reference's, bit for bit; the
  # old versions are gone at once (no sweep): loading them raises, and the store holds the new
  # parameters only.
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 4, location="host")
  params = ssd.stack_to_tree(stack)
  step = jax.jit(ssd.value_and_grad_streamed(_embed, _block, _head, in_place=True))
  ep, hp = _side()
  sums, losses, old = None, [], None
  for batch in _batches(3):
    old, (loss, sums) = sums, step(ep, stack, hp, batch, sums)
    losses.append(loss)
  with pytest.raises(Exception, match="ssdtrain"):
    jax.block_until_ready(ssd.stack_to_tree(old[1]))
  got = {"losses": losses, "embed": sums[0], "head": sums[2]}
  got |= {"stack_sum": ssd.stack_to_tree(sums[1]), "params": params}
  got["updated"] = ssd.stack_to_tree(ssd.map_stack(_sgd, stack, sums[1], in_place=True))
  assert_bitwise(jax.tree.map(np.asarray, got), _run("device"))
  assert ssd.stats()["live_entries"] == 3 * 4  # the new parameters' entries only
  with pytest.raises(Exception, match="ssdtrain"):
    jax.block_until_ready(ssd.stack_to_tree(stack))


# ---------------------------------------------------------------------------------------------
# Memory


def _wide_layer(key):
  return _init_layer(key, jnp.float32, width=128)


def _step_memory(location, layers):
  stack = jax.eval_shape(
    lambda k: ssd.init_streamed(_wide_layer, k, layers, location=location), jax.random.key(0)
  )
  step = ssd.value_and_grad_streamed(
    lambda ep, b: b["x"] @ ep, _block, lambda hp, y, b: jnp.mean((y @ hp - b["y"]) ** 2)
  )
  ep = jax.ShapeDtypeStruct((V, 128), jnp.float32)
  hp = jax.ShapeDtypeStruct((128, OUT), jnp.float32)
  batch = {
    "x": jax.ShapeDtypeStruct((4, V), jnp.float32),
    "y": jax.ShapeDtypeStruct((4, OUT), jnp.float32),
  }
  sums = jax.eval_shape(step, ep, stack, hp, batch)[1]
  memory = jax.jit(step).lower(ep, stack, hp, batch, sums).compile().memory_analysis()
  return stack, memory


def test_compiled_step_holds_no_whole_stack(store):
  # 24 layers of 256.5 KiB (float32): the stack is 6 MiB, its gradient sum 6 MiB more. The
  # step's arguments, temporaries and results hold a few layers, never a whole stack.
  stack, memory = _step_memory("host", 24)
  layer = stack.nbytes // stack.num_layers
  assert stack.nbytes == 24 * layer and layer == 256 * 1024 + 512
  held = memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
  assert memory.argument_size_in_bytes < layer
  assert held < 8 * layer, (held, layer)
  # The device reference holds the stack and its sum as arguments and results.
  _, ref = _step_memory("device", 24)
  assert ref.argument_size_in_bytes > 2 * stack.nbytes


def test_init_is_pure(store):
  stack = jax.eval_shape(
    lambda k: ssd.init_streamed(_init_layer, k, 7, location="nvme"), jax.random.key(0)
  )
  assert isinstance(stack, StreamedStack) and stack.num_layers == 7
  assert [h.shape for h in jax.tree.leaves(stack.handles)] == [(7, 2)] * 3
  assert stack.layer_struct()["mlp"]["up"].shape == (D, 2 * D)
  # One init of one model on two calls: the same layout (sites derive from it, not a counter).
  a = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  b = ssd.init_streamed(_init_layer, jax.random.key(3), 2)
  assert a.layout == b.layout
  _assert_init_close(ssd.stack_to_tree(a), _vmap_init(2))


def test_stack_from_tree_round_trip(store):
  tree = _vmap_init(3, key=5)
  stack = ssd.stack_from_tree(tree, location="host,nvme")
  assert stack.location is ssd.Location.HOST_NVME
  assert_bitwise(jax.tree.map(np.asarray, ssd.stack_to_tree(stack)), jax.tree.map(np.asarray, tree))


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input(store):
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 3)
  step = jax.jit(ssd.value_and_grad_streamed(_embed, _block, _head))
  ep, hp = _side()
  (batch,) = _batches(1)
  with pytest.raises(
    ValueError, match="location: expected 'host', 'nvme', 'host,nvme' or 'device'"
  ):
    ssd.init_streamed(_init_layer, jax.random.key(0), 3, location="remat")
  with pytest.raises(ValueError, match="num_layers: expected an integer >= 1"):
    ssd.init_streamed(_init_layer, jax.random.key(0), 0)
  with pytest.raises(TypeError, match="expected a StreamedStack"):
    step(ep, jax.vmap(_init_layer)(jax.random.split(jax.random.key(0), 3)), hp, batch)
  # Handles that are not one uint32[2] per layer.
  bad = StreamedStack(jax.tree.map(lambda h: h[:2], stack.handles), stack.layout)
  with pytest.raises(ValueError, match=r"must be uint32\[3, 2\], got uint32\[2, 2\]"):
    step(ep, bad, hp, batch)
  # Sums of another stack (depth), of another dtype, and not sums at all.
  loss, sums = step(ep, stack, hp, batch)
  other = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  _, other_sums = step(ep, other, hp, batch)
  with pytest.raises(ValueError, match="sums\\[1\\]: a gradient sum of 2 layers"):
    step(ep, stack, hp, batch, (sums[0], other_sums[1], sums[2]))
  half = jax.jit(ssd.value_and_grad_streamed(_embed, _block, _head, sum_dtype=jnp.bfloat16))
  with pytest.raises(ValueError, match="sum_dtype bfloat16"):
    half(ep, stack, hp, batch, sums)
  with pytest.raises(TypeError, match="sums: expected the"):
    step(ep, stack, hp, batch, sums[1])
  with pytest.raises(ValueError, match="sums\\[0\\]"):
    step(ep, stack, hp, batch, (hp, sums[1], sums[2]))
  # Functions that do not fit the stack.
  wrong = jax.jit(ssd.value_and_grad_streamed(_embed, lambda p, x: x[:, :2], _head))
  with pytest.raises(ValueError, match="block_fn must return an array shaped like its input"):
    wrong(ep, stack, hp, batch)
  vector = jax.jit(ssd.value_and_grad_streamed(_embed, _block, lambda hp, y, b: y @ hp))
  with pytest.raises(ValueError, match="head_fn must return a floating scalar loss"):
    vector(ep, stack, hp, batch)
  with pytest.raises(ValueError, match="sum_dtype: expected a floating dtype"):
    ssd.value_and_grad_streamed(_embed, _block, _head, sum_dtype=jnp.int32)
  with pytest.raises(ValueError, match="save_inputs"):
    ssd.value_and_grad_streamed(_embed, _block, _head, save_inputs="remat")
  with pytest.raises(ValueError, match="in_place: expected True or False"):
    ssd.value_and_grad_streamed(_embed, _block, _head, in_place=1)
  # map_stack over stacks that disagree; a result leaf that is no array.
  with pytest.raises(ValueError, match="stacks\\[1\\] has 2 layers"):
    ssd.map_stack(_sgd, stack, other)
  with pytest.raises(TypeError, match=r"leaf \['k'\] has the extended dtype"):
    ssd.init_streamed(lambda k: {"w": jnp.zeros(3), "k": k}, jax.random.key(0), 2)
  with pytest.raises(ValueError, match="same leading layer axis"):
    ssd.stack_from_tree({"a": jnp.zeros((3, 2)), "b": jnp.zeros((2, 2))})


def test_released_handles_raise(store):
  # Handles whose entries are gone (the store released them: here, every entry) raise at their
  # load instead of reading other bytes.
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  copied = StreamedStack(
    jax.tree.map(lambda h: jnp.array(np.asarray(h)), stack.handles), stack.layout
  )
  ssd.release_all()
  with pytest.raises(Exception, match="ssdtrain"):
    jax.block_until_ready(ssd.stack_to_tree(copied))


# ---------------------------------------------------------------------------------------------
# Heavier


@pytest.mark.slow
@pytest.mark.parametrize("location", ["host", "nvme", "host,nvme"])
def test_deeper_stack_many_micro_batches(store, location):
  assert_bitwise(
    _run(location, layers=12, micro=6, save_inputs="nvme"), _run("device", layers=12, micro=6)
  )


def test_failed_write_leaves_the_last_sum(tmp_path):
  # A host tier with room for the stack and one gradient sum: the second micro-step's sum does
  # not fit. Its store raises, naming the entry, and the first micro-step's sum (written beside,
  # never over) is still there, whole.
  init = functools.partial(_init_layer, width=64)  # 64.25 KiB a layer, 4 layers
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB, host_tier_bytes=640 * 1024):
    stack = ssd.init_streamed(init, jax.random.key(0), 4)
    step = jax.jit(
      ssd.value_and_grad_streamed(
        lambda ep, b: b["x"] @ ep, _block, lambda hp, y, b: jnp.mean((y @ hp - b["y"]) ** 2)
      )
    )
    ep, hp = jnp.ones((V, 64)) / 8, jnp.ones((64, OUT)) / 8
    first, second = _batches(2)
    _, sums = step(ep, stack, hp, first)
    before = jax.tree.map(np.asarray, ssd.stack_to_tree(sums[1]))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"host tier full.*layer_stream\.grad_sum"):
      jax.block_until_ready(step(ep, stack, hp, second, sums))
    assert_bitwise(jax.tree.map(np.asarray, ssd.stack_to_tree(sums[1])), before)


# ---------------------------------------------------------------------------------------------
# The optimizer update, layer by layer (init_streamed_optimizer, apply_streamed_update)


def _tx(name):
  import optax  # the demo extra, as the tests of the optimizer

  if name == "adam":
    return optax.adam(1e-2)
  if name in ("adamw_schedule", "clip_adamw"):
    return optax.adamw(optax.linear_schedule(2e-2, 5e-3, 3), weight_decay=0.1)
  if name == "sgd_momentum":
    return optax.sgd(0.05, momentum=0.9, nesterov=True)
  raise ValueError(name)


_TXS = {}  # one tx per name: the update compiles once per (tx, layout)
_TRAINS = {}
_PLACED = {}  # per _train key: where the last step's parameters, sums and state were


@functools.cache
def _micro_step(in_place, sum_location=None):
  return jax.jit(
    ssd.value_and_grad_streamed(_embed, _block, _head, in_place=in_place, sum_location=sum_location)
  )


@functools.cache
def _trainer(name, dtype_name, layers, micro, in_place, location, sum_location, state_location):
  tx = _TXS.setdefault(name, _tx(name))
  dtype = jnp.dtype(dtype_name)
  return ssd.StreamedTrainer(
    _embed,
    _block,
    _head,
    tx,
    init_layer=lambda k: _init_layer(k, dtype),
    num_layers=layers,
    init_side=lambda key, batch: _side(dtype),
    micro_batches=micro,
    location=location,
    sum_location=sum_location,
    state_location=state_location,
    in_place=in_place,
    clip_global_norm=0.5 if name.startswith("clip") else None,
  )


def _train(
  location,
  name,
  dtype=jnp.float32,
  layers=3,
  steps=2,
  micro=2,
  in_place=False,
  sum_location=None,
  state_location=None,
):
  """A whole training loop through ``ssd.StreamedTrainer``: ``steps`` updates of ``micro``
  micro-batches each, the stack's parameters, gradient sums and optimizer state (master copy
  included) in the store (the sums at ``sum_location``, the state at ``state_location`` where
  given), the embedding and head updated on the device with the same tx (one global norm where
  clipped). Returns per step the sums the update consumed and the parameters after it
  (NumPy)."""
  key = (location, name, jnp.dtype(dtype).name, layers, steps, micro, in_place)
  key += (sum_location, state_location) if sum_location or state_location else ()
  if key in _TRAINS:
    return _TRAINS[key]
  trainer = _trainer(
    name, jnp.dtype(dtype).name, layers, micro, in_place, location, sum_location, state_location
  )
  batches = _batches(steps * micro)
  state = trainer.init(jax.random.key(0), batches[0], side_key=jax.random.key(1))
  host = functools.partial(jax.tree.map, np.asarray)  # read now: the update donates the state
  out = {"params0": host(ssd.stack_to_tree(state.stack))}
  out |= {"sums": [], "params": [], "master": [], "side": []}
  for s in range(steps):
    _, sums = trainer.accumulate(state, batches[s * micro : (s + 1) * micro])
    out["sums"].append(host((sums[0], ssd.stack_to_tree(sums[1]), sums[2])))
    state, _ = trainer.update(state, sums)
    out["params"].append(host(ssd.stack_to_tree(state.stack)))
    out["master"].append(host(ssd.stack_to_tree(state.opt.per_layer).get("master")))
    out["side"].append(host(state.side))
  locations = (state.stack.location, sums[1].location, state.opt.per_layer.location)
  _PLACED[key] = tuple(loc.value for loc in locations)
  out["shared"] = state.opt.shared
  out["side_shared"] = [x for x in jax.tree.leaves(state.side_opt) if np.ndim(x) == 0]
  _TRAINS[key] = jax.tree.map(np.asarray, out)
  return _TRAINS[key]


def _optax_reference(got, name, micro=2, dtype=jnp.float32):
  """Plain optax on the whole model's tree ({embed, stack, head}, the stack stacked), from the
  same initial parameters and with the same gradient sums at each step: mean, cast to the
  parameters' dtype, ``chain(clip_by_global_norm, tx)`` where clipped; bfloat16 parameters
  through a float32 master copy (the parameters: its rounding)."""
  import optax  # the demo extra

  tx = _tx(name)
  clip = name.startswith("clip")
  if clip and dtype == jnp.float32:
    tx = optax.chain(optax.clip_by_global_norm(0.5), tx)
  ep, hp = _side(dtype)
  params = {"embed": ep, "stack": got["params0"], "head": hp}
  master = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = tx.init(master)
  out = []

  @jax.jit  # XLA's arithmetic, as the stream's (op by op, bfloat16's g**2 would round first)
  def update(sums, params, master, state):
    grads = jax.tree.map(lambda s, p: (s / micro).astype(jnp.asarray(p).dtype), sums, params)
    if clip and dtype != jnp.float32:
      # The stream's norm is of the float32 mean, optax's of the bfloat16 gradients (their
      # rounding: 6e-5 apart in the master copy after one step); optax's clipping arithmetic.
      norm = optax.tree.norm(jax.tree.map(lambda s: s / micro, sums))
      grads = jax.tree.map(
        lambda g: jnp.where(norm < 0.5, g, g / norm.astype(g.dtype) * 0.5), grads
      )
    updates, state = tx.update(grads, state, master)
    master = optax.apply_updates(master, updates)
    params = jax.tree.map(lambda m, p: m.astype(jnp.asarray(p).dtype), master, params)
    return params, master, state

  for embed_sum, stack_sum, head_sum in got["sums"]:
    sums = {"embed": embed_sum, "stack": stack_sum, "head": head_sum}
    params, master, state = update(sums, params, master, state)
    out.append((params, master))
  return out, state


@pytest.mark.parametrize("location", ["host", pytest.param("nvme", marks=pytest.mark.slow)])
def test_update_store_equals_device_bit_for_bit(store, location):
  # bfloat16 parameters with float32 master weights, adamw with a schedule and the whole
  # model's gradients clipped by one global norm: 2 steps of 2 micro-batches. Every sum,
  # parameter, master copy and count equals the device reference's.
  got = _train(location, "clip_adamw", jnp.bfloat16)
  assert_bitwise(got, _train("device", "clip_adamw", jnp.bfloat16))
  assert got["params"][-1]["scale"].dtype == jnp.bfloat16
  assert got["master"][-1]["scale"].dtype == np.float32


@pytest.mark.parametrize(
  "params, grad_sum, state",
  [("host", "device", "nvme"), pytest.param("device", "host", "host", marks=pytest.mark.slow)],
)
def test_classes_apart_equal_device_bit_for_bit(store, params, grad_sum, state):
  # Each class where the planner may put it (the parameters, the gradients' sum, the state and
  # master copy each on the device or in a tier of its own): the same training as with every
  # class on the device, bit for bit.
  got = _train(params, "clip_adamw", jnp.bfloat16, sum_location=grad_sum, state_location=state)
  assert_bitwise(got, _train("device", "clip_adamw", jnp.bfloat16))
  placed = [k for k in _PLACED if k[0] == params and k[-2:] == (grad_sum, state)]
  assert _PLACED[placed[0]] == (params, grad_sum, state)
  room = ssd.check_streamed_room(
    _shape(3, params), _TXS["clip_adamw"], sum_location=grad_sum, state_location=state
  )
  assert room["locations"] == dict(params=params, grad_sum=grad_sum, optimizer_state=state)


@pytest.mark.parametrize(
  "name",  # clip_adamw: adamw with a schedule, clipped by the whole model's norm
  ["adam", "clip_adamw"]
  + [pytest.param(n, marks=pytest.mark.slow) for n in ["adamw_schedule", "sgd_momentum"]],
)
def test_update_equals_optax_on_the_whole_tree(store, name):
  # float32: the layer-by-layer update (and the embedding's and head's on the device) against
  # optax's on the whole model's tree with the same gradients; the step counts advance once a
  # step for the whole stack, as optax's.
  got = _train("host", name)
  want, state = _optax_reference(got, name)
  tol = dict(rtol=2e-6, atol=1e-7)
  for step, (params, _) in enumerate(want):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, **tol), got["params"][step], params["stack"]
    )
    np.testing.assert_allclose(got["side"][step][0], params["embed"], **tol)
    np.testing.assert_allclose(got["side"][step][1], params["head"], **tol)
    assert got["master"][step] is None  # float32 parameters: no master copy
  counts = [int(x) for x in jax.tree.leaves(state) if np.ndim(x) == 0]
  assert [int(x) for x in got["shared"]] == counts == [2] * len(counts)
  assert [int(x) for x in got["side_shared"]] == counts


def test_master_weights_equal_optax_on_the_whole_tree(store):
  # bfloat16 parameters: the master copy (float32) equals optax's on a float32 master tree
  # given the same bfloat16 mean gradients (jitted: XLA's arithmetic in both; clipped by the
  # float32 mean's norm); the parameters are the master copy's rounding, exactly.
  got = _train("device", "clip_adamw", jnp.bfloat16)  # the store's, bit for bit
  want, _ = _optax_reference(got, "clip_adamw", dtype=jnp.bfloat16)
  for step, (_, master) in enumerate(want):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      got["master"][step],
      master["stack"],
    )
    rounded = jax.tree.map(
      lambda m: np.asarray(jnp.asarray(m).astype(jnp.bfloat16)), got["master"][step]
    )
    assert_bitwise(got["params"][step], rounded)


def test_update_refuses_what_needs_more_than_one_layer(store):
  import optax  # the demo extra

  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"reduce_sum.*clip_by_global_norm.*clip_global_norm="):
    ssd.init_streamed_optimizer(clipped, stack)
  with pytest.raises(ValueError, match="trust ratio"):
    ssd.init_streamed_optimizer(optax.lamb(1e-3), stack)
  tx = _TXS.setdefault("adam", _tx("adam"))
  state = ssd.init_streamed_optimizer(tx, stack)
  # mu and nu of the 3 leaves per layer; the count shared (on the device, once)
  assert not state.master_weights and state.spec.per_layer == (False,) + (True,) * 6
  _, sums = jax.jit(ssd.value_and_grad_streamed(_embed, _block, _head))(
    *_side()[:1], stack, _side()[1], _batches(1)[0]
  )
  # the one way's errors name its arguments (apply_gradients(tx, grads, opt_state, params))
  with pytest.raises(ValueError, match="clip_global_norm"):
    ssd.apply_gradients(clipped, sums[1], state, stack)
  with pytest.raises(ValueError, match="opt_state: made for another stack"):
    other = ssd.init_streamed(_init_layer, jax.random.key(0), 3)
    ssd.apply_gradients(tx, sums[1], state, other)
  with pytest.raises(TypeError, match="tx_state: expected the StreamedOptState"):
    ssd.apply_streamed_update(tx, stack, sums[1], tx.init(_vmap_init(2)))
  with pytest.raises(ValueError, match="global_norm: given without clip_global_norm"):
    ssd.apply_gradients(tx, sums[1], state, stack, global_norm=1.0)
  with pytest.raises(ValueError, match="grads: a sum of 3 layers .* those of params"):
    ssd.apply_gradients(tx, other, state, stack)
  with pytest.raises(ValueError, match="stack_sum: a sum of 3 layers .* those of stack "):
    ssd.apply_streamed_update(tx, stack, other, state)
  with pytest.raises(ValueError, match="master_weights: expected True or False"):
    ssd.init_streamed_optimizer(tx, stack, master_weights=1)


@pytest.mark.slow  # the step's in_place test stays in the README's command
def test_update_in_place(store):
  # in_place: the update's loads of the old sum, state and parameters are their entries' last;
  # the results are the device reference's, bit for bit.
  got = _train("host", "adam", in_place=True, steps=1)
  assert_bitwise(got, _train("device", "adam", steps=1))


def test_update_in_place_with_master_weights_replaces_the_parameters(store):
  # bfloat16 parameters with their float32 master copy: in place, the update's loads of the old
  # parameters are their entries' last (read for that alone), so that the new parameters take
  # their room instead of adding a version to the peak (check_streamed_room: 16 B a parameter
  # with a bfloat16 sum, not 18); the results are the device reference's bit for bit.
  tx = _TXS.setdefault("adam", _tx("adam"))
  init = lambda k: _init_layer(k, jnp.bfloat16)  # noqa: E731
  stack = ssd.init_streamed(init, jax.random.key(0), 4, location="host")
  state = ssd.init_streamed_optimizer(tx, stack)
  assert "master" in ssd.stack_to_tree(state.per_layer)
  ep, hp = _side(jnp.bfloat16)
  _, sums = _micro_step(False)(ep, stack, hp, _batches(1)[0], None)
  jax.block_until_ready(sums)
  ssd.flush()  # on a GPU, releases wait for their copies' events: collected here
  before = ssd.stats()["live_entries"]  # parameters, master copy, state and sum
  new, _ = ssd.apply_gradients(tx, sums[1], state, stack, in_place=True)
  jax.block_until_ready(new)
  ssd.flush()
  # the sum's 4 x 3 entries consumed; the old parameters' too, the new ones in their place
  assert ssd.stats()["live_entries"] == before - 4 * 3
  with pytest.raises(Exception, match="ssdtrain"):
    jax.block_until_ready(ssd.stack_to_tree(stack))
  got = _train("host", "adam", dtype=jnp.bfloat16, in_place=True, steps=2)
  assert_bitwise(got, _train("device", "adam", dtype=jnp.bfloat16, steps=2))


def _live_entries(expected, timeout_s=10.0):
  """The store's live entries once they reach ``expected`` or ``timeout_s`` passed: on a GPU a
  release waits for its copy's event, which a load whose value nobody reads may record after
  the program's results are ready; ``flush`` collects the releases whose copies are done."""
  deadline = time.monotonic() + timeout_s
  while True:
    ssd.flush()
    live = ssd.stats()["live_entries"]
    if live == expected or time.monotonic() > deadline:
      return live
    time.sleep(0.05)


def test_in_place_releases_what_fn_does_not_read(store):
  # A load in place is its entry's last: it runs though fn never reads its value (as the update
  # in place with master weights reads the old parameters only to release them). JAX drops
  # loads whose values nobody reads; a GPU, which does not chain a layer's loads, dropped these.
  params = ssd.init_streamed(_init_layer, jax.random.key(0), 3, location="host")
  other = ssd.init_streamed(_init_layer, jax.random.key(1), 3, location="host")
  want = jax.tree.map(np.asarray, ssd.stack_to_tree(params))
  assert _live_entries(2 * 3 * 3) == 2 * 3 * 3
  ssd.reset_stats()
  kept = ssd.map_stack(lambda p, o: p, params, other, in_place=True)
  assert _live_entries(3 * 3) == 3 * 3, ssd.stats()  # the new stack's alone
  assert_bitwise(jax.tree.map(np.asarray, ssd.stack_to_tree(kept)), want)
  for gone in (params, other):
    with pytest.raises(Exception, match="ssdtrain"):
      jax.block_until_ready(ssd.stack_to_tree(gone))


def test_stacks_sharing_their_sites_in_one_program(store):
  # Stacks of one kind and structure (two parameter stacks; a sum map_stack made from the
  # parameters) share their sites, and the engine follows each pass's loads per site: each
  # stack a program reads has a pass of its own, so no load is mispredicted (the CPU reads every
  # handle and counts the wrong predictions; on a GPU a wrong one fails the step).
  import optax

  tx = optax.adam(0.1)

  def run(location):
    params = ssd.init_streamed(_init_layer, jax.random.key(0), 3, location=location)
    other = ssd.init_streamed(_init_layer, jax.random.key(1), 3, location=location)
    summed = ssd.map_stack(lambda p, o: jax.tree.map(jnp.add, p, o), params, other)
    half = ssd.map_stack(lambda p: jax.tree.map(lambda a: a * 0.5, p), summed)
    new, _ = ssd.apply_gradients(tx, half, ssd.init_streamed_optimizer(tx, params), params)
    return jax.tree.map(np.asarray, ssd.stack_to_tree(new))

  ssd.reset_stats()
  got = run("host")
  s = ssd.stats()
  assert s["speculative_loads"] > 0 and s["handle_mismatches"] == 0, s
  assert_bitwise(got, run("device"))


def test_apply_gradients_takes_a_streamed_stack(store):
  # ssd.apply_gradients with a stack's state (init_streamed_optimizer) is the stack's streamed
  # update, its options apply_streamed_update's; tx.update's extra arguments and a tx of
  # offload_optimizer are refused, naming why.
  import optax

  tx = optax.adam(1e-2)
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 3, location="host")
  state = ssd.init_streamed_optimizer(tx, stack)
  ep, hp = _side()
  _, sums = _micro_step(False)(ep, stack, hp, _batches(1)[0], None)
  options = dict(scale=0.5, clip_global_norm=1.0)
  got = ssd.apply_gradients(tx, sums[1], state, stack, **options)
  want = ssd.apply_streamed_update(tx, stack, sums[1], state, **options)
  trees = lambda r: jax.tree.map(  # noqa: E731
    np.asarray, (ssd.stack_to_tree(r[0]), ssd.stack_to_tree(r[1].per_layer), r[1].shared)
  )
  assert_bitwise(trees(got), trees(want))
  with pytest.raises(TypeError, match="not lr_scale"):
    ssd.apply_gradients(tx, sums[1], state, stack, lr_scale=2.0)
  with pytest.raises(TypeError, match="pass the optax transformation itself"):
    ssd.apply_gradients(ssd.offload_optimizer(tx), sums[1], state, stack)


def _update_memory(location, layers):
  stack = jax.eval_shape(
    lambda k: ssd.init_streamed(_wide_layer, k, layers, location=location), jax.random.key(0)
  )
  tx = _TXS.setdefault("adam", _tx("adam"))
  state = jax.eval_shape(lambda s: ssd.init_streamed_optimizer(tx, s), stack)
  sums = jax.eval_shape(lambda s: ssd.map_stack(lambda p: p, s, kind="grad_sum"), stack)
  update = jax.jit(
    lambda st, su, o: ssd.apply_gradients(tx, su, o, st, scale=0.5, clip_global_norm=1.0)
  )
  return stack, update.lower(stack, sums, state).compile().memory_analysis()


def test_compiled_update_holds_no_whole_stack(store):
  # 24 layers of 256.5 KiB (float32, Adam: 2 moments a parameter): the parameters, their sum and
  # the state are 24 MiB in all; the update (a pass for the global norm, then the update read
  # ahead a layer) holds a few layers (XLA:CPU: 2.3 KB of arguments, 1.45 MB of temporaries,
  # 1.8 KB of results; the device reference 25.2 MB of arguments, 18.9 MB of results).
  stack, memory = _update_memory("host", 24)
  layer = stack.nbytes // stack.num_layers
  held = memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
  assert memory.argument_size_in_bytes < layer
  assert held < 8 * layer, (held, layer)
  _, ref = _update_memory("device", 24)
  assert ref.argument_size_in_bytes > 4 * stack.nbytes


# ---------------------------------------------------------------------------------------------
# The room a streamed model needs, refused before anything is stored


def _shape(layers, location, dtype=jnp.bfloat16, width=64):
  """The stack's structure (jax.eval_shape of init_streamed): nothing stored."""
  init = functools.partial(_init_layer, dtype=dtype, width=width)
  return jax.eval_shape(
    lambda k: ssd.init_streamed(init, k, layers, location=location), jax.random.key(0)
  )


def test_room_arithmetic_per_parameter(tmp_path):
  import optax

  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    shape = _shape(8, "host")
    per_layer = 2 * 64 * 128 + 64  # up, down, scale
    room = ssd.check_streamed_room(shape, optax.adamw(1e-3))
    assert room["parameters"] == 8 * per_layer and room["room_bytes"] == 64 * MiB
    assert room["bytes_per_parameter"] == dict(params=2, master=4, optimizer_state=8, grad_sum=4)
    # as the store holds them: each entry (a layer's leaf) rounded up to 4 KiB
    pad = lambda b: -(-b // 4096) * 4096  # noqa: E731
    held = lambda b: 8 * (2 * pad(64 * 128 * b) + pad(64 * b))  # noqa: E731 - b B a parameter
    resident = held(2) + held(4) + 2 * held(4) + held(4)  # parameters, master, moments, sum
    assert room["resident_bytes"] == resident
    # the update writes the new parameters, master copy and state beside the old
    assert room["update_peak_bytes"] == resident + held(2) + held(4) + 2 * held(4)
    assert room["micro_step_peak_bytes"] == resident + held(4)
    assert room["peak_bytes"] == room["update_peak_bytes"] + resident // 8
    small = ssd.check_streamed_room(shape, optax.adamw(1e-3), sum_dtype=jnp.bfloat16, in_place=True)
    assert small["bytes_per_parameter"]["grad_sum"] == 2
    resident = held(2) + held(4) + 2 * held(4) + held(2)
    # in place: the update's loads release each old version (the parameters too) before the
    # new one is written
    assert small["update_peak_bytes"] == resident
    assert small["micro_step_peak_bytes"] == resident
    plain = ssd.check_streamed_room(_shape(8, "host", jnp.float32))  # no optimizer, no master
    assert plain["bytes_per_parameter"] == dict(params=4, master=0, optimizer_state=0, grad_sum=4)
    assert ssd.check_streamed_room(_shape(8, "device"), optax.adam(1e-3))["room_bytes"] is None


# choose_placement's placements of a stack's classes: tests/test_planner_placement.py


def test_read_ahead_sizes(tmp_path):
  # Per layer 512 x 1024 x 2 + 512 = 1,049,088 bfloat16 parameters: 2 B each of parameters, 4
  # of float32 sum, 12 of master copy and moments. The forward and backward passes two layers
  # ahead, the update one; staging twice the read-ahead, in MiB.
  import optax

  tx = optax.adamw(1e-3)
  n = 1_049_088
  p, s, m = 2 * n, 4 * n, 12 * n
  mib = lambda b: -(-b // MiB) * MiB  # noqa: E731

  def sizes(location, **kw):
    return ssd.read_ahead_sizes(_shape(4, location, width=512), tx, **kw)

  with ssd.configured(tmp_path / "s"):
    every = sizes("host")
    assert every == dict(prefetch_bytes=mib(max(2 * (p + s), s + m)), staging_bytes=2 * mib(s + m))
    assert every["prefetch_bytes"] == 17 * MiB  # the update's loads bind
    assert sizes("host", in_place=True)["prefetch_bytes"] == mib(s + m + p)  # reads the params
    assert sizes("device", sum_location="host", state_location="host")["prefetch_bytes"] == mib(
      s + m
    )
    assert sizes("host", sum_location="device")["prefetch_bytes"] == mib(max(2 * p, m))
    bf16 = sizes("host", sum_dtype=jnp.bfloat16, state_location="device")
    assert bf16["prefetch_bytes"] == mib(2 * (p + s // 2))  # the passes bind: two layers ahead
    assert sizes("device") == dict(prefetch_bytes=0, staging_bytes=0)
    assert sizes("host", layers_ahead=4)["prefetch_bytes"] == mib(4 * (p + s))
    with pytest.raises(ValueError, match="layers_ahead"):
      sizes("host", layers_ahead=0)


def test_room_per_class(tmp_path):
  # Each class counts against the room of its own location; a class on the device takes none.
  import optax

  tx = optax.adamw(1e-3)
  pad = lambda b: -(-b // 4096) * 4096  # noqa: E731
  held = lambda b: 8 * (2 * pad(64 * 128 * b) + pad(64 * b))  # noqa: E731 - b B a parameter
  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=MiB):
    host = _shape(8, "host")
    room = ssd.check_streamed_room(host, tx, sum_location="nvme", state_location="nvme")
    assert room["locations"] == dict(params="host", grad_sum="nvme", optimizer_state="nvme")
    assert room["resident_bytes"] == held(2) + held(4) + 2 * held(4) + held(4)
    assert room["room_bytes"] == 257 * MiB
    # the sum on the device: neither its bytes nor its second version in the store
    dev_sum = ssd.check_streamed_room(host, tx, sum_location="device", state_location="nvme")
    assert dev_sum["resident_bytes"] == held(2) + held(4) + 2 * held(4)
    assert dev_sum["micro_step_peak_bytes"] == dev_sum["resident_bytes"]
    # everything in the 1 MiB host tier does not fit; the message names each class's location
    with pytest.raises(ssd.StreamedRoomError) as info:
      ssd.check_streamed_room(host, tx, sum_location="host", state_location="nvme", name="gpt")
    msg = str(info.value)
    assert "does not fit its classes' locations (params 'host', grad_sum 'host', " in msg
    assert (
      "parameters 2 B (bfloat16) at 'host'" in msg and "gradient sum 4 B (float32) at 'host'" in msg
    )
    assert "by location 'host' " in msg and "host_tier_bytes 1048576 + capacity_bytes" in msg
    # the parameters on the device, the rest in the store
    dev = ssd.check_streamed_room(
      _shape(8, "device"), tx, sum_location="nvme", state_location="nvme"
    )
    assert dev["resident_bytes"] == held(4) + 2 * held(4) + held(4)
    with pytest.raises(
      ValueError, match="sum_location: expected 'host', 'nvme', 'host,nvme' or 'device'"
    ):
      ssd.check_streamed_room(host, tx, sum_location="disk")


def test_room_refused_with_the_arithmetic(tmp_path):
  import optax

  # 16 layers of 16448 bfloat16 parameters: 263168 parameters, 32 B each at the update's peak
  # (8.4 MB) against a 4 MiB host tier and 4 MiB of files.
  with ssd.configured(tmp_path / "s", capacity_bytes=4 * MiB, host_tier_bytes=4 * MiB):
    for location, room in (("host", "host_tier_bytes 4194304"), ("nvme", "capacity_bytes 4194304")):
      with pytest.raises(ssd.StreamedRoomError) as info:
        ssd.check_streamed_room(_shape(16, location), optax.adamw(1e-3), name="gpt")
      msg = str(info.value)
      assert msg.startswith("gpt: its streamed stack of 16 layers, 263168 parameters")
      for part in (
        "parameters 2 B (bfloat16)",
        "master copy 4 B",
        "optimizer state 8 B (6 arrays per layer of 3 parameter arrays)",
        "gradient sum 4 B (float32)",
        "= 18 B",
        "the update writes the new parameters, master copy and state beside the old",
        room,
        "in_place=True",
        "sum_dtype=bfloat16",
      ):
        assert part in msg, (part, msg)
    # host and files together: 8 MiB hold the in-place update with a bfloat16 sum (18 B)
    both = _shape(16, "host,nvme")
    with pytest.raises(ssd.StreamedRoomError, match="host_tier_bytes 4194304 \\+ capacity_bytes"):
      ssd.check_streamed_room(both, optax.adamw(1e-3))
    fits = ssd.check_streamed_room(both, optax.adamw(1e-3), sum_dtype=jnp.bfloat16, in_place=True)
    assert fits["peak_bytes"] <= fits["room_bytes"] == 8 * MiB
    assert ssd.stats()["bytes_written"] == 0  # nothing was stored
    # the optimizer's init refuses what cannot fit in the least room (in place, bfloat16 sum),
    # before storing anything: the stack's parameters (0.5 MB) fit, with the rest 4.7 MB do not
    init = functools.partial(_init_layer, dtype=jnp.bfloat16, width=64)
    stack = ssd.init_streamed(init, jax.random.key(0), 16, location="host")
    jax.block_until_ready(stack)
    ssd.flush()
    written = ssd.stats()["bytes_written"]
    with pytest.raises(ssd.StreamedRoomError, match="stack: its streamed stack of 16 layers"):
      ssd.init_streamed_optimizer(optax.adamw(1e-3), stack)
    assert ssd.stats()["bytes_written"] == written
  with pytest.raises(ValueError, match="sum_dtype"):
    ssd.check_streamed_room(_shape(2, "device"), sum_dtype=jnp.int32)
  with pytest.raises(TypeError, match="StreamedStack"):
    ssd.check_streamed_room({"w": jnp.zeros((2, 3))})


# ---------------------------------------------------------------------------------------------
# Predicted loads: the CPU reads every handle, and checks the engine's prediction against it (the
# GPU loads the predicted entry and checks it on the device: a wrong one fails the step)


def test_a_stacks_loads_are_predicted_from_each_pass_second_load_on(store):
  layers, leaves = 5, 3
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), layers, location="host")
  step = jax.jit(ssd.value_and_grad_streamed(_embed, _block, _head), donate_argnums=4)
  ep, hp = _side()
  sums, predicted = None, []
  ssd.reset_stats()
  for batch in _batches(3):
    _, sums = jax.block_until_ready(step(ep, stack, hp, batch, sums))
    predicted.append(ssd.stats()["speculative_loads"])
  jax.block_until_ready(ssd.map_stack(_sgd, stack, sums[1]))
  s = ssd.stats()
  assert s["handle_mismatches"] == 0, s
  # A pass's first load of a leaf reads its handle (every pass here gives its layer order, and
  # so did the passes that stored the stacks): the forward pass loads L layers, the backward
  # pass L - 1 (the last layer's parameters stay from the forward pass), the sums L from the
  # second micro-step on; the update reads both stacks once.
  fwd, bwd, sum_loads = leaves * (layers - 1), leaves * (layers - 2), leaves * (layers - 1)
  assert np.diff([0] + predicted).tolist() == [fwd + bwd, fwd + bwd + sum_loads] + [
    fwd + bwd + sum_loads
  ]
  assert s["speculative_loads"] == predicted[-1] + 2 * leaves * (layers - 1)


@pytest.mark.parametrize("how", ["one_jit", pytest.param("clipped_update", marks=pytest.mark.slow)])
def test_no_load_is_mispredicted(store, how):
  # One program that loads a stack in several passes (micro-steps and an update in one jit: the
  # first micro-step's sums and the second's share their site and their execution), and an
  # update whose global norm reads the sums once before the update reads them again.
  ssd.reset_stats()
  if how == "one_jit":
    layers = 5
    stack = ssd.init_streamed(_init_layer, jax.random.key(0), layers, location="host")
    micro = ssd.value_and_grad_streamed(_embed, _block, _head)

    @jax.jit
    def train_step(ep, stack, hp, batches):
      sums = None
      for b in batches:
        _, sums = micro(ep, stack, hp, b, sums)
      return ssd.map_stack(_sgd, stack, sums[1])

    jax.block_until_ready(train_step(*_side()[:1], stack, _side()[1], _batches(3)))
  else:
    _TRAINS.pop(("host", "clip_adamw", "float32", 5, 2, 3, False), None)
    _train("host", "clip_adamw", layers=5, steps=2, micro=3)
  s = ssd.stats()
  assert s["handle_mismatches"] == 0 and s["speculative_loads"] > 0, s


# ---------------------------------------------------------------------------------------------
# Traps: a stack in the wrong role, an offloaded or plain optax state, a carry that is a pytree


def _adam_stack_state_sums():
  import optax

  tx = optax.adam(0.1)  # float32 parameters: a swapped call's state check passes
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  state = ssd.init_streamed_optimizer(tx, stack)
  ep, hp = _side()
  _, sums = _micro_step(False)(ep, stack, hp, _batches(1)[0], None)
  return tx, stack, state, sums[1]


def test_a_stack_in_the_wrong_role_is_refused(store):
  # The parameters and the gradient sum swapped ran, updating the sum with the parameters as
  # its gradients; each entry point now names the argument, what it got and the call order.
  tx, stack, state, stack_sum = _adam_stack_state_sums()
  swapped = r"look swapped.*apply_gradients\(tx, grads, opt_state, params\)"
  with pytest.raises(ValueError, match=r"params: a gradient sum \('grad_sum' stack\).*" + swapped):
    ssd.apply_gradients(tx, stack, state, stack_sum)
  order = r"apply_streamed_update\(tx, stack, stack_sum, tx_state\)"
  with pytest.raises(ValueError, match=r"stack: a gradient sum .*look swapped.*" + order):
    ssd.apply_streamed_update(tx, stack_sum, stack, state)
  # The optimizer state's per-layer stack where the parameters or the sum are expected.
  with pytest.raises(ValueError, match=r"grads: an optimizer state's per-layer leaves"):
    ssd.apply_gradients(tx, state.per_layer, state, stack)
  with pytest.raises(ValueError, match=r"stack_sum: an optimizer state's per-layer leaves"):
    ssd.apply_streamed_update(tx, stack, state.per_layer, state)
  with pytest.raises(ValueError, match=r"stack_sum: an optimizer state's per-layer leaves"):
    ssd.streamed_global_norm(state.per_layer)
  # A sum where the parameters are expected: the optimizer's init and the micro-step.
  with pytest.raises(ValueError, match=r"stack: a gradient sum \('grad_sum' stack\)"):
    ssd.init_streamed_optimizer(tx, stack_sum)
  step = _micro_step(False)
  with pytest.raises(ValueError, match=r"stack: a gradient sum \('grad_sum' stack\)"):
    step(*_side()[:1], stack_sum, _side()[1], _batches(1)[0], None)
  with pytest.raises(TypeError, match=r"stacks\[0\]: .*StreamedOptState.*per_layer"):
    ssd.map_stack(lambda p: p, state)


def test_an_offload_optimizer_tx_is_refused_by_name(store):
  # offload_optimizer's transformation with a stack was blamed on an "Adafactor-style shape
  # dependence": the stack's state is streamed already; the plain optax tx is wanted.
  import optax

  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  offloaded = ssd.offload_optimizer(optax.adam(0.1))
  fix = r"tx: .*offload_optimizer.*streamed already.*the plain optax transformation"
  with pytest.raises(TypeError, match=fix):
    ssd.init_streamed_optimizer(offloaded, stack)
  with pytest.raises(TypeError, match=fix):
    ssd.check_streamed_room(stack, offloaded)
  wrapped = ssd.offload_optimizer(optax.MultiSteps(optax.adam(0.1), 2))
  with pytest.raises(TypeError, match=fix):
    ssd.init_streamed_optimizer(wrapped, stack)


def test_a_plain_optax_state_with_a_stack_is_refused(store):
  # tx.init's state of the stacked tree (or of the stack's handles) with a stack: a raw pytree
  # error (or an update of the handles) before; now a message naming init_streamed_optimizer.
  tx, stack, _, stack_sum = _adam_stack_state_sums()
  for plain in (tx.init(ssd.stack_to_tree(stack)), tx.init(stack)):
    with pytest.raises(TypeError, match=r"opt_state: .*init_streamed_optimizer\(tx, params\)"):
      ssd.apply_gradients(tx, stack_sum, plain, stack)
    with pytest.raises(TypeError, match=r"tx_state: .*init_streamed_optimizer\(tx, stack\)"):
      ssd.apply_streamed_update(tx, stack, stack_sum, plain)


def test_a_carry_that_is_a_pytree_is_refused_with_what_it_got(store):
  # An embedding and block that carry (hidden state, mask): the shape error's own message
  # raised an AttributeError formatting the tuple's dtype.
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 2)
  ep, hp = _side()
  (batch,) = _batches(1)

  def embed(ep, batch):
    x = _embed(ep, batch)
    return x, jnp.ones(x.shape[:1], bool)

  def block(p, carry):
    x, mask = carry
    return _block(p, x), mask

  step = jax.jit(ssd.value_and_grad_streamed(embed, block, lambda hp, y, b: _head(hp, y[0], b)))
  got = r"got tuple of 2 arrays \(float32\[4, 16\], bool\[4\]\)"
  with pytest.raises(ValueError, match=r"embed_fn must return one array.*" + got):
    step(ep, stack, hp, batch)
  pair = jax.jit(ssd.value_and_grad_streamed(_embed, lambda p, x: (_block(p, x), x), _head))
  with pytest.raises(
    ValueError, match=r"block_fn must return an array shaped like its input x \(float32\[4, 16\]\)"
  ):
    pair(ep, stack, hp, batch)


def test_the_layer_stream_is_a_package_of_files_under_700_lines():
  # One concern per file, each with a header docstring saying what it owns; every name the
  # single module had stays importable from jax_ssdtrain._src.layer_stream.
  import ast
  import importlib
  from pathlib import Path

  package = Path(ssd.__file__).parent / "_src" / "layer_stream"
  assert package.is_dir(), "jax_ssdtrain/_src/layer_stream/ is not a package"
  for path in sorted(package.glob("*.py")):
    text = path.read_text()
    assert len(text.splitlines()) <= 700, f"{path.name}: {len(text.splitlines())} lines"
    assert ast.get_docstring(ast.parse(text)), f"{path.name}: no header docstring"
  module = importlib.import_module("jax_ssdtrain._src.layer_stream")
  missing = [name for name in _LAYER_STREAM_NAMES if not hasattr(module, name)]
  assert not missing, missing


# Every name the single module defined or imported, but the micro-step's (now in
# jax_ssdtrain._src.stream_scan): other modules and helpers import them from
# jax_ssdtrain._src.layer_stream.
_LAYER_STREAM_NAMES = """
HANDLE_DTYPE _Layout StreamedStack _site_of _parse_location _make_layout master_weights_of
_class_locations _check_num_layers _check_stack _chain_loads _PASSES StreamPass new_pass
_load_layer _token _token32 _after _store_layer _stacked _scan_layers init_streamed _init_jit
stack_from_tree _from_tree_jit stack_to_tree _to_tree_jit map_stack _map_jit _check_bool
_sum_layout _PROBE_LAYERS _OptSpec _params_key
StreamedOptState _check_tx _opt_params _SPECS _opt_spec _make_opt_spec _opt_layout
init_streamed_optimizer _opt_init_jit _zeros _check_opt_state _check_scalar _sum_of_squares
streamed_global_norm _global_norm_jit _mean_grad _clip apply_streamed_update _update_jit
apply_device_update _ENTRY_ALIGN StreamedRoomError _dtype_name store_room STACK_CLASSES _STORED
_fits read_ahead_sizes check_streamed_room _room_args room_arithmetic
ensure_configured store_directories COUNTED_OR_LATER TIER_CODES Location free_bytes_total load_p
opaque_copy store_p new_site_id
""".split()
