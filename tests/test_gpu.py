"""CUDA handlers: run on the device machine (skipped without a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ffi_common import raw_load, raw_store
from _optimizer_readahead import check_state_read_ahead_in_store_order
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd

pytestmark = pytest.mark.gpu
cp = jax.checkpoint_policies
NAMES = ("layer_in", "qkv", "attn", "mlp_up")


@pytest.fixture
def store(tmp_path):
  with ssd.configured(
    directory=tmp_path / "store",
    capacity_bytes=32 << 30,
    host_cache_bytes=1 << 30,
    staging_bytes=1 << 30,
  ) as cfg:
    ssd.reset_stats()
    yield cfg


def rms(x):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def gpt_layer(x, p, heads):
  b, s, h = x.shape
  x = checkpoint_name(x, "layer_in")
  qkv = checkpoint_name(rms(x) @ p["wqkv"], "qkv")
  q, k, v = jnp.split(qkv.reshape(b, s, 3 * heads, h // heads), 3, axis=2)  # [B, S, 3*nh, hd]
  a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  a = checkpoint_name(a.reshape(b, s, h), "attn")
  x = x + a @ p["wo"]
  u = checkpoint_name(rms(x) @ p["w1"], "mlp_up")
  return x + jax.nn.gelu(u) @ p["w2"]


def gpt_stack(h, s, b, layers, dtype=jnp.bfloat16, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  init = lambda kk, shape: (jax.random.normal(kk, (layers,) + shape) * 0.02).astype(dtype)
  p = {
    "wqkv": init(k[0], (h, 3 * h)),
    "wo": init(k[1], (h, h)),
    "w1": init(k[2], (h, 4 * h)),
    "w2": init(k[3], (4 * h, h)),
  }
  x = jax.random.normal(k[4], (b, s, h), dtype)
  return p, x


def step_fn(policy, heads):
  body = lambda x, p: (gpt_layer(x, p, heads), None)
  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)

  def loss(p, x):
    y, _ = jax.lax.scan(body, x, p)
    return jnp.mean(y.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss))


def max_rel(a, b):
  return max(
    float(
      jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
      / (float(jnp.max(jnp.abs(y.astype(jnp.float32)))) + 1e-30)
    )
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


@pytest.mark.parametrize("location", ["nvme", "host"])
def test_gpu_grads_match_device_saving_and_repeat(store, location):
  p, x = gpt_stack(512, 256, 2, 3)
  ours = step_fn(ssd.offload_policy(NAMES, min_bytes=0, location=location), 4)
  ref = step_fn(cp.save_only_these_names(*NAMES), 4)
  plain = step_fn(None, 4)
  first, second = ours(p, x), ours(p, x)
  diff_same_policy = max_rel(first, ref(p, x))
  diff_plain = max_rel(first, plain(p, x))
  print(
    f"[{location}] max rel diff vs device saving {diff_same_policy:.3g}, vs plain {diff_plain:.3g}"
  )
  assert max_rel(first, second) == 0.0  # identical from run to run
  assert diff_same_policy < 2e-2 and diff_plain < 5e-2
  s = ssd.stats()
  assert s["tensors_written"] == 2 * 4 * 3


def test_gpu_fresh_inputs_every_step(store):
  # A stream race shows up as a result that differs from the device-saving policy by more
  # than rounding, or that moves between repeats on the same inputs.
  ours = step_fn(ssd.offload_policy(NAMES, min_bytes=0), 4)
  ref = step_fn(cp.save_only_these_names(*NAMES), 4)
  worst = 0.0
  for i in range(10):
    p, x = gpt_stack(512, 256, 2, 3, seed=i)
    a, b = ours(p, x), ours(p, x)
    assert max_rel(a, b) == 0.0
    worst = max(worst, max_rel(a, ref(p, x)))
  print(f"max rel diff over 10 fresh steps: {worst:.3g}")
  assert worst < 2e-2


def test_gpu_dtypes_and_odd_sizes(store):
  for dtype in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32):
    for n in (1, 4097, 3 * 4096 + 5):
      x = (jnp.arange(n) % 251).astype(dtype)

      def f(x, s):
        y = checkpoint_name(x * s if dtype != jnp.int32 else x + 1, "t")
        return jnp.sum(jnp.sin(y.astype(jnp.float32)) * s)

      g = lambda pol: jax.jit(jax.grad(jax.checkpoint(f, policy=pol), argnums=1))(
        x, jnp.float32(1.5)
      )
      np.testing.assert_array_equal(
        g(ssd.offload_policy(["t"], min_bytes=0)), g(cp.save_only_these_names("t"))
      )


def test_gpu_gpt_stack_memory_and_bytes(store):
  """The ROK benchmark's stack (H, S, B, L = 4096, 2048, 4, 8), 4 names offloaded."""
  h, s, b, layers = 4096, 2048, 4, 8
  p, x = gpt_stack(h, s, b, layers)
  temp = {}
  for label, pol in [("recompute", cp.nothing_saveable), ("ours", ssd.offload_policy(NAMES))]:
    compiled = step_fn(pol, h // 128).lower(p, x).compile()
    temp[label] = compiled.memory_analysis().temp_size_in_bytes
  ours = step_fn(ssd.offload_policy(NAMES), h // 128)
  jax.block_until_ready(ours(p, x))
  ssd.reset_stats()
  jax.block_until_ready(ours(p, x))
  st = ssd.stats()
  tagged = layers * b * s * (h + 3 * h + h + 4 * h) * 2
  print(
    f"XLA temp: recompute {temp['recompute'] / 1e9:.2f} GB, ours {temp['ours'] / 1e9:.2f} GB; "
    f"bytes written/step {st['bytes_written'] / 1e9:.3f} GB (tagged {tagged / 1e9:.3f} GB), "
    f"disk {st['disk_bytes_written'] / 1e9:.3f} GB, skipped {st['write_skipped_bytes'] / 1e9:.3f} GB"
  )
  assert temp["ours"] <= 1.10 * temp["recompute"]
  assert st["bytes_written"] == tagged and st["bytes_read"] == tagged


def _raw_store(x, site):
  return raw_store(x, site=site, tier=1, name="raw")


def _raw_load(h, like, site):
  return raw_load(h, like, site=site, tier=1, name="raw")


def test_gpu_loads_predict_their_handles(store):
  # The scan's backward loads every site in reverse store order: all loads predicted, none
  # wrong, and the result equals the one with handles read from the device.
  p, x = gpt_stack(512, 256, 2, 3)
  ours = step_fn(ssd.offload_policy(NAMES, min_bytes=0, location="host"), 4)
  predicted = ours(p, x)
  s = ssd.stats()
  assert s["speculative_loads"] == s["tensors_read"] == 4 * 3 and s["handle_mismatches"] == 0, s
  with ssd.configured(
    directory=store.directories[0] + "-exact", capacity_bytes=1 << 30, exact_loads=True
  ):
    ssd.reset_stats()
    exact = step_fn(ssd.offload_policy(NAMES, min_bytes=0, location="host"), 4)(p, x)
    assert ssd.stats()["speculative_loads"] == 0
  assert max_rel(predicted, exact) == 0.0


def test_gpu_out_of_order_loads_fail_the_step(store):
  # Two stores at one site loaded oldest first: the prediction (newest first) is wrong for
  # both loads. The step must fail with an error naming the cause, never return the swap.
  a = jnp.arange(4096, dtype=jnp.float32)
  b = a + 10000.0

  def oldest_first(a, b, site):
    ha = _raw_store(a, site)
    ha, b = jax.lax.optimization_barrier((ha, b))  # the second store after the first
    hb = _raw_store(b, site)
    la = _raw_load(ha, a, site)
    hb, la = jax.lax.optimization_barrier((hb, la))  # the second load after the first
    return la, _raw_load(hb, b, site)

  with pytest.raises(Exception, match="exact_loads"):
    jax.block_until_ready(jax.jit(lambda a, b: oldest_first(a, b, 77))(a, b))
  with ssd.configured(
    directory=store.directories[0] + "-exact", capacity_bytes=1 << 30, exact_loads=True
  ):
    la, lb = jax.jit(lambda a, b: oldest_first(a, b, 78))(a, b)
    np.testing.assert_array_equal(np.asarray(la), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(lb), np.asarray(b))


def test_gpu_optimizer_loads_predicted_in_store_order(store):
  # A streamed update's loads are exact and ordered: its first load reads its handle (a sync),
  # the others are predicted in the order the last update stored them and checked on the GPU.
  # Same bits as reading every handle (exact_loads=True).
  tx = ssd.offload_optimizer(optax.adam(1e-3), location="host", min_bytes=0, chunk_bytes=64 << 10)
  params = {"a": jnp.ones((512, 256)), "b": jnp.full((300, 128), 0.5)}
  grads = jax.tree.map(lambda p: p * 1e-2, params)

  def run():
    state, p = tx.init(params), params
    for _ in range(3):
      ssd.reset_stats()
      u, state = jax.jit(tx.update)(grads, state, p)
      p = optax.apply_updates(p, u)
      jax.block_until_ready(p)
    return p, ssd.stats()

  predicted, s = run()
  assert s["tensors_read"] > 4 and s["handle_mismatches"] == 0, s
  assert s["speculative_loads"] == s["tensors_read"] - 1, s  # all but the update's first
  with ssd.configured(
    directory=store.directories[0] + "-exact", capacity_bytes=1 << 30, exact_loads=True
  ):
    exact, s = run()
    assert s["speculative_loads"] == 0, s
  for k in params:
    np.testing.assert_array_equal(np.asarray(predicted[k]), np.asarray(exact[k]))


def test_gpu_ordered_loads_out_of_store_order_fail_the_step(store):
  # Three entries of one site stored by one execution, loaded by another as "ordered" exact
  # loads in the order 0, 2, 1: the predictions of the last two are wrong, and the step fails
  # naming the cause. Exact loads that read their handles take any order.
  chunks = [jnp.full((4096,), float(i)) for i in range(3)]
  handles = jax.jit(lambda cs: [_raw_store(c, 91) for c in cs])(chunks)

  def load(hs, site, exact):
    out, after = [], None
    for i in (0, 2, 1):
      h = hs[i] if after is None else jax.lax.optimization_barrier((hs[i], after))[0]
      after = raw_load(h, chunks[i], site=site, tier=1, name="raw", exact=exact)
      out.append(after)
    return out

  got = jax.jit(lambda hs: load(hs, 91, 1))(handles)  # read: any order
  for i, g in zip((0, 2, 1), got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(chunks[i]))
  handles = jax.jit(lambda cs: [_raw_store(c, 92) for c in cs])(chunks)
  with pytest.raises(Exception, match="exact_loads"):
    jax.block_until_ready(jax.jit(lambda hs: load(hs, 92, 2))(handles))


@pytest.mark.parametrize("location", ["nvme", "host"])
def test_gpu_entries_released_at_their_last_load(store, location):
  # Counted lifetimes on the GPU: every entry is released after its last load's copy, with no
  # host wait for it (the release is deferred to the copy's event), across new programs.
  from jax_ssdtrain._src import native

  policy = ssd.offload_policy(NAMES, min_bytes=0, location=location)
  ref = step_fn(cp.save_only_these_names(*NAMES), 4)
  for batch in (2, 3, 2):
    p, x = gpt_stack(512, 256, batch, 3)
    got = step_fn(policy, 4)(p, x)
    assert max_rel(got, ref(p, x)) < 2e-2
  native.flush()  # collects the deferred releases whose copies are done
  s = native.stats()
  assert s["live_entries"] == 0 and s["uncounted_entries"] == 0, s
  assert s["counted_releases"] == s["tensors_written"] == 3 * 4 * 3, s
  assert s["host_tier_bytes_in_use"] == 0 and s["file_bytes_in_use"] == 0, s
  assert s["staging_bytes_in_use"] == 0, s
  assert s["speculative_loads"] == s["tensors_read"], s  # no load read its handle (a sync)


def test_gpu_vjp_across_jits_applied_twice_then_swept(store):
  import gc

  from jax_ssdtrain._src import native

  p, x = gpt_stack(512, 256, 2, 3)
  body = jax.checkpoint(
    lambda x, p: (gpt_layer(x, p, 4), None),
    policy=ssd.offload_policy(NAMES, min_bytes=0),
    prevent_cse=False,
  )
  f = jax.jit(lambda p, x: jnp.mean(jax.lax.scan(body, x, p)[0].astype(jnp.float32) ** 2))
  _, vjp = jax.vjp(f, p, x)
  first, second = vjp(jnp.float32(1.0)), vjp(jnp.float32(2.0))
  assert max_rel(jax.tree.map(lambda g: 2 * g, first), second) < 2e-2
  assert native.stats()["live_entries"] == 4 * 3
  del vjp, first, second
  gc.collect()
  assert ssd.collect() == 4 * 3
  assert native.stats()["live_entries"] == 0


def test_gpu_accumulation_adds_its_running_mean_and_no_more(store):
  # accumulate_gradients on a scanned GPT (gpt-1.3b's width, 4 layers, each recomputed): the
  # step's device memory exceeds the plain step's by its running mean. A tree of zeros for the
  # mean's first micro-step was merged by XLA with the backward pass's zero-initialized
  # gradient buffers and materialized: a second gradient-sized tree (16.5 GB at 8B).
  import dataclasses

  from scripts.training import RunConfig, build_model, step_memory_bytes

  base = RunConfig(
    preset="gpt-1.3b", batch=1, seq_len=512, remat_policy="remat", model_overrides={"num_layers": 4}
  )
  cfg = base.model_config()
  model = build_model(base.model, cfg, None)
  tokens = jnp.zeros((1, base.example_length(cfg)), jnp.int32)
  shapes = jax.eval_shape(
    lambda r: model.init(r, tokens, r, method="loss")["params"], jax.random.key(0)
  )
  mean = sum(x.size * 4 for x in jax.tree.leaves(shapes))  # float32, as the parameters
  plain = step_memory_bytes(base)
  accumulated = step_memory_bytes(dataclasses.replace(base, accum=4))
  print(
    f"step: plain {plain / 1e9:.2f} GB, accumulated {accumulated / 1e9:.2f} GB, mean {mean / 1e9:.2f} GB"
  )
  assert accumulated - plain <= 1.25 * mean, (plain, accumulated, mean)


def test_gpu_optimizer_state_is_read_ahead_in_its_store_order(tmp_path):
  # tests/test_readahead.py's test through the CUDA handlers: a step loads the state in the
  # order the step before stored it (chunk by chunk, leaf by leaf), the reverse of
  # activations, and after each load the read-ahead takes the chunks stored next. The
  # newest-first read-ahead of activations read the old state's last chunks instead: the loads
  # before them waited for their own reads.
  check_state_read_ahead_in_store_order(tmp_path, jax.devices()[0])
