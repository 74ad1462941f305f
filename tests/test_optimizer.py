"""Optimizer state in the store (jax_ssdtrain._src.optimizer): optax's own
transformations wrapped by offload_optimizer against the same transformations on the device, the
refusals, MultiSteps around it, one copy of the state in the store; and the "host,nvme" location
(the host tier spilling to the files) for activations."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import nested_norms, run_module, run_worker, skip_without_gpus
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import lifetimes
from jax_ssdtrain._src.optimizer import (
  OffloadedState,
  OptimizerOffloadError,
  offload_optimizer,
  optimizer_state,
)

MiB = 1 << 20
SHARDED_WORKER = "_sharded_optimizer_worker.py"  # the state sharded over several devices


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    yield


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  # 300 rows: chunks of 32 rows and a shorter last one; "b" stays on the device (min_bytes).
  return {
    "a": jax.random.normal(k[0], (64, 512)),
    "b": jax.random.normal(k[1], (16,)),
    "c": jax.random.normal(k[2], (300, 256)),
  }


def _loss(p, x):
  return jnp.sum(jnp.tanh(x @ p["a"] + p["b"][:1]) ** 2) + jnp.sum(jnp.sin(p["c"]) ** 2)


def _train(tx, steps, params=None):
  params = _params() if params is None else params
  x = jax.random.normal(jax.random.key(7), (16, 64))

  @jax.jit
  def step(p, s):
    g = jax.grad(_loss)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  history = []
  for _ in range(steps):
    params, state = step(params, state)
    history.append(params)
  return history, state


def _jitted_steps(tx, apply, x, params, state, steps):
  """``steps`` jitted, donating steps of ``_loss`` at ``x``: ``ssd.apply_gradients`` (``apply``)
  or ``update`` + ``optax.apply_updates``. Returns (the parameters after each step, as NumPy
  arrays: the next step donates them; the last state; XLA's memory analysis of the step)."""

  def step(p, s):
    g = jax.grad(_loss)(p, x)
    if apply:
      return ssd.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  jitted = jax.jit(step, donate_argnums=(0, 1))
  memory = jitted.lower(params, state).compile().memory_analysis()
  history = []
  for _ in range(steps):
    params, state = jitted(params, state)
    history.append(jax.tree.map(np.asarray, params))
  return history, state, memory


def _project_chain():
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 100)
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.masked(optax.adamw(sched), mask))


def _shared_trace():
  """Two moments through one jitted helper: its body is traced once and called twice (as
  optax's bias correction is under jax >= 0.11): each call's values must stay its own."""

  @jax.jit
  def ema(m, g, decay):
    return decay * m + (1 - decay) * g

  def init(p):
    return (jax.tree.map(jnp.zeros_like, p), jax.tree.map(jnp.zeros_like, p))

  def update(g, s, p=None):
    d1, d2 = jnp.float32(0.9), jnp.float32(0.5)
    m1 = jax.tree.map(lambda m, x: ema(m, x, d1), s[0], g)
    m2 = jax.tree.map(lambda m, x: ema(m, x, d2), s[1], g)
    return jax.tree.map(lambda a, b: -1e-2 * (3 * a - 2 * b), m1, m2), (m1, m2)

  return optax.GradientTransformation(init, update)


TRANSFORMS = {
  "chain": _project_chain,
  "adam": lambda: optax.adam(1e-3),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "lion": lambda: optax.lion(1e-4),
  "shared_trace": _shared_trace,
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("location", ["host", "nvme"])
def test_matches_the_transformation_on_the_device(store, name, location):
  tx = TRANSFORMS[name]()
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  ours = offload_optimizer(tx, location=location, **kw)
  got, got_state = _train(ours, 4)
  assert isinstance(got_state, OffloadedState) and len(got_state.handles) >= 2
  # The same computation with the state on the device: bit for bit.
  same, same_state = _train(offload_optimizer(tx, location="device", **kw), 4)
  for s, g in zip(same, got):
    for k in s:
      assert (np.asarray(g[k]) == np.asarray(s[k])).all(), (k, np.abs(g[k] - s[k]).max())
  for a, b in zip(
    jax.tree.leaves(optimizer_state(same_state)), jax.tree.leaves(optimizer_state(got_state))
  ):
    assert (np.asarray(a) == np.asarray(b)).all()
  # tx itself on the device: the same operations on the same values, but XLA rewrites some of
  # them by the program's shape (x / s as x * (1 / s); p + lr * u as one fused multiply-add when
  # the update is not materialised): a few ulps. A wrong chunk or leaf shows as ~1e-3.
  want, want_state = _train(tx, 4)
  assert np.abs(np.asarray(want[-1]["a"]) - np.asarray(_params()["a"])).max() > 0  # it trained
  for w, g in zip(want, got):
    for k in w:
      np.testing.assert_allclose(np.asarray(g[k]), np.asarray(w[k]), rtol=1e-5, atol=1e-7)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5),
    want_state,
    optimizer_state(got_state),
  )


def test_one_step_state_is_bit_exact(store):
  # From the same inputs, the new state (moments) is computed by the same operations on the
  # same values: equal bit for bit to tx's.
  tx = optax.adam(1e-3)
  ours = offload_optimizer(tx, min_bytes=4096, chunk_bytes=32 << 10)
  p = _params()
  g = jax.grad(_loss)(p, jax.random.normal(jax.random.key(7), (16, 64)))
  _, want = jax.jit(tx.update)(g, tx.init(p), p)
  _, got = jax.jit(ours.update)(g, ours.init(p), p)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(optimizer_state(got))):
    assert (np.asarray(a) == np.asarray(b)).all()


def test_the_state_is_stored_as_loaded_later_in_store_order(store):
  # The engine makes such an entry's host copy at once instead of keeping the newest stores in
  # device staging for loads of the same execution (the next update loads the oldest first,
  # read ahead into that staging room): every store of the update carries LATER_IN_ORDER.
  ours = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  p = _params()
  text = jax.jit(ours.update).lower(p, ours.init(p), p).as_text()
  stores = re.findall(r"ssdtrain_store.*?uses = (-?\d+)", text)
  assert len(stores) >= 4 and set(stores) == {str(lifetimes.LATER_IN_ORDER)}, stores


def test_min_bytes_zero_keeps_scalars_on_the_device(store):
  # A step count stored alone would be read by every parameter's update (one group of all of
  # them: refused); init also returns it as a constant, which the plan must take.
  tx = offload_optimizer(optax.adam(1e-3), location="host", min_bytes=0, chunk_bytes=32 << 10)
  history, state = _train(tx, 2)
  want, _ = _train(optax.adam(1e-3), 2)
  assert len(state.handles) == 6 and len(state.device) == 1  # mu and nu of a, b, c; the count
  np.testing.assert_allclose(history[-1]["c"], want[-1]["c"], rtol=1e-5, atol=1e-7)
  assert int(optimizer_state(state)[0].count) == 2


