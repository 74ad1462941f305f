"""One loss over a whole model whose stack of blocks streams (jax_ssdtrain._src.stream_scan):
``ssd.scan_stack`` inside the loss, ``ssd.value_and_grad`` around it. Against the same program
with the stack on the device (bit for bit) and against ``jax.value_and_grad`` of the same model
with the stack as ordinary arrays (within a tolerance); a pytree carry, per-layer inputs with
RNG keys, closed-over values, two stacks and a frozen one, accumulation over micro-batches,
misuse; a Flax linen and an NNX model adopting it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import assert_bitwise

import jax_ssdtrain as ssd

MiB = 1 << 20
D, V, OUT, L = 8, 5, 3, 3  # width, input features, outputs, layers


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=128 * MiB, host_tier_bytes=32 * MiB):
    yield


def _init_layer(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "w": jax.random.normal(k1, (D, D)) / np.sqrt(D),
    "b": 0.1 * jax.random.normal(k2, (D,)),
    "g": {"scale": 1.0 + 0.1 * jax.random.normal(k3, (D,))},
  }


def _stacked(layers=L, key=0):
  return jax.vmap(_init_layer)(jax.random.split(jax.random.key(key), layers))


def _side():
  return {
    "embed": jax.random.normal(jax.random.key(1), (V, D)) / np.sqrt(V),
    "head": jax.random.normal(jax.random.key(2), (D, OUT)) / np.sqrt(D),
    "temp": jnp.float32(0.7),  # closed over by the block: its cotangent is summed over layers
    "gates": jnp.linspace(0.5, 1.0, L),  # a per-layer input in xs that is a parameter
  }


def _batches(n, rows=4):
  return [
    {
      "x": jax.random.normal(jax.random.key(10 + i), (rows, V)),
      "y": jax.random.normal(jax.random.key(20 + i), (rows, OUT)),
      "mask": jnp.arange(rows) < rows - 1,  # in the carry: a leaf with no cotangent
      "t": jnp.float32(0.3 + i),  # the positions' phase: closed over, not differentiated
      "key": jax.random.key(30 + i),  # split per layer: dropout
      "width": jnp.int32(D - 1 - i % 2),  # a closed-over integer: the columns' mask
    }
    for i in range(n)
  ]


def _lax_scan(f, init, stack, xs=None):
  """The reference: the same scan over ordinary arrays."""
  return jax.lax.scan(lambda c, a: f(c, *a), init, (stack, xs))


def _model(scan):
  def loss_fn(params, batch):
    h = batch["x"] @ params["embed"]
    positions = jnp.cos(jnp.arange(D) * batch["t"])
    columns = jnp.arange(D) < batch["width"]  # a traced bool mask the block closes over

    def block(carry, p, x):
      h, mask = carry
      u = jnp.tanh((h @ p["w"] + p["b"] + positions) * params["temp"])
      keep = jax.random.bernoulli(x["key"], 0.75, u.shape)  # dropout, recomputed alike
      u = jnp.where(keep & columns, u / 0.75, 0.0)
      h = h + x["gate"] * u * p["g"]["scale"] * mask[:, None]
      return (h, mask), jnp.mean(h**2)

    xs = {"key": jax.random.split(batch["key"], L), "gate": params["gates"]}
    (h, _), ys = scan(block, (h, batch["mask"]), params["blocks"], xs=xs)
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2) + 0.1 * jnp.sum(ys)

  return loss_fn


_loss = _model(ssd.scan_stack)
_reference_loss = _model(_lax_scan)

_RUNS = {}


def _run(location, save_inputs="device", micro=3):
  """Micro-steps over ``micro`` batches (sums passed on), and each batch's gradients alone;
  read back to NumPy."""
  key = (location, save_inputs, micro)
  if key in _RUNS:
    return _RUNS[key]
  stack = ssd.stack_from_tree(_stacked(), location=location)
  params = {**_side(), "blocks": stack}
  step = jax.jit(ssd.value_and_grad(_loss, save_inputs=save_inputs), donate_argnames="sums")
  ssd.reset_stats()
  sums, losses, alone = None, [], []
  for batch in _batches(micro):
    loss, grads = step(params, batch)
    alone.append(_to_numpy(grads))
    loss, sums = step(params, batch, sums=sums)
    losses.append(loss)
  out = {"losses": np.asarray(losses), "sums": _to_numpy(sums), "alone": alone}
  out["stats"] = ssd.stats()
  out["eval"] = np.asarray(jax.jit(_loss)(params, _batches(1)[0]))
  _RUNS[key] = out
  return out


def _to_numpy(grads):
  grads = dict(grads)
  assert isinstance(grads["blocks"], ssd.StreamedStack) and "grad_sum" in repr(grads["blocks"])
  grads["blocks"] = ssd.stack_to_tree(grads["blocks"])
  return jax.tree.map(np.asarray, grads)


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
  flat, tree = jax.tree_util.tree_flatten_with_path(got)
  assert tree == jax.tree.structure(want)
  for (path, a), b in zip(flat, jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("location,save_inputs", [("host", "device"), ("nvme", "host")])
def test_store_equals_device_bit_for_bit(store, location, save_inputs):
  # The losses, every gradient (the stack's sum, the embedding's and head's, the closed-over
  # scalar's and the per-layer gates') over 3 micro-batches, each batch's alone, and the loss
  # evaluated without gradients: the store's program equals the device reference's. The nvme
  # case also saves each layer's carry input in the host tier (the mask stays on the device).
  got, want = _run(location, save_inputs), _run("device")
  assert_bitwise(
    {k: got[k] for k in ("losses", "sums", "alone", "eval")},
    {k: want[k] for k in ("losses", "sums", "alone", "eval")},
  )
  s = got["stats"]  # each pass's loads in the order the engine predicted them
  assert s["handle_mismatches"] == 0 and s["speculative_loads"] > 0, s


def test_equals_jax_value_and_grad_of_the_same_model(store):
  # float32: against jax.value_and_grad of the same loss with lax.scan over the stacked arrays,
  # per batch and summed over 3 micro-batches (XLA may order the two programs' sums
  # differently); the accumulated sums equal the sum of each batch's gradients.
  got = _run("host")
  params = {**_side(), "blocks": _stacked()}
  ref = jax.jit(jax.value_and_grad(_reference_loss))
  total = None
  for i, batch in enumerate(_batches(3)):
    loss, g = ref(params, batch)
    np.testing.assert_allclose(got["losses"][i], loss, rtol=1e-6)
    _assert_close(got["alone"][i], g)
    total = g if total is None else jax.tree.map(jnp.add, total, g)
  _assert_close(got["sums"], total)
  summed = jax.tree.map(lambda *g: (g[0] + g[1]) + g[2], *got["alone"])
  _assert_close(got["sums"], summed, rtol=1e-6, atol=1e-7)
  # the same loss with the stack as ordinary arrays: scan_stack is lax.scan, under jax.grad too
  _, plain = jax.jit(jax.value_and_grad(_loss))(params, _batches(1)[0])
  _assert_close(got["alone"][0], plain)
  np.testing.assert_allclose(got["eval"], got["losses"][0], rtol=1e-6)
  assert np.all(np.abs(got["sums"]["temp"]) > 0) and np.all(np.abs(got["sums"]["gates"]) > 0)


# ---------------------------------------------------------------------------------------------
# Several stacks


def _enc_layer(key):
  return {"w": jax.random.normal(key, (D, D)) / np.sqrt(D)}


def _dec_layer(key):
  k1, k2 = jax.random.split(key)
  return {"u": jax.random.normal(k1, (D, D)) / np.sqrt(D), "c": 0.1 * jax.random.normal(k2, (D,))}


def _two_stacks(scan):
  def loss_fn(params, frozen, batch):
    src = batch["x"] @ params["embed"]
    enc, _ = scan(lambda h, p, _: (h + jnp.tanh(h @ p["w"]), None), src, params["encoder"])
    # the decoder's blocks close over the encoder's output (cross-attention's role)
    dec_block = lambda h, p, _: (jnp.tanh(h @ p["u"] + p["c"] * enc), None)
    dec, _ = scan(dec_block, src, params["decoder"])
    out, _ = scan(lambda h, p, _: (h + jnp.sin(h @ p["w"]), None), dec, frozen)  # not trained
    return jnp.mean((out @ params["head"] - batch["y"]) ** 2)

  return loss_fn


def test_two_stacks_each_with_its_sum_and_a_frozen_one(store):
  # An encoder's and a decoder's stack (other depths and structures), each its own sum, the
  # decoder's blocks closing over the encoder's output; a third stack in an argument that is
  # not differentiated is scanned too (its blocks recomputed, no sum). The sums on the device
  # (sum_location) while the stacks stream from the host tier; against jax.value_and_grad.
  # depths 1, 4 and 2: the backward pass's last layer alone; with a scan; without one
  enc = jax.vmap(_enc_layer)(jax.random.split(jax.random.key(3), 1))
  dec = jax.vmap(_dec_layer)(jax.random.split(jax.random.key(4), 4))
  frz = jax.vmap(_enc_layer)(jax.random.split(jax.random.key(5), 2))
  side = {"embed": _side()["embed"], "head": _side()["head"]}
  params = {**side, "encoder": ssd.stack_from_tree(enc), "decoder": ssd.stack_from_tree(dec)}
  step = jax.jit(ssd.value_and_grad(_two_stacks(ssd.scan_stack), sum_location="device"))
  batch = _batches(1)[0]
  loss, grads = step(params, ssd.stack_from_tree(frz), batch)
  assert set(grads) == {"embed", "head", "encoder", "decoder"}
  for name in ("encoder", "decoder"):
    assert grads[name].location is ssd.Location.DEVICE and "grad_sum" in repr(grads[name])
  got = {k: ssd.stack_to_tree(v) if k in ("encoder", "decoder") else v for k, v in grads.items()}
  ref = jax.value_and_grad(_two_stacks(_lax_scan))
  want_loss, want = ref({**side, "encoder": enc, "decoder": dec}, frz, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  _assert_close(jax.tree.map(np.asarray, got), want)


def test_in_place_releases_the_old_sum(store):
  # in_place: the backward pass's loads of the old sum are its entries' last; the sums over 3
  # micro-batches equal the default's bit for bit, and each old sum is gone (loading it raises).
  params = {**_side(), "blocks": ssd.stack_from_tree(_stacked())}
  step = jax.jit(ssd.value_and_grad(_loss, in_place=True))
  batches = _batches(3)
  _, first = step(params, batches[0])
  _, sums = step(params, batches[1], sums=first)
  with pytest.raises(Exception, match="ssdtrain"):
    jax.block_until_ready(ssd.stack_to_tree(first["blocks"]))
  _, sums = step(params, batches[2], sums=sums)
  assert_bitwise(_to_numpy(sums), _run("host")["sums"])


# ---------------------------------------------------------------------------------------------
# Misuse


def _tiny_loss(params, batch):
  h = batch["x"] @ params["embed"]
  h, _ = ssd.scan_stack(lambda h, p, _: (h + jnp.tanh(h @ p["w"]), None), h, params["blocks"])
  return jnp.mean(h**2)


def _tree(grads):
  return jax.tree.map(np.asarray, {**grads, "blocks": ssd.stack_to_tree(grads["blocks"])})


def test_misuse_is_refused_with_the_fix(store):
  enc = jax.vmap(_enc_layer)(jax.random.split(jax.random.key(3), 2))
  host = ssd.stack_from_tree(enc)
  params = {"embed": _side()["embed"], "blocks": ssd.stack_from_tree(enc, location="device")}
  batch = _batches(1)[0]
  fix = r"ssd\.value_and_grad\(loss_fn\)"
  # plain jax.grad: of the whole parameters (a stack on the device: its arrays are floats) and
  # of the embedding alone with a stack in the store
  with pytest.raises(TypeError, match=fix):
    jax.grad(_tiny_loss)(params, batch)
  with pytest.raises(TypeError, match=fix):
    jax.grad(lambda e: _tiny_loss({"embed": e, "blocks": host}, batch))(params["embed"])
  # evaluation (no gradient) works without value_and_grad
  assert np.isfinite(jax.jit(_tiny_loss)({**params, "blocks": host}, batch))

  # a stack scanned twice in one loss
  def twice(params, batch):
    h = batch["x"] @ params["embed"]
    for _ in range(2):
      h, _ = ssd.scan_stack(lambda h, p, _: (h @ p["w"], None), h, params["blocks"])
    return jnp.mean(h)

  with pytest.raises(ValueError, match=r"args\[0\]\['blocks'\].*scanned a second time"):
    ssd.value_and_grad(twice)({**params, "blocks": host}, batch)
  with pytest.raises(ValueError, match=r"args\[0\]\['other'\] is the stack args\[0\]\['blocks'\]"):
    ssd.value_and_grad(twice)({**params, "blocks": host, "other": host}, batch)
  _, grads = jax.jit(ssd.value_and_grad(_tiny_loss))({**params, "blocks": host}, batch)
  # ssd.grad with has_aux: the gradients alone, and the aux
  with_aux = lambda p, b: (_tiny_loss(p, b), {"seven": 7.0})
  g, aux = jax.jit(ssd.grad(with_aux, has_aux=True))({**params, "blocks": host}, batch)
  assert float(aux["seven"]) == 7.0
  _assert_close(_tree(g), _tree(grads), rtol=1e-6)
  # a stack the loss does not scan: its gradient is a zero sum
  _, zero = ssd.value_and_grad(lambda p, b: jnp.sum(p["embed"]))({**params, "blocks": host}, batch)
  assert not np.any(ssd.stack_to_tree(zero["blocks"])["w"])
  # a gradient sum where parameters are expected: to value_and_grad and to scan_stack
  with pytest.raises(ValueError, match=r"args\[0\]\['blocks'\] is a stack of kind 'grad_sum'"):
    ssd.value_and_grad(_tiny_loss)({**params, "blocks": grads["blocks"]}, batch)
  with pytest.raises(ValueError, match="kind 'grad_sum'.*not parameters"):
    _tiny_loss({**params, "blocks": grads["blocks"]}, batch)
  # sums that are not this loss's gradients
  with pytest.raises(ValueError, match="sums: expected the gradients an earlier call returned"):
    ssd.value_and_grad(_tiny_loss)(params, batch, sums={"embed": grads["embed"]})
  with pytest.raises(ValueError, match=r"sums \(at args\[0\]\['blocks'\]\): expected"):
    ssd.value_and_grad(_tiny_loss)(params, batch, sums=grads)  # a host sum, a device stack
  # the body: a carry of another dtype; xs without the layer axis; arrays, not a stack
  h = jnp.ones((2, D))
  with pytest.raises(TypeError, match="carry of its input carry's structure"):
    ssd.scan_stack(lambda h, p, _: (h.astype(jnp.bfloat16), None), h, host)
  with pytest.raises(ValueError, match=r"xs\['t'\] has shape \[3\].*layer axis of 2"):
    ssd.scan_stack(lambda h, p, x: (h, None), h, host, xs={"t": jnp.ones(3)})
  with pytest.raises(TypeError, match="expected a StreamedStack.*or a stacked tree of arrays"):
    ssd.scan_stack(lambda h, p, x: (h, None), h, {"w": 1.0})
  with pytest.raises(TypeError, match=r"args\[0\]\['n'\] has dtype int32"):
    ssd.value_and_grad(lambda p, b: _tiny_loss(p, b))({**params, "n": jnp.int32(1)}, batch)
  with pytest.raises(TypeError, match="pass has_aux=True"):
    ssd.value_and_grad(lambda p, b: (_tiny_loss(p, b), 1.0))(params, batch)


# ---------------------------------------------------------------------------------------------
# Adoption: a Flax linen model made by nn.scan, an NNX stack made by nnx.vmap


def _adam_train(loss_fn, params, batches):
  """A few Adam steps: the stack's update streams (its state in the store), the rest is optax's."""
  optax = pytest.importorskip("optax")
  tx = optax.adam(1e-2)
  side = {k: v for k, v in params.items() if k != "blocks"}
  state = (tx.init(side), ssd.init_streamed_optimizer(tx, params["blocks"]))

  @jax.jit
  def train_step(params, state, batch):
    loss, grads = ssd.value_and_grad(loss_fn)(params, batch)
    params = dict(params)
    stack, stack_state = ssd.apply_gradients(
      tx, grads.pop("blocks"), state[1], params.pop("blocks")
    )
    side, side_state = ssd.apply_gradients(tx, grads, state[0], params)
    return loss, {**side, "blocks": stack}, (side_state, stack_state)

  losses = []
  for batch in batches:
    loss, params, state = train_step(params, state, batch)
    losses.append(float(loss))
  return losses, params


def test_flax_linen_nn_scan_model(store):
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return h + nn.Dense(D)(jnp.tanh(h)), None

  class Model(nn.Module):  # the blocks made by nn.scan: their parameters have a layer axis
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(D, name="embed")(x)
      scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
      h, _ = scan(name="blocks")(h, None)
      return nn.Dense(OUT, name="head")(h)

  batches = _batches(1) * 3  # one batch, three steps: the loss goes down
  params = Model().init(jax.random.key(0), batches[0]["x"])["params"]

  # adoption: the stack into the store, the model's pieces applied in one loss
  def loss_fn(params, batch):
    h = nn.Dense(D).apply({"params": params["embed"]}, batch["x"])
    body = lambda h, layer, _: Block().apply({"params": layer}, h, None)
    h, _ = ssd.scan_stack(body, h, params["blocks"])
    y = nn.Dense(OUT).apply({"params": params["head"]}, h)
    return jnp.mean((y - batch["y"]) ** 2)

  streamed = {**params, "blocks": ssd.stack_from_tree(params["blocks"])}
  losses, trained = _adam_train(loss_fn, streamed, batches)

  # the same steps with the whole model and optax
  optax = pytest.importorskip("optax")
  tx = optax.adam(1e-2)
  ref_loss = lambda p, b: jnp.mean((Model().apply({"params": p}, b["x"]) - b["y"]) ** 2)

  @jax.jit
  def ref_step(params, state, batch):
    loss, g = jax.value_and_grad(ref_loss)(params, batch)
    updates, state = tx.update(g, state, params)
    return loss, optax.apply_updates(params, updates), state

  state, want = tx.init(params), []
  for batch in batches:
    loss, params, state = ref_step(params, state, batch)
    want.append(float(loss))
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert losses[2] < losses[1] < losses[0]
  got = {**trained, "blocks": ssd.stack_to_tree(trained["blocks"])}
  _assert_close(jax.tree.map(np.asarray, got), params, rtol=1e-4, atol=1e-6)


def test_nnx_vmap_made_stack(store):
  nnx = pytest.importorskip("flax.nnx")

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h):
      return h + self.lin(jnp.tanh(h))

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_blocks(rngs):
    return Block(rngs)

  blocks = make_blocks(nnx.Rngs(0))  # one Block whose parameters have a layer axis
  graphdef, state = nnx.split(blocks)
  side = _side()
  params = {"embed": side["embed"], "head": side["head"], "blocks": ssd.stack_from_tree(state)}

  def loss_fn(params, batch):
    body = lambda h, layer, _: (nnx.merge(graphdef, layer)(h), None)
    h, _ = ssd.scan_stack(body, batch["x"] @ params["embed"], params["blocks"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

  batches = _batches(3)
  # the first gradients against nnx's own: the stacked module scanned as ordinary arrays
  _, grads = jax.jit(ssd.value_and_grad(loss_fn))(params, batches[0])

  def ref(embed, head, state, batch):
    body = lambda h, layer: (nnx.merge(graphdef, layer)(h), None)
    h, _ = jax.lax.scan(body, batch["x"] @ embed, state)
    return jnp.mean((h @ head - batch["y"]) ** 2)

  want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(side["embed"], side["head"], state, batches[0])
  got = (grads["embed"], grads["head"], ssd.stack_to_tree(grads["blocks"]))
  _assert_close(jax.tree.map(np.asarray, got), want)
  losses, trained = _adam_train(loss_fn, params, batches[:1] * 3)
  assert losses[2] < losses[1] < losses[0]
  nnx.update(blocks, ssd.stack_to_tree(trained["blocks"]))  # back into the module
  assert isinstance(blocks.lin.kernel, nnx.Param)
