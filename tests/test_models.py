"""Models: tags, presets, training on `tiny`, nvme offload bit-exact against device saving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from scripts import data as data_lib
from scripts import training

TAGS_BY_MODEL = {
  "gpt": {"layer_in", "qkv", "attn", "mlp_up"},
  "bert": {"layer_in", "qkv", "attn", "mlp_up"},
  "t5": set(models.TAGS),
  "llama": {"layer_in", "qkv", "attn", "mlp_up"},
}
BLOCK_TAGS = ("layer_in", "qkv", "attn", "mlp_up", "cross_q", "cross_kv")


def train_losses(run: training.RunConfig, steps: int):
  state, _, _ = training.create_train_state(run)
  cfg = run.model_config()
  batches = data_lib.synthetic_batches(run.batch, run.example_length(cfg), cfg.vocab_size, run.seed)
  step, rng, losses = jax.jit(training.train_step), jax.random.key(1), []
  for _ in range(steps):
    state, metrics = step(state, next(batches), rng)
    losses.append(float(metrics["loss"]))
  return np.array(losses), state


def loss_and_grads(run: training.RunConfig):
  """One forward+backward (no optimizer: cheaper to compile than a train step)."""
  state, model, _ = training.create_train_state(run)
  cfg = run.model_config()
  tokens = next(
    data_lib.synthetic_batches(run.batch, run.example_length(cfg), cfg.vocab_size, run.seed)
  )
  f = lambda p: model.apply({"params": p}, tokens, jax.random.key(1), method="loss")[0]
  return jax.jit(jax.value_and_grad(f))(state.params)


@pytest.mark.parametrize(
  "model",
  [m if m == "gpt" else pytest.param(m, marks=pytest.mark.slow) for m in sorted(models.MODELS)],
)
def test_tiny_loss_falls(model):
  run = training.RunConfig(
    model=model, batch=8, steps=20, locations="qkv=nvme,mlp_up=nvme", min_bytes=0
  )
  losses, _ = train_losses(run, 20)
  assert np.all(np.isfinite(losses))
  assert losses[-3:].mean() < losses[0] - 0.5, losses


def test_master_weights_in_the_store_train():
  # bfloat16 parameters on the device, their float32 copy streamed with AdamW's moments.
  from test_optimizer import assert_rounds_to

  import jax_ssdtrain as ssd

  run = training.RunConfig(
    batch=8, steps=20, optimizer_location="host", master_weights=True, min_bytes=0
  )
  losses, state = train_losses(run, 20)
  assert losses[-3:].mean() < losses[0] - 0.5, losses
  master = ssd.optimizer_state(state.opt_state).master
  for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(master)):
    assert p.dtype == jnp.bfloat16 and m.dtype == jnp.float32
    assert_rounds_to(p, m)


def test_jax_pinned_host_optimizer_state_trains_as_on_the_device():
  # optimizer_location="pinned_host": JAX's own host offload of the state (the comparison the
  # long-context benchmark runs): the same losses and parameters bit for bit, the state in
  # pinned host memory between the steps
  base = dict(batch=4, steps=4, master_weights=True, min_bytes=0)
  device_losses, on_device = train_losses(training.RunConfig(**base), 4)
  host_losses, on_host = train_losses(
    training.RunConfig(optimizer_location="pinned_host", **base), 4
  )
  np.testing.assert_array_equal(host_losses, device_losses)
  jax.tree.map(np.testing.assert_array_equal, on_host.params, on_device.params)
  assert training.optimizer_location(on_host.opt_state) == "pinned_host"
  assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host.opt_state)} == {"pinned_host"}
  with pytest.raises(ValueError, match="optimizer_in_place is the store's"):
    training.make_optimizer(
      training.RunConfig(optimizer_location="pinned_host", optimizer_in_place=True)
    )


@pytest.mark.parametrize(
  "model,dtype",
  [
    (m, d) if (m, d) == ("gpt", "float32") else pytest.param(m, d, marks=pytest.mark.slow)
    for m in sorted(models.MODELS)
    for d in ("float32", "bfloat16")
  ],
)
def test_nvme_offload_bit_exact_vs_device(model, dtype):
  tags = [t for t in BLOCK_TAGS if t in TAGS_BY_MODEL[model]]
  if jax.default_backend() == "cpu":  # loss and every gradient, bit for bit, compiled without
    # FMA in a process of its own (tests/_models_exact_worker.py says why)
    from _common import run_worker

    result = run_worker("_models_exact_worker.py", model, dtype, ",".join(tags))
    assert result["differ"] == [], f"offloaded != saved on the device: {result}"
    stats = result
  else:  # GPU: XLA fuses the backward differently around the custom calls, and "f32" matmuls
    # run in TF32: rounding-level noise only
    import jax_ssdtrain as ssd

    common = dict(model=model, batch=4, dtype=dtype, min_bytes=0)
    ssd.reset_stats()
    locations = lambda where: ",".join(f"{t}={where}" for t in tags)  # noqa: E731
    nvme = jax.block_until_ready(
      loss_and_grads(training.RunConfig(locations=locations("nvme"), **common))
    )
    stats = ssd.stats()
    device = loss_and_grads(training.RunConfig(locations=locations("device"), **common))
    tol = dict(rtol=5e-3, atol=5e-4) if dtype == "float32" else dict(rtol=2e-2, atol=1e-3)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), nvme, device)
  assert stats["bytes_written"] > 0 and stats["bytes_read"] > 0, f"nothing was offloaded: {stats}"


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_tags_present(model):
  cfg = models.get_config(model, "tiny")
  m = models.build_model(model, cfg)
  tokens = jnp.zeros((2, 16), jnp.int32)
  params = jax.eval_shape(
    lambda: m.init(jax.random.key(0), tokens, jax.random.key(0), method="loss")
  )
  jaxpr = str(
    jax.make_jaxpr(lambda p: m.apply(p, tokens, jax.random.key(0), method="loss"))(params)
  )
  found = {
    t
    for t in models.TAGS
    if f"name={t}\n" in jaxpr or f"name={t} " in jaxpr or f"name={t}]" in jaxpr
  }
  assert found == TAGS_BY_MODEL[model]


@pytest.mark.slow  # each policy's offload is checked against the device in the fast tests
def test_remat_policies_agree():
  """keep / full remat / selective saving give the same f32 loss and gradients."""
  base = dict(model="gpt", batch=4, dtype="float32")
  ref = loss_and_grads(training.RunConfig(remat_policy="keep", **base))
  for kw in (dict(remat_policy="remat"), dict(locations="qkv=device,attn=remat")):
    got = loss_and_grads(training.RunConfig(**kw, **base))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), got, ref)


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_untied_embeddings_and_other_positions(model):
  overrides = dict(tie_embeddings=False, **({"positions": "learned"} if model == "t5" else {}))
  run = training.RunConfig(model=model, batch=2, model_overrides=overrides)
  state, m, _ = training.create_train_state(run)
  assert "logits" in str(jax.tree.map(jnp.shape, state.params))
  tokens = jnp.ones((2, run.example_length(run.model_config())), jnp.int32)
  loss, _ = jax.jit(lambda p: m.apply({"params": p}, tokens, jax.random.key(0), method="loss"))(
    state.params
  )
  assert np.isfinite(loss)


@pytest.mark.parametrize("preset", models.PRESETS)
def test_presets(preset):
  for model in models.MODELS:
    cfg = models.get_config(model, preset)
    assert cfg.hidden % cfg.num_heads == 0 and cfg.dtype == "bfloat16"
  cfg = models.get_config("gpt", preset)
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  shapes = jax.eval_shape(lambda t: models.GPT(cfg).init(jax.random.key(0), t), tokens)
  n = sum(x.size for x in jax.tree.leaves(shapes))
  expected = {
    "small": 124e6,
    "medium": 355e6,
    "large": 774e6,
    "xl": 1.56e9,
    "gpt-1.3b": 1.3e9,
    "gpt-2.7b": 2.65e9,
    "gpt-4b": 4.2e9,
    "gpt-6.7b": 6.65e9,
    "gpt-8b": 8.25e9,
    "gpt-13b": 12.85e9,
    "gpt-20b": 20.26e9,
    "gpt-30b": 29.97e9,
    "gpt-34b": 34.26e9,
  }
  if preset in expected:
    assert abs(n / expected[preset] - 1) < 0.05, n


def test_locations_parsing():
  assert models.parse_locations("qkv=nvme, attn=host") == {"qkv": "nvme", "attn": "host"}
  assert models.resolve_locations("keep", None) is None
  assert models.resolve_locations(None, None) is None
  assert models.resolve_locations("remat", None) == {"layer_in": "device"}
  assert models.resolve_locations("offload", "attn=remat")["attn"] == "remat"
  assert models.resolve_locations(None, "qkv=nvme") == {"qkv": "nvme"}
  assert models.resolve_locations("keep", "qkv=nvme")["mlp_up"] == "device"
  for bad in ("qkv", "qkv=ssd", "foo=nvme"):
    with pytest.raises(ValueError):
      models.parse_locations(bad)
  with pytest.raises(ValueError):
    models.resolve_locations("sometimes", None)
  with pytest.raises(ValueError):
    models.get_config("gpt", "huge")