@pytest.mark.parametrize("name", ["chain", "adam", "sgd_momentum"])
def test_apply_gradients_updates_the_parameters_in_place(store, name):
  tx = TRANSFORMS[name]()
  x = jax.random.normal(jax.random.key(7), (16, 64))

  def run(tx, apply, steps=3):
    history, s, memory = _jitted_steps(tx, apply, x, _params(), tx.init(_params()), steps)
    return history[-1], s, memory.temp_size_in_bytes

  ours = {
    loc: offload_optimizer(tx, location=loc, min_bytes=4096, chunk_bytes=32 << 10)
    for loc in ("device", "host", "nvme")
  }
  host, host_state, host_temp = run(ours["host"], True)
  for loc in ("device", "nvme"):  # bit for bit the same streamed program
    p, _, _ = run(ours[loc], True)
    for k in host:
      np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(host[k]), err_msg=(loc, k))
  plain, plain_state, plain_temp = run(ours["host"], False)
  want, _, _ = run(tx, False)  # tx itself, its state on the device
  for k in host:  # an ulp here and there (see apply_gradients)
    np.testing.assert_allclose(np.asarray(host[k]), np.asarray(plain[k]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(host[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-7)
  # No whole array of updates of the streamed leaves ("a", "c"; "b" stays on the device).
  # XLA's CPU buffer assignment shows all of it; the GPU's reuses more buffers (less saved).
  streamed = (_params()["a"].nbytes + _params()["c"].nbytes) * 9 // 10
  if jax.default_backend() == "cpu":
    assert plain_temp - host_temp >= streamed, (plain_temp, host_temp)
  assert host_temp < plain_temp, (plain_temp, host_temp)
  # Any other transformation: update + apply_updates, as they are.
  p = _params()
  s = tx.init(p)
  g = jax.grad(_loss)(p, x)
  u, s2 = tx.update(g, s, p)
  got, s3 = ssd.apply_gradients(tx, g, s, p)
  for a, b in zip(jax.tree.leaves((optax.apply_updates(p, u), s2)), jax.tree.leaves((got, s3))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_rounds_to(params, master):
  """``params`` equal ``master`` in bfloat16, but for values that shrank so much in a step that
  the float32 update rounded (near zero): a few bfloat16 spacings from it there (see
  with_master_weights)."""
  p, m = np.asarray(params, np.float32), np.asarray(master, np.float32)
  want = np.asarray(jnp.asarray(master).astype(jnp.bfloat16), np.float32)
  off = p != want
  assert not off.any() or np.abs(m[off]).max() < 1e-4 * np.abs(m).max(), m[off]
  np.testing.assert_allclose(p[off], want[off], rtol=2**-4)


def test_master_weights_in_the_store(store):
  # bfloat16 parameters and gradients on the device; the float32 copy streams with the moments.
  tx = ssd.with_master_weights(_project_chain())
  x = jax.random.normal(jax.random.key(7), (16, 64)).astype(jnp.bfloat16)
  full = _params()

  def run(t, apply, steps=3):
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), full)
    s = t.init(full)  # the copy is made from the float32 values
    history, s, m = _jitted_steps(t, apply, x, p, s, steps)
    return history[-1], s, m.temp_size_in_bytes + m.argument_size_in_bytes

  ours = {
    loc: offload_optimizer(tx, location=loc, min_bytes=4096, chunk_bytes=32 << 10)
    for loc in ("device", "host")
  }
  host, host_state, host_bytes = run(ours["host"], True)
  device, _, _ = run(ours["device"], True)
  want, want_state, want_bytes = run(tx, False)  # plain optax, its state on the device
  master = ssd.optimizer_state(host_state).master
  # Against plain optax: an ulp on the CPU. On a GPU XLA picks each program's bfloat16 matmul
  # algorithm: the two programs' gradients differ in their last bits, and 3 steps of Adam carry
  # that to ~4e-6 (measured on an H100); a wrong chunk or leaf is ~1e-3 off.
  cpu = jax.default_backend() == "cpu"
  close = dict(rtol=1e-6, atol=1e-7) if cpu else dict(rtol=1e-4, atol=2e-5)
  for k in host:
    assert host[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(host[k]), np.asarray(device[k]), err_msg=k)
    # the parameters are the copy's rounding, and the copy is tx's float32 update
    assert_rounds_to(host[k], master[k])
    assert master[k].dtype == jnp.float32
    np.testing.assert_allclose(master[k], want_state.master[k], **close)
    if cpu:
      np.testing.assert_array_equal(np.asarray(host[k]), np.asarray(want[k]), err_msg=k)
  # On the device: 4 bytes per streamed parameter (bf16 parameters and gradients) where optax
  # holds 16 (and the copy, the moments); chunks and XLA's buffers on top.
  streamed = full["a"].size + full["c"].size
  if jax.default_backend() == "cpu":
    assert host_bytes < want_bytes - 8 * streamed, (host_bytes, want_bytes)
  with pytest.raises(ValueError, match="params: with_master_weights needs"):
    tx.update(full, tx.init(full))
  with pytest.raises(ValueError, match="dtype: expected a floating-point dtype"):
    ssd.with_master_weights(optax.sgd(1.0), dtype=jnp.int32)
  for bad in ("banana", 3):
    with pytest.raises(ValueError, match=f"dtype: expected a floating-point dtype, got {bad!r}"):
      ssd.with_master_weights(optax.sgd(1.0), dtype=bad)


def test_auto_location_takes_the_host_tier_while_two_versions_fit_in_it(store):
  # The fixture's host tier: 64 MiB. Adam's state of 4 MiB of parameters: two versions of 8 MiB
  # fit; of 16 MiB of parameters: two of 32 MiB do not fit three quarters of it (48 MiB).
  tx = offload_optimizer(optax.adam(1e-3), location="auto", chunk_bytes=1 << 20)
  small = {"w": jnp.ones((1024, 1024))}
  assert tx.init(small).location == "host"
  big = {f"w{i}": jnp.full((1024, 1024), 0.5 + i) for i in range(4)}
  state = tx.init(big)
  assert state.location == "host,nvme" and "host,nvme" in repr(state)
  grads = jax.tree.map(lambda p: 1e-3 * p, big)
  step = jax.jit(lambda s: tx.update(grads, s, big))
  on_device = offload_optimizer(optax.adam(1e-3), location="device", chunk_bytes=1 << 20)
  want = jax.jit(lambda s: on_device.update(grads, s, big))(on_device.init(big))
  got = step(state)
  for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multisteps_around_it(store):
  k = 3
  want, _ = _train(optax.MultiSteps(optax.adam(1e-3), k), 2 * k)
  inner = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  ssd.reset_stats()
  got, _ = _train(optax.MultiSteps(inner, k), 2 * k)
  ssd.flush()
  for w, g in zip(want, got):
    for name in w:
      np.testing.assert_allclose(np.asarray(g[name]), np.asarray(w[name]), rtol=1e-5, atol=1e-7)
  # optax.MultiSteps runs the inner update at every micro-step and selects its result (a
  # jnp.where over the state, here over the handles), so the state streams every micro-step.
  n_chunks = 2 * (64 * 512 * 4 // (32 << 10) + -(-300 * 256 * 4 // (32 << 10)))
  assert ssd.stats()["tensors_read"] == 2 * k * n_chunks


@pytest.mark.parametrize("location", ["host", "device"])
def test_accumulate_gradients_streams_once_per_k(store, location):
  k = 3
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  want, _ = _train(optax.MultiSteps(optax.adam(1e-3), k), 2 * k)
  same, _ = _train(
    ssd.accumulate_gradients(offload_optimizer(optax.adam(1e-3), location="device", **kw), k), 2 * k
  )
  ssd.reset_stats()
  got, _ = _train(
    ssd.accumulate_gradients(offload_optimizer(optax.adam(1e-3), location=location, **kw), k), 2 * k
  )
  ssd.flush()
  for w, s, g in zip(want, same, got):
    for name in w:
      assert (np.asarray(g[name]) == np.asarray(s[name])).all()
      np.testing.assert_allclose(np.asarray(g[name]), np.asarray(w[name]), rtol=1e-5, atol=1e-7)
  assert not (np.asarray(got[0]["a"]) != np.asarray(_params()["a"])).any()  # nothing applied yet
  assert (np.asarray(got[k - 1]["a"]) != np.asarray(_params()["a"])).any()
  if location == "host":  # init stores; each of the 2 applied steps loads each chunk once
    n_chunks = 2 * (64 * 512 * 4 // (32 << 10) + -(-300 * 256 * 4 // (32 << 10)))
    assert ssd.stats()["tensors_read"] == 2 * n_chunks


def test_apply_gradients_through_accumulate_gradients(store):
  k, x = 2, jax.random.normal(jax.random.key(7), (16, 64))
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)

  def run(tx, apply, steps=2 * k):
    history, _, memory = _jitted_steps(tx, apply, x, _params(), tx.init(_params()), steps)
    return history, memory.temp_size_in_bytes

  acc = {
    loc: ssd.accumulate_gradients(offload_optimizer(optax.adam(1e-3), location=loc, **kw), k)
    for loc in ("device", "host")
  }
  (host, host_temp), (device, _) = run(acc["host"], True), run(acc["device"], True)
  plain, plain_temp = run(acc["host"], False)
  if jax.default_backend() == "cpu":  # no whole array of updates of the streamed leaves
    streamed = (_params()["a"].nbytes + _params()["c"].nbytes) * 9 // 10
    assert plain_temp - host_temp >= streamed, (plain_temp, host_temp)
    # nor a second float32 tree of the running mean: it is updated in place (0.38 of the
    # parameters' bytes in all; 1.36 when the mean was reset after the update)
    assert host_temp < sum(p.nbytes for p in _params().values()) // 2, host_temp
  for h, d, u in zip(host, device, plain):
    for name in h:
      np.testing.assert_array_equal(h[name], d[name])
      np.testing.assert_allclose(h[name], u[name], rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(host[0]["a"], np.asarray(_params()["a"]))  # nothing applied yet
  assert (host[k - 1]["a"] != np.asarray(_params()["a"])).any()


def _float_broadcasts(jaxpr, shapes):
  """The broadcast_in_dim equations of ``jaxpr`` (and the jaxprs inside it) that make a
  floating array of one of ``shapes``: a tree of constants that XLA may materialize."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "broadcast_in_dim":
      aval = eqn.outvars[0].aval
      if tuple(aval.shape) in shapes and jnp.issubdtype(aval.dtype, jnp.floating):
        found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _float_broadcasts(sub, shapes)
  return found


def test_accumulate_gradients_makes_no_tree_of_zeros(store):
  # MultiSteps' mean starts each optimizer step from zeros. A jnp.zeros_like tree there was
  # materialized on the GPU (merged by XLA with the backward pass's zero-initialized gradient
  # buffers: an 8B model's step had 16.5 GB of zeros among its temporaries). The first
  # micro-step's mean is the gradient itself: no broadcast to a parameter's shape is left.
  k, x = 3, jax.random.normal(jax.random.key(7), (16, 64))
  shapes = {p.shape for p in _params().values() if p.size >= 1024}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = ssd.accumulate_gradients(
      offload_optimizer(optax.adam(1e-3), min_bytes=4096), k, dtype=dtype
    )
    state = tx.init(_params())
    grads = jax.grad(_loss)(_params(), x)
    step = jax.make_jaxpr(lambda g, s, p: ssd.apply_gradients(tx, g, s, p))(grads, state, _params())
    assert not _float_broadcasts(step.jaxpr, shapes), _float_broadcasts(step.jaxpr, shapes)


def test_accumulate_gradients_bad_arguments():
  with pytest.raises(ValueError, match="every_k: expected an integer >= 1, got 0"):
    ssd.accumulate_gradients(optax.adam(1e-3), 0)
  with pytest.raises(TypeError, match="tx: expected an optax GradientTransformation"):
    ssd.accumulate_gradients(None, 2)
  for bad in ("int32", "nonsense", 3):
    with pytest.raises(ValueError, match=f"dtype: expected a floating-point dtype, got {bad!r}"):
      ssd.accumulate_gradients(optax.adam(1e-3), 2, dtype=bad)


def test_accumulate_gradients_in_bfloat16(store):
  # A bfloat16 running mean: half the device memory of float32's, each micro-step's mean
  # rounded to bfloat16; the parameters stay within bfloat16 rounding of the float32 mean's.
  k, x = 4, jax.random.normal(jax.random.key(7), (16, 64))
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  runs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = ssd.accumulate_gradients(offload_optimizer(optax.sgd(0.1), **kw), k, dtype=dtype)
    state = tx.init(_params())
    assert all(a.dtype == dtype for a in jax.tree.leaves(state.acc_grads))
    runs[dtype] = _jitted_steps(tx, True, x, _params(), state, k)[0][-1]
  for name, p in _params().items():
    moved = np.abs(runs[jnp.float32][name] - np.asarray(p)).max()
    assert moved > 1e-3, name  # the update applied
    np.testing.assert_allclose(runs[jnp.bfloat16][name], runs[jnp.float32][name], atol=moved / 50)
    assert (runs[jnp.bfloat16][name] != runs[jnp.float32][name]).any(), name  # it did round


def test_multisteps_inside_equals_multisteps_around_it(store):
  # offload_optimizer(MultiSteps(tx, k)) is MultiSteps(offload_optimizer(tx), k): the same
  # parameters bit for bit, the same store traffic, the accumulator on the device.
  k = 3
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  for wrap in (lambda m: m, lambda m: m.gradient_transformation()):
    inside = offload_optimizer(wrap(optax.MultiSteps(optax.adam(1e-3), k)), **kw)
    ssd.flush()
    ssd.reset_stats()
    got, state = _train(inside, 2 * k)
    ssd.flush()
    read_inside = ssd.stats()["tensors_read"]
    assert isinstance(state, optax.MultiStepsState)
    assert isinstance(state.inner_opt_state, OffloadedState)  # the accumulator: on the device
    ssd.reset_stats()
    want, _ = _train(optax.MultiSteps(offload_optimizer(optax.adam(1e-3), **kw), k), 2 * k)
    ssd.flush()
    assert read_inside == ssd.stats()["tensors_read"] > 0
    for w, g in zip(want, got):
      for name in w:
        np.testing.assert_array_equal(np.asarray(g[name]), np.asarray(w[name]))


def test_a_two_pass_stream_equals_the_device_and_reads_what_it_reduces_once_more(store):
  # prodigy: sums and dot products of every parameter's state feed every parameter's update.
  # The reduction pass loads grad_sum and params0 (for |new grad_sum| and g . (params0 - p)),
  # the update pass exp_avg, exp_avg_sq and grad_sum (params0 is returned as it is: kept).
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  tx = optax.contrib.prodigy(1.0)
  want, want_state = _train(offload_optimizer(tx, location="device", **kw), 3)
  ours = offload_optimizer(tx, location="host", **kw)
  got, got_state = _train(ours, 3)
  for w, g in zip(want, got):
    for k in w:
      np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(w[k]))
  for a, b in zip(*(jax.tree.leaves(optimizer_state(s)) for s in (want_state, got_state))):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  plain, _ = _train(tx, 3)
  for w, g in zip(plain, want):
    for k in w:  # the sums in another order than tx's: a few ulps
      np.testing.assert_allclose(np.asarray(g[k]), np.asarray(w[k]), rtol=1e-5, atol=1e-6)

  per_leaf: dict[str, int] = {}  # the chunks of "a" and "c"'s leaves of each name
  for leaf in got_state.layout.leaves:
    if leaf.stored:
      name = leaf.path.split("[")[0]
      per_leaf[name] = per_leaf.get(name, 0) + len(leaf.bounds)
  assert set(per_leaf) == {".exp_avg", ".exp_avg_sq", ".grad_sum", ".params0"}, per_leaf
  x = jax.random.normal(jax.random.key(7), (16, 64))

  @jax.jit
  def step(p, s):
    u, s = ours.update(jax.grad(_loss)(p, x), s, p)
    return optax.apply_updates(p, u), s

  params = _params()
  state = ours.init(params)
  # every load reads its handle: the engine's prediction of ordered loads assumes each entry is
  # loaded once per update, in store order (on the GPU a misprediction failed the step)
  program = str(jax.make_jaxpr(ours.update)(params, state, params))
  assert "exact=True" in program and "exact=ordered" not in program
  jax.block_until_ready(state)
  ssd.flush()
  ssd.reset_stats()
  jax.block_until_ready(step(params, state))
  ssd.flush()
  stats = ssd.stats()
  updated = per_leaf[".exp_avg"] + per_leaf[".exp_avg_sq"] + per_leaf[".grad_sum"]
  assert stats["tensors_read"] == updated + per_leaf[".grad_sum"] + per_leaf[".params0"], stats
  assert stats["tensors_written"] == updated, stats


def test_a_two_pass_stream_in_place_equals_the_device(store):
  # the reduction pass's loads are not the entries' last: the update pass consumes them
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  x = jax.random.normal(jax.random.key(7), (16, 64))
  tx = optax.contrib.dadapt_adamw(1.0)
  same = offload_optimizer(tx, location="device", **kw)
  want, _, _ = _jitted_steps(same, True, x, _params(), same.init(_params()), 3)
  ours = offload_optimizer(tx, location="host", in_place=True, **kw)
  got, state, _ = _jitted_steps(ours, True, x, _params(), ours.init(_params()), 3)
  for w, g in zip(want, got):
    for k in w:
      np.testing.assert_array_equal(g[k], w[k])
  ssd.flush()
  assert ssd.stats()["live_entries"] == sum(len(h) for h in state.handles)


def test_a_number_that_needs_another_first_is_refused_naming_the_passes(store):
  tx = offload_optimizer(nested_norms(), location="host", min_bytes=4096, chunk_bytes=32 << 10)
  state = tx.init(_params())
  with pytest.raises(OptimizerOffloadError, match="cannot be computed in one reduction pass"):
    tx.update(_params(), state, _params())
  # on the device it runs (the refusal is the stream's, not the transformation's)
  jax.block_until_ready(nested_norms().update(_params(), nested_norms().init(_params())))


def test_update_with_another_optimizers_state_names_both_layouts(store):
  adam = offload_optimizer(optax.adam(1e-3), min_bytes=4096)
  sgd = offload_optimizer(optax.sgd(1e-3, momentum=0.9), min_bytes=4096)
  state = sgd.init(_params())
  with pytest.raises(
    OptimizerOffloadError, match=r"not made by .*its layout has .*trace.*init would make .*mu"
  ):
    adam.update(_params(), state, _params())


def test_a_state_with_nothing_to_store_warns_and_says_so(store):
  tx = offload_optimizer(optax.adam(1e-3), location="host")  # the default min_bytes: 1 MiB
  with pytest.warns(UserWarning, match=r"stores nothing.*min_bytes=1048576.*largest is .*\['c'\]"):
    state = tx.init(_params())
  assert state.location == "device" and "none in the store" in repr(state)
  assert offload_optimizer(optax.adam(1e-3), min_bytes=4096).init(_params()).location == "host"


@pytest.mark.parametrize(
  "kwargs,message",
  [
    ({"location": "remat"}, "location: expected 'host', 'nvme', 'host,nvme', 'auto' or 'device'"),
    ({"location": "ssd"}, "expected .* got 'ssd'"),
    ({"min_bytes": -1}, "min_bytes: expected an integer >= 0"),
    ({"chunk_bytes": 100}, "chunk_bytes: expected an integer >= 4096"),
  ],
)
def test_bad_arguments_name_themselves(kwargs, message):
  with pytest.raises(ValueError, match=message):
    offload_optimizer(optax.adam(1e-3), **kwargs)
  with pytest.raises(TypeError, match="tx: expected an optax GradientTransformation"):
    offload_optimizer(lambda g: g)


def test_a_location_the_state_does_not_fit_in_is_refused_at_init(tmp_path):
  params = {"w": jnp.ones((1024, 1024))}  # Adam: 8 MiB of state, 16 MiB with the new version
  with ssd.configured(tmp_path / "s", capacity_bytes=12 * MiB, host_tier_bytes=4 * MiB):
    for location, room in (("host", "host_tier_bytes = 4194304"), ("nvme", "capacity_bytes")):
      tx = offload_optimizer(optax.adam(1e-3), location=location)
      with pytest.raises(OptimizerOffloadError, match=f"location='{location}' holds.*{room}"):
        tx.init(params)
    state = offload_optimizer(optax.adam(1e-3), location="host,nvme").init(params)  # 16 MiB
    assert isinstance(state, OffloadedState)


def test_update_with_a_state_it_did_not_make(store):
  with pytest.raises(TypeError, match="state: expected the OffloadedState"):
    offload_optimizer(optax.adam(1e-3)).update(_params(), optax.adam(1e-3).init(_params()))


def test_the_store_holds_one_copy_and_nothing_grows(store):
  ours = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  params = _params()
  x = jax.random.normal(jax.random.key(7), (16, 64))

  @jax.jit
  def step(p, s):
    u, s = ours.update(jax.grad(_loss)(p, x), s, p)
    return optax.apply_updates(p, u), s

  state = ours.init(params)
  stored = state.layout.stored_bytes
  live = []
  for _ in range(12):
    params, state = step(params, state)
    ssd.flush()
    live.append(ssd.stats()["live_entries"])
  n_chunks = sum(len(h) for h in state.handles)
  assert live[-1] == live[2] == n_chunks, live  # exactly this step's state, every step
  assert 0 < stored <= ssd.stats()["host_tier_bytes_in_use"] <= stored + n_chunks * 4096


def test_in_place_holds_one_version_and_equals_the_state_on_the_device(tmp_path):
  # Adam's state of _params' a and c: 856 KiB a version. A host tier of 1.25 MiB holds one and
  # the chunks in flight (32 KiB chunks), not two: the update must write each new chunk into
  # the room its old one had.
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  with ssd.configured(tmp_path / "s", capacity_bytes=16 * MiB, host_tier_bytes=1280 << 10):
    with pytest.raises(OptimizerOffloadError, match="update in place"):
      offload_optimizer(optax.adam(1e-3), location="host", **kw).init(_params())
    ours = offload_optimizer(optax.adam(1e-3), location="host", in_place=True, **kw)
    first = ours.init(_params())
    assert "(host, updated in place)" in repr(first)
    jax.block_until_ready(first)  # its stores done: collect() then releases them
    del first
    ssd.collect()
    x = jax.random.normal(jax.random.key(7), (16, 64))
    got, state, _ = _jitted_steps(ours, True, x, _params(), ours.init(_params()), 6)
    ssd.flush()
    s = ssd.stats()
    assert s["live_entries"] == sum(len(h) for h in state.handles), s
    assert s["host_tier_bytes_in_use"] <= state.layout.stored_bytes + (64 << 10), s
    got_state = jax.tree.map(np.asarray, optimizer_state(state))
    del state
    ssd.collect()
    # The state it was given is gone: a second update from it raises, naming in_place.
    old = ours.init(_params())
    jax.block_until_ready(jax.jit(ours.update)(_params(), old, _params()))
    with pytest.raises(Exception, match="already released.*in_place=True"):
      jax.block_until_ready(jax.jit(ours.update)(_params(), old, _params()))
  same = offload_optimizer(optax.adam(1e-3), location="device", **kw)
  want, want_state, _ = _jitted_steps(same, True, x, _params(), same.init(_params()), 6)
  for w, g in zip(want, got):
    for k in w:
      np.testing.assert_array_equal(g[k], w[k])
  for a, b in zip(jax.tree.leaves(optimizer_state(want_state)), jax.tree.leaves(got_state)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_multisteps_around_an_in_place_state_raises_naming_the_way_round(store):
  # MultiSteps runs the update at every micro-step and keeps the old state where it does not
  # apply: in place, that state was consumed by the update that read it.
  kw = dict(min_bytes=4096, chunk_bytes=32 << 10)
  ours = offload_optimizer(optax.adam(1e-3), location="host", in_place=True, **kw)
  tx = optax.MultiSteps(ours, 2)
  x = jax.random.normal(jax.random.key(7), (16, 64))
  with pytest.raises(Exception, match=r"in_place=True.*MultiSteps.*accumulate_gradients"):
    _jitted_steps(tx, False, x, _params(), tx.init(_params()), 2)
  # raised through the step's results alone: nothing JAX keeps raises it again later (at the
  # next effects barrier, or at exit)
  jax.effects_barrier()


@pytest.mark.parametrize("in_place", [False, True])
def test_a_failed_write_of_the_state(tmp_path, monkeypatch, in_place):
  # The files only (no forwarding: every store is written). A write of the first update fails:
  # the update raises. Two versions: the state it started from is intact, and the retried
  # update equals one that never failed. In place: that state is gone, and a retry says so.
  kw = dict(location="nvme", min_bytes=4096, chunk_bytes=32 << 10, in_place=in_place)
  x = jax.random.normal(jax.random.key(7), (16, 64))
  grads = jax.jit(jax.grad(_loss))(_params(), x)
  ref = offload_optimizer(optax.adam(1e-3), **dict(kw, location="device", in_place=False))
  want = jax.jit(ref.update)(grads, ref.init(_params()), _params())[0]
  n_init = 2 * (64 * 512 * 4 // (32 << 10) + -(-300 * 256 * 4 // (32 << 10)))  # chunks
  monkeypatch.setenv("SSDTRAIN_FAULT", f"write:{n_init + 5}:EIO")
  with ssd.configured(tmp_path / "s", capacity_bytes=16 * MiB, forwarding=False):
    tx = offload_optimizer(optax.adam(1e-3), **kw)
    state = tx.init(_params())
    ssd.flush()
    assert ssd.stats()["disk_tensors_written"] == n_init
    update = jax.jit(tx.update)
    with pytest.raises(Exception, match="Input/output error"):
      jax.block_until_ready(update(grads, state, _params()))
      ssd.flush()
    if in_place:
      with pytest.raises(Exception, match="already released.*in_place=True"):
        jax.block_until_ready(update(grads, state, _params()))
    else:
      got = update(grads, state, _params())[0]
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_host_nvme_spills_activations_to_the_files(tmp_path):
  w = jnp.ones((512, 512)) / 512
  f = jax.checkpoint(
    lambda x: jnp.sin(checkpoint_name(x @ w, "h")),
    policy=ssd.location_policy({"h": "host,nvme"}, min_bytes=0),
  )
  step = jax.jit(jax.grad(lambda x: jnp.sum(f(f(f(f(x)))))))
  plain = jax.checkpoint(
    lambda x: jnp.sin(checkpoint_name(x @ w, "h")),
    policy=jax.checkpoint_policies.save_only_these_names("h"),
  )
  want = jax.jit(jax.grad(lambda x: jnp.sum(plain(plain(plain(plain(x)))))))(jnp.ones((512, 512)))
  # A host tier too small for one 1 MiB activation: each goes to the files; a large one: none.
  for tier, spilled in ((512 << 10, 4), (8 * MiB, 0)):
    with ssd.configured(tmp_path / f"s{tier}", capacity_bytes=64 * MiB, host_tier_bytes=tier):
      got = step(jnp.ones((512, 512)))
      ssd.flush()
      s = ssd.stats()
    assert (np.asarray(got) == np.asarray(want)).all()
    assert s["tensors_written"] == 4 and s["spilled_tensors"] == spilled, s
    assert s["spilled_bytes"] == spilled * MiB and s["disk_tensors_written"] <= spilled


def _tiny_bench(tmp_path, module, prefix, *args, cpu_devices=1) -> dict:
  """``python -m scripts.<module> --tiny ARGS`` on ``cpu_devices`` CPU devices: the JSON it
  wrote, ``<prefix>_cpu_*.json``."""
  import json
  import os

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if cpu_devices > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
  run_module(f"scripts.{module}", "--tiny", "--out", tmp_path, *args, env=env)
  (path,) = tmp_path.glob(f"{prefix}_cpu_*.json")
  return json.loads(path.read_text())


@pytest.mark.slow
def test_bench_optimizer_tiny(tmp_path):
  doc = _tiny_bench(tmp_path, "bench_optimizer", "optimizer", "--timeline")
  rows = {r["variant"]: r for r in doc["rows"]}
  assert set(rows) == {"device", "streamed_device", "host", "nvme"}
  # the whole state went through the store each step, both ways, once
  for v in ("host", "nvme"):
    assert rows[v]["read_gb_per_step"] == pytest.approx(doc["state_gb"], rel=1e-9)
    assert rows[v]["written_gb_per_step"] == pytest.approx(doc["state_gb"], rel=1e-9)
    engine = rows[v]["engine"]  # the engine's counters, per step
    assert engine["loaded_GB_per_step"] == pytest.approx(doc["state_gb"], rel=1e-9)
  assert not list(tmp_path.glob("optimizer_timeline_*.json"))  # no GPU copies on the CPU


@pytest.mark.slow
def test_bench_accumulate_tiny(tmp_path):
  doc = _tiny_bench(tmp_path, "bench_accumulate", "accumulate")
  rows = {r["variant"]: r for r in doc["rows"]}
  assert set(rows) == {"device", "host", "nvme"} and doc["accum"] == [1, 4, 16]
  assert rows["device"]["written_gb_per_update"] == 0
  for r in rows.values():
    assert r["step_s_k16"] == pytest.approx(15 * r["accumulate_s"] + r["update_s"])
    assert r["x_device_k4"] == pytest.approx(r["step_s_k4"] / rows["device"]["step_s_k4"])
  for v in ("host", "nvme"):  # the stored state went through the store at each update
    assert rows[v]["written_gb_per_update"] > 0


@pytest.mark.slow
def test_bench_fit_tiny(tmp_path):
  ways = "jax_remat,ours,ours_master_inplace"
  doc = _tiny_bench(tmp_path, "bench_fit", "fit", "--ways", ways, "--accum", "2")
  rows = {r["way"]: r for r in doc["rows"]}
  assert set(rows) == set(ways.split(",")) and all(r["fits"] for r in rows.values())
  assert all(r["accum"] == 2 for r in rows.values())
  assert rows["jax_remat"]["store_gb_written_per_step"] == 0
  assert rows["ours"]["store_gb_written_per_step"] > 0  # activations and optimizer state
  ideal = rows["ours"]["ideal"]  # tiny has 2 layers: the ideal is the 2-layer run itself
  assert ideal["step_s"] == pytest.approx(ideal["step_s_2"])
  assert rows["ours"]["x_ideal"] == pytest.approx(
    rows["ours"]["tokens_per_s"] / ideal["tokens_per_s"]
  )


@pytest.mark.slow
def test_bench_fit_tiny_on_a_mesh(tmp_path):
  # FSDP over 2 CPU devices (the node's form of the benchmark): every run, the ideal's too,
  # on the mesh; JAX alone with master weights against ours
  ways = "jax_master_remat,ours_master_inplace"
  doc = _tiny_bench(
    tmp_path, "bench_fit", "fit", "--ways", ways, "--mesh", "dp=2,fsdp", cpu_devices=2
  )
  assert doc["mesh"] == "dp=2,fsdp" and doc["devices"] == 2
  rows = {r["way"]: r for r in doc["rows"]}
  assert set(rows) == set(ways.split(",")) and all(r["fits"] for r in rows.values())
  assert rows["jax_master_remat"]["store_gb_written_per_step"] == 0
  assert rows["ours_master_inplace"]["store_gb_written_per_step"] > 0
  assert all(r["ideal"]["master"] for r in rows.values())


def _train_state_steps(tx, state, n):
  x = jax.random.normal(jax.random.key(7), (16, 64))

  @jax.jit
  def step(s):
    return s.apply_gradients(grads=jax.grad(_loss)(s.params, x))

  for _ in range(n):
    state = step(state)
  return state


def test_checkpoint_resume_equals_never_stopping(store, tmp_path):
  from scripts import training

  ours = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  fresh = lambda: training.TrainState.create(apply_fn=None, params=_params(), tx=ours)
  straight = _train_state_steps(ours, fresh(), 4)

  manager = training.checkpoint_manager(str(tmp_path / "ckpt"))
  half = _train_state_steps(ours, fresh(), 2)
  training.save_checkpoint(manager, half)
  # The checkpoint holds tx's own state (its layout, and its leaves as arrays), not handles.
  from jax_ssdtrain import checkpointing

  step_dir = manager.directory / "2" / checkpointing.STATE_ITEM
  layout = checkpointing.OptimizerStateHandler().metadata(step_dir)
  (saved,) = layout["states"]
  assert [leaf["shape"] for leaf in saved["leaves"]] == [
    list(np.shape(x)) for x in jax.tree.leaves(optimizer_state(half.opt_state))
  ]
  want = ssd.state_to_host(half.opt_state)
  import tensorstore as ts

  for i, w in enumerate(jax.tree.leaves(want)):
    got = ts.open(
      {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step_dir / f"state0/leaf{i}")}}
    ).result()
    np.testing.assert_array_equal(got.read().result(), w)
  del half
  restored = training.restore_checkpoint(manager, fresh())
  assert isinstance(restored.opt_state, OffloadedState) and int(restored.step) == 2
  resumed = _train_state_steps(ours, restored, 2)
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    assert (np.asarray(a) == np.asarray(b)).all()
  for a, b in zip(
    jax.tree.leaves(optimizer_state(straight.opt_state)),
    jax.tree.leaves(optimizer_state(resumed.opt_state)),
  ):
    assert (np.asarray(a) == np.asarray(b)).all()


def test_an_interrupted_save_leaves_the_last_checkpoint(store, tmp_path, monkeypatch):
  from scripts import training

  ours = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  state = _train_state_steps(
    ours, training.TrainState.create(apply_fn=None, params=_params(), tx=ours), 1
  )
  manager = training.checkpoint_manager(str(tmp_path / "ckpt"))
  training.save_checkpoint(manager, state)
  want = ssd.state_to_host(state.opt_state)
  later = _train_state_steps(ours, state, 1)
  calls = []

  def failing_load(*args):  # the second chunk read from the store fails
    calls.append(args)
    if len(calls) == 2:
      raise OSError("injected: the store's read failed")
    return real(*args)

  from jax_ssdtrain._src.optimizer import chunk_io  # the store's reads of the host I/O

  real = chunk_io._load_jit
  monkeypatch.setattr(chunk_io, "_load_jit", failing_load)
  with pytest.raises(OSError, match="injected"):
    training.save_checkpoint(manager, later)
  monkeypatch.setattr(chunk_io, "_load_jit", real)
  assert manager.latest_step() == 1
  restored = training.restore_checkpoint(manager, later)
  got = ssd.state_to_host(restored.opt_state)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert (np.asarray(a) == np.asarray(b)).all()


def test_a_state_outliving_its_store_raises_naming_the_cause(tmp_path):
  # The store holding a live optimizer state is closed (reconfigured) or shut down: the next
  # update raises, naming the cause, instead of reading anything.
  ours = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  params = _params()
  grads = jax.tree.map(jnp.ones_like, params)
  update = jax.jit(ours.update)
  with ssd.configured(tmp_path / "a", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    state = ours.init(params)
  with ssd.configured(tmp_path / "b", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    with pytest.raises(
      Exception, match="stale ssdtrain handle.*belongs to a store that was replaced"
    ):
      jax.block_until_ready(update(grads, state, params))
    state = ours.init(params)
    ssd.shutdown()
    # init is pure: the second state's layout equals the first's, so the update is not traced
    # again (no lowering to raise StoreShutDownError); the engine refuses it when it runs.
    with pytest.raises(Exception, match="the store was shut down"):
      jax.block_until_ready(update(grads, state, params))


def test_a_checkpoint_of_another_layout_is_refused(store):
  ours = offload_optimizer(optax.adam(1e-3), min_bytes=4096, chunk_bytes=32 << 10)
  state = ours.init(_params())
  other = optax.adam(1e-3).init({k: v[:2] for k, v in _params().items()})
  with pytest.raises(OptimizerOffloadError, match="a checkpoint of another layout"):
    ssd.state_from_host(other, state)
  with pytest.raises(OptimizerOffloadError, match="another structure"):
    ssd.state_from_host(optax.sgd(1.0, momentum=0.9).init(_params()), state)


# ---------------------------------------------------------------------------------------------
# State sharded over several devices (FSDP): each device streams its own blocks


def _check_sharded(r: dict, devices: int) -> None:
  assert r["devices"] == devices
  assert sorted(r["tx"]) == ["adam", "chain", "lion", "sgd_momentum"]
  for name, t in r["tx"].items():
    # Bit for bit the same streamed program with the state on the devices, from the store's
    # host tier and its files; within float32 rounding of tx's own program.
    assert t["host_eq_device"] and t["nvme_eq_device"] and t["state_host_eq_device"], name
    assert t["vs_tx"] < 1e-5, (name, t["vs_tx"])
    # Each device wrote its blocks of the state, once per version, and nothing of the others'.
    for where in ("host", "nvme"):
      per_device = t[f"{where}_written_per_device"]
      assert sorted(per_device) == [str(d) for d in range(devices)], (name, per_device)
      assert set(per_device.values()) == {t["expected_per_device"]}, (name, where, per_device)
    # One row of handles per device, sharded so that each device holds its own.
    assert all(shape[0] == devices and spec == "P('data',)" for shape, spec in t["handles"])
    assert t["params_specs"]["rows"] == "P('data',)" and t["params_specs"]["cols"] == (
      "P(None, 'data')"
    )
    if name == "chain":  # a checkpoint of the sharded state, restored, resumed
      assert t["saved_eq_state"] and t["resumed_eq"], name
    live, one_version_each = t["live_entries"]
    assert live == one_version_each, (name, t["live_entries"])
  # each sweep between the steps of a donating loop releases the version before
  assert all(n > 0 for n in r["collect_between_steps"]), r["collect_between_steps"]
  # in place: each device consumes its own blocks' entries; one version is left, bit for bit
  # the state on the devices' results
  live, one_version = r["in_place"]["live_entries"]
  assert r["in_place"]["eq_device"] and live == one_version, r["in_place"]
  # scripts.training's FSDP path (scripts/train.py --mesh dp=N,fsdp --optimizer-location host)
  t = r["train"]
  assert t["stored_leaves"] > 0 and t["handle_rows"] == [devices], t
  assert t["host_eq_device"] and t["vs_tx"] < 1e-5, t
  # the state made on the mesh (no device holds the whole model) is the one placed after
  assert t["made_on_mesh_same"] == dict.fromkeys(("None", "device", "host", "kept"), True), t
  # no collective added by the offload: the leaves kept on the device (under min_bytes) lie as
  # their parameters, as optax's own state (they were replicated: XLA gathered them every step)
  c = t["collectives"]
  assert c["None"] and c["device"] == c["host"] == c["kept"] == c["None"], c
  specs = t["kept_specs"]
  assert t["kept_stored_leaves"] > 0 and t["kept_eq_host"], t
  assert all(layout == placed for layout, placed in specs.values()), specs
  assert any(layout != "P()" for layout, _ in specs.values()), specs
  assert all(spec == "P()" for path, (spec, _) in specs.items() if path.endswith(".count")), specs
  # two passes: each device's partials of the sums joined over the mesh, as on the devices
  for name, t in r["two_pass"].items():
    assert t["stored_leaves"] > 0 and t["host_eq_device"] and t["state_host_eq_device"], (name, t)
    assert t["vs_tx"] < 1e-5, (name, t["vs_tx"])
  # LAMB's trust ratio is a norm of each whole leaf: a device's block would give another one.
  assert "cannot stream sharded state" in r["lamb"] and "not elementwise" in r["lamb"], r["lamb"]


@pytest.mark.slow  # a worker process of 49 s on 2 cores (run by .ci/run's slow stage)
def test_state_sharded_over_4_cpu_devices(tmp_path):
  # a process of its own: the device count is fixed when jax starts
  _check_sharded(run_worker(SHARDED_WORKER, tmp_dir=tmp_path), 4)


@pytest.mark.slow  # as the one above
def test_state_sharded_over_2_of_4_cpu_devices(tmp_path):
  # the first 2 devices of a machine with more (the case of test_state_sharded_over_2_gpus on a
  # 4-GPU machine): the mesh, the state's blocks and their stores on those 2 alone
  r = run_worker(SHARDED_WORKER, tmp_dir=tmp_path, SSD_OPT_DEVICES="2", SSD_OPT_CPU_DEVICES="4")
  assert r["visible_devices"] == 4
  _check_sharded(r, 2)


def _sharded_over_gpus(tmp_path, n: int) -> None:
  """The worker on the first ``n`` GPUs (skipped where there are fewer; more are left idle)."""
  skip_without_gpus(n)
  r = run_worker(
    SHARDED_WORKER,
    tmp_dir=tmp_path,
    SSD_OPT_PLATFORM="gpu",
    SSD_OPT_DEVICES=str(n),
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
  )
  _check_sharded(r, n)


@pytest.mark.gpu
def test_state_sharded_over_2_gpus(tmp_path):
  _sharded_over_gpus(tmp_path, 2)


@pytest.mark.gpu
def test_state_sharded_over_4_gpus(tmp_path):
  _sharded_over_gpus(tmp_path, 4)


def test_init_is_pure(store):
  # Frameworks build optimizer state from jax.eval_shape(tx.init, params) (shapes, shardings,
  # Orbax's restore target) and then a jitted init: every one of them must have one structure.
  tx = offload_optimizer(optax.adam(1e-3), location="host", min_bytes=4096, chunk_bytes=32 << 10)
  params = _params()
  abstract = jax.eval_shape(tx.init, params)
  first, second = tx.init(params), jax.jit(tx.init)(params)
  assert jax.tree.structure(abstract) == jax.tree.structure(first) == jax.tree.structure(second)
  for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(first)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  # The second state is usable by the step the first compiled (no retrace, no other sites).
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  grads = jax.tree.map(jnp.ones_like, params)
  u1, _ = step(grads, first, params)
  u2, _ = step(grads, second, params)
  assert step._cache_size() == 1
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_analysis_groups_each_parameters_state_without_a_store():
  # The analysis is pure (no store, no device I/O): Adam's mu and nu of one parameter form one
  # group, one group per parameter, and each group's equations are elementwise over its shape.
  from jax_ssdtrain._src.optimizer import analyse, trace

  tx = optax.adam(1e-3)
  params = {"a": jnp.zeros((8, 4)), "c": jnp.zeros((16,))}
  leaves, treedef = jax.tree.flatten(tx.init(params))  # count, mu a, mu c, nu a, nu c

  def update(g, s, p):
    return jax.tree.leaves(tx.update(g, treedef.unflatten(s), p))

  prog = trace.Program.inline(jax.make_jaxpr(update)(params, leaves, params))
  stored = [1, 2, 3, 4]
  stored_in = {prog.invars[2 + i]: i for i in stored}
  stored_out = {i: prog.outvars[2 + i] for i in stored}
  found = analyse.dependencies(prog, stored_in, stored_out)
  groups: dict[int, list[int]] = {}
  for i in stored:
    groups.setdefault(found.find(i), []).append(i)
  assert sorted(groups.values()) == [[1, 3], [2, 4]] and not found.passed
  owners = analyse.pull_into_groups(prog, found)
  for root, members in groups.items():
    eqns = [e for e, o in zip(prog.eqns, owners) if root in o]
    assert eqns and analyse.elementwise(eqns, leaves[members[0]].shape)


def test_the_chunk_io_is_chosen_once_from_the_location():
  # Layout.io: the store (load_p / store_p in the location's tier) or the device reference.
  from jax_ssdtrain._src.location import TIER_CODES, Location
  from jax_ssdtrain._src.optimizer import chunk_io

  assert isinstance(chunk_io.chunk_io(Location.DEVICE), chunk_io.DeviceIO)
  for loc, code in TIER_CODES.items():
    io = chunk_io.chunk_io(loc)
    assert isinstance(io, chunk_io.StoreIO) and io.tier == code and io.location is loc


def test_one_device_train_step_compiles_once(store):
  # scripts.training on a mesh of one device (scripts/bench_multigpu.py's 1-GPU rows): init's
  # state was uncommitted (its jit dropped the parameters, which zeros do not read) and the step
  # returns committed arrays (its out_shardings), so that the second step compiled again.
  from models import parallel
  from scripts import training

  run = training.RunConfig(
    preset="tiny", batch=2, seq_len=16, optimizer_location="host", min_bytes=4096
  )
  state, _, _ = training.create_train_state(run)
  par = parallel.Parallelism(data=1, fsdp=True)
  mesh = par.mesh(jax.devices()[:1])
  state, shardings = training.shard_train_state(state, par, mesh)
  assert all(x.committed for x in jax.tree.leaves(state.opt_state))
  step = training.jit_train_step(shardings)
  tokens = training.shard_batch(np.zeros((2, 17), np.int32), par, mesh)
  for _ in range(3):
    state, metrics = step(state, tokens, jax.random.key(0))
  jax.block_until_ready(metrics)
  assert step._cache_size() == 1  # jit's compilations (a private method)
  assert all(x.committed for x in jax.tree.leaves(state.opt_state))


def test_apply_gradients_averages_and_clips_a_running_sum_of_device_parameters():
  # One call order for every kind of parameters: with device parameters and a plain optax state,
  # scale / clip_global_norm / global_norm make grads a running sum to average and clip, as for a
  # streamed stack (the embedding and head beside a stack).
  from jax_ssdtrain._src.layer_stream import apply_device_update

  tx = optax.adamw(1e-2)
  params = {"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.ones((4,), jnp.bfloat16)}
  sums = jax.tree.map(lambda p: jnp.ones_like(p, jnp.float32) * 3.0, params)
  state = tx.init(params)
  for options in (
    dict(scale=0.25),
    dict(scale=0.25, clip_global_norm=0.5),
    dict(scale=0.25, clip_global_norm=0.5, global_norm=jnp.float32(4.0)),
  ):
    got = jax.jit(lambda s, st, p: ssd.apply_gradients(tx, s, st, p, **options))(
      sums, state, params
    )
    want = jax.jit(lambda s, st, p: apply_device_update(tx, p, s, st, **options))(
      sums, state, params
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert a.dtype == b.dtype and (np.asarray(a) == np.asarray(b)).all()
    # and it is the mean's ordinary update (no clipping: the same arithmetic as optax's)
  mean = jax.tree.map(lambda s, p: (s * 0.25).astype(p.dtype), sums, params)
  updates, _ = tx.update(mean, state, params)
  want = optax.apply_updates(params, updates)
  got, _ = ssd.apply_gradients(tx, sums, state, params, scale=0.25)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)
  with pytest.raises(TypeError, match=r"scale make grads a running sum.*extra arguments \(value\)"):
    ssd.apply_gradients(tx, sums, state, params, scale=0.5, value=1.0)
