"""The Llama model (models/llama.py) on the CPU: offloaded tags bit-exact against the device,
chunked MLP and loss against unchunked, sequences past every max_len, grouped-query attention
against repeated key/value heads, and the chunked loss's memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import fake_flash_attention

import models
from models import llama
from models.common import ATTN, LAYER_IN, MLP_UP, QKV

TAGS = (LAYER_IN, QKV, ATTN, MLP_UP)
# float32 compute: chunking changes only the order of float32 sums (a weight's gradient summed
# over chunks, the loss summed chunk by chunk). Relative to the largest element of each array.
CHUNK_RTOL = 1e-5
# Programs whose results are compared within a tolerance compile with less optimisation (half
# the CPU compile time); the bit-exact comparisons and the memory analysis compile as usual.
FAST = {"xla_backend_optimization_level": 0}


def _tokens(batch, length, vocab, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, jnp.int32)


def _run(fn, *args, options=FAST):
  """``jax.jit(fn)(*args)``, compiled with ``options``."""
  return jax.jit(fn).lower(*args).compile(options)(*args)


def _params(cfg, tokens):
  return _run(lambda r: llama.Llama(cfg).init(r, tokens, None, method="loss")["params"], _KEY)


_KEY = jax.random.key(1)


def _loss_and_grads(cfg, policy, params, tokens, options=FAST):
  model = llama.Llama(cfg, policy)
  f = lambda p: model.apply({"params": p}, tokens, method="loss")[0]  # noqa: E731
  return _run(jax.value_and_grad(f), params, options=options)


def _close(got, want, rtol):
  def check(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-30)
    assert np.abs(a - b).max() <= rtol * scale, (np.abs(a - b).max() / scale, rtol)

  jax.tree.map(check, got, want)


# ----------------------------------------------------------------------------- config
def test_config_and_presets():
  cfg = models.get_config("llama", "llama3-8b")
  assert (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.mlp_dim) == (
    32,
    4096,
    32,
    8,
    14336,
  )
  assert cfg.vocab_size == 128256 and cfg.rope_theta == 500000.0 and not cfg.tie_embeddings
  assert cfg.param_dtype == "float32" and cfg.dtype == "bfloat16"
  shapes = {"llama3-1b": (16, 2048, 32, 8, 8192), "llama3-3b": (28, 3072, 24, 8, 8192)}
  for preset, shape in shapes.items():
    c = models.get_config("llama", preset)
    assert (c.num_layers, c.hidden, c.num_heads, c.kv_heads, c.mlp_dim) == shape
  # Llama 3 8B's 8.03B parameters; the 1B and 3B shapes with their head untied
  expected = {"llama3-1b": 1.498e9, "llama3-3b": 3.607e9, "llama3-8b": 8.030e9}
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  for preset, n in expected.items():
    c = models.get_config("llama", preset)
    shapes = jax.eval_shape(lambda t, c=c: llama.Llama(c).init(jax.random.key(0), t), tokens)
    count = sum(x.size for x in jax.tree.leaves(shapes))
    assert count == llama.parameter_count(c) and abs(count / n - 1) < 2e-3, (preset, count)
  # the other models are as they were: one key/value head per query head, no chunks
  gpt = models.get_config("gpt", "small")
  assert gpt.kv_heads == gpt.num_heads and gpt.mlp_chunks == gpt.loss_chunks == 1
  for bad, match in (
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(mlp_chunks=0), "mlp_chunks"),
    (dict(loss_chunks=2.0), "loss_chunks"),
    (dict(param_dtype="int8"), "param_dtype"),
  ):
    with pytest.raises(ValueError, match=match):
      models.get_config("llama", "tiny", **bad)
  for model, bad in (("gpt", dict(loss_chunks=4)), ("t5", dict(num_kv_heads=2)), ("bert", {})):
    with pytest.raises(ValueError, match="only the llama model"):
      models.get_config(model, "tiny", **(bad or dict(positions="rope")))
  with pytest.raises(ValueError, match="rotary positions and an untied head"):
    llama.Llama(models.get_config("gpt", "tiny")).init(jax.random.key(0), jnp.zeros((1, 4), int))


# ----------------------------------------------------------------------------- offload
@pytest.fixture(scope="module")
def offload_case():
  """The tiny Llama (bfloat16 compute, the MLP in chunks: its tag inside them) and its step
  with the four tags saved on the device."""
  cfg = models.get_config("llama", "tiny", mlp_chunks=2)
  tokens = _tokens(2, 33, cfg.vocab_size)
  params = _params(cfg, tokens)
  save = jax.checkpoint_policies.save_only_these_names(*TAGS)
  device = _loss_and_grads(cfg, save, params, tokens, options=None)
  return cfg, tokens, params, jax.block_until_ready(device)


@pytest.mark.parametrize("location", ["host", "nvme"])
def test_offloaded_tags_equal_device(offload_case, location):
  import jax_ssdtrain as ssd

  cfg, tokens, params, device = offload_case
  ssd.reset_stats()
  policy = ssd.offload_policy(TAGS, location=location, min_bytes=0)
  got = jax.block_until_ready(_loss_and_grads(cfg, policy, params, tokens, options=None))
  stats = ssd.stats()
  # the loss and every gradient bit for bit; on a GPU the embedding table's gradient (a
  # scatter-add of the tokens' rows, duplicates accumulated by atomics in no fixed order) varies
  # by a few bfloat16 ulps between runs of the same program, offloaded or not
  flat = [jax.tree_util.tree_flatten_with_path(t)[0] for t in (got, device)]
  assert len(flat[0]) == len(flat[1])
  for (path, g), (_, d) in zip(*flat):
    if jax.default_backend() == "gpu" and "embed" in jax.tree_util.keystr(path):
      np.testing.assert_allclose(g, d, rtol=0, atol=2**-6 * float(np.max(np.abs(d))))
    else:
      np.testing.assert_array_equal(g, d)
  # every tag of every layer went to the store, the MLP's chunk by chunk: (B, S, ...) bfloat16
  B, S, H, N, K, D, F = 2, 32, cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
  per_layer = B * S * (H + (N + 2 * K) * D + N * D + 2 * F) * 2
  assert stats["bytes_written"] == cfg.num_layers * per_layer, stats
  assert stats["bytes_read"] == stats["bytes_written"], stats


# ----------------------------------------------------------------------------- chunks
def test_chunked_mlp_and_loss_equal_unchunked():
  # 31 positions: neither 4 MLP chunks (of 8: three and a remainder of 7) nor 3 loss chunks
  # (of 11: two and 9) divide it
  # float32 matmuls in float32 (a GPU's default precision rounds their inputs to TF32, 1e-4)
  cfg = models.get_config("llama", "tiny", dtype="float32")
  tokens = _tokens(2, 32, cfg.vocab_size)
  params = _params(cfg, tokens)
  with jax.default_matmul_precision("float32"):
    want = _loss_and_grads(cfg, None, params, tokens)
    chunked = dataclasses.replace(cfg, mlp_chunks=4, loss_chunks=3)
    got = _loss_and_grads(chunked, None, params, tokens)
  _close(got, want, CHUNK_RTOL)
  assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), got, want)))


def test_chunked_functions_equal_whole_in_bfloat16():
  # the pieces alone in bfloat16 compute: each chunk's weight gradient is a bfloat16 product
  # (rounded once per chunk, then summed in float32), so chunked and whole differ by bfloat16
  # rounding of those partial sums: within BF16_RTOL of the largest element at 8 chunks
  BF16_RTOL = 5e-2
  k = jax.random.split(jax.random.key(3), 5)
  x = jax.random.normal(k[0], (2, 40, 32), jnp.float32)
  w_up, w_down = 0.1 * jax.random.normal(k[1], (32, 2, 64)), 0.1 * jax.random.normal(k[2], (64, 32))
  head, targets = 0.1 * jax.random.normal(k[3], (32, 96)), jax.random.randint(k[4], (2, 40), 0, 96)

  def both(chunks):  # the MLP's output sum and the loss, each with its gradients: one program
    def mlp(x, u, d):
      return llama.chunked_swiglu(x, u, d, jnp.bfloat16, chunks).astype(jnp.float32).sum()

    def loss(x, w):
      return llama.chunked_cross_entropy(x, w, targets, jnp.bfloat16, chunks)[0]

    return _run(
      lambda: (
        jax.value_and_grad(mlp, argnums=(0, 1, 2))(x, w_up, w_down),
        jax.value_and_grad(loss, argnums=(0, 1))(x, head),
      )
    )

  want = both(1)
  for chunks in (3, 8):  # 40 positions: chunks of 14 (two and a remainder of 12) and of 5
    _close(both(chunks), want, BF16_RTOL)


# ----------------------------------------------------------------------------- long sequences
def test_sequence_past_every_max_len_runs():
  S = 4096  # the GPT presets' learned positions stop at 2048
  assert S > max(models.get_config("gpt", p).max_len for p in models.PRESETS if "llama" not in p)
  cfg = models.get_config("llama", "tiny", num_layers=1, mlp_chunks=4, loss_chunks=4)
  tokens = _tokens(1, S + 1, cfg.vocab_size)
  params = _params(cfg, tokens[:, :9])  # the parameters do not depend on the length
  loss, grads = _loss_and_grads(
    cfg, jax.checkpoint_policies.save_only_these_names(LAYER_IN), params, tokens
  )
  assert np.isfinite(loss) and abs(float(loss) - np.log(cfg.vocab_size)) < 0.5, loss
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  gpt = models.get_config("gpt", "tiny")  # and the GPT refuses it
  with pytest.raises(ValueError, match="max_len"):
    jax.eval_shape(lambda t: models.GPT(gpt).init(jax.random.key(0), t), tokens[:, :S])


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("base", [False, True])
def test_flash_attention_saveable_spares_the_forward_pass(base):
  # A layer recomputed from its input (in the store): with flash_attention_saveable its
  # attention's forward outputs are saved and the forward primitive runs once, else twice (the
  # recomputation); the gradients are the same.
  import jax_ssdtrain as ssd
  from models.common import LAYER_IN

  attention, fwd_p = fake_flash_attention()

  def layer(w, x):
    x = jax.ad_checkpoint.checkpoint_name(x, LAYER_IN)
    q, k, v = (jnp.tanh(x @ w[i]).reshape(x.shape[0], x.shape[1], 2, -1) for i in range(3))
    return jnp.sum(jnp.square(attention(q, k, v)))

  x = jax.random.normal(jax.random.key(0), (1, 64, 16), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (3, 16, 16), jnp.float32) / 4
  policy = ssd.offload_policy(
    [LAYER_IN], location="host", min_bytes=0, base=ssd.flash_attention_saveable if base else None
  )
  grad = jax.grad(jax.checkpoint(layer, policy=policy), argnums=(0, 1))
  text = str(jax.make_jaxpr(grad)(w, x))
  assert text.count(fwd_p.name) == (1 if base else 2), text
  got = jax.jit(grad)(w, x)
  want = jax.grad(layer, argnums=(0, 1))(w, x)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "names, base, runs",
  [
    ((LAYER_IN,), False, 2),
    ((LAYER_IN, ATTN), False, 2),  # the tag is not what attention's backward reads
    (TAGS, False, 2),  # nor are the four tags ("selective")
    ((LAYER_IN,), True, 1),
  ],
  ids=["layer_in", "layer_in+attn", "four_tags", "layer_in+flash_attention_saveable"],
)
def test_which_policies_spare_attentions_forward_pass(monkeypatch, names, base, runs):
  # The Llama's attention shaped as cuDNN's (a custom_vjp whose backward reads its forward
  # primitive's outputs): saving the attn tag, or all four tags, still runs the forward pass
  # again in the backward one; flash_attention_saveable does not.
  import jax_ssdtrain as ssd

  attention, fwd_p = fake_flash_attention()

  def cudnn_like(q, k, v, is_causal=True, implementation=None):
    del is_causal, implementation  # causal, as the model asks
    rep = q.shape[2] // k.shape[2]
    return attention(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2))

  monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_like)
  cfg = models.get_config("llama", "tiny", num_layers=2)
  tokens = jnp.zeros((1, 65), jnp.int32)
  init = lambda r: llama.Llama(cfg).init(r, tokens[:, :9], None, method="loss")["params"]  # noqa: E731
  params = jax.eval_shape(init, _KEY)  # traced only: the program is counted, not run
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  if base:
    policy = jax.checkpoint_policies.save_from_both_policies(policy, ssd.flash_attention_saveable)
  model = llama.Llama(cfg, policy)
  f = lambda p: model.apply({"params": p}, tokens, method="loss")[0]  # noqa: E731
  assert str(jax.make_jaxpr(jax.value_and_grad(f))(params)).count(fwd_p.name) == runs


def test_flash_attention_saveable_saves_nothing_else():
  import jax_ssdtrain as ssd

  x = jnp.ones((4, 4))
  assert not ssd.flash_attention_saveable(jax.lax.dot_general_p, x, x)
  assert not ssd.flash_attention_saveable(jax.lax.exp_p, x)


@pytest.mark.gpu
def test_cudnn_attention_forward_is_saved_and_not_recomputed():
  # On a GPU the Llama's attention is cuDNN's: with the layer inputs in the store and
  # flash_attention_saveable, one forward attention call in the step's program (the layers'
  # scan body: none recomputed), else two; the loss the same.
  import jax_ssdtrain as ssd
  from jax_ssdtrain._src import jax_internals as ji

  if jax.default_backend() != "gpu":
    pytest.skip("cuDNN's flash attention runs on a GPU")
  cfg = models.get_config("llama", "tiny", num_layers=2)
  assert cfg.attention_impl() == "cudnn", cfg.attention_impl()
  tokens = _tokens(1, 257, cfg.vocab_size)
  params = _params(cfg, tokens)
  counts, losses = [], []
  for base in (None, ssd.flash_attention_saveable):
    policy = ssd.offload_policy([LAYER_IN], location="host", min_bytes=0, base=base)
    model = llama.Llama(cfg, policy)
    f = lambda p, model=model: model.apply({"params": p}, tokens, method="loss")[0]  # noqa: E731
    text = str(jax.make_jaxpr(jax.value_and_grad(f))(params))
    counts.append(text.count(ji.FLASH_ATTENTION_FORWARD))
    losses.append(float(_run(jax.value_and_grad(f), params, options=None)[0]))
  assert counts == [2, 1], counts
  assert losses[0] == losses[1], losses


def test_grouped_query_attention_equals_repeated_heads():
  cfg = models.get_config("llama", "tiny", dtype="float32")  # 4 query heads, 2 key/value heads
  N, K = cfg.num_heads, cfg.kv_heads
  assert K < N
  tokens = _tokens(2, 24, cfg.vocab_size)
  params = _params(cfg, tokens)
  # the same model with one key/value head per query head, each group's head repeated
  full = dataclasses.replace(cfg, num_kv_heads=N)
  qkv = params["decoder"]["layers"]["attn"]["qkv"]["kernel"]  # (L, H, N + 2K, D)
  q, k, v = qkv[:, :, :N], qkv[:, :, N : N + K], qkv[:, :, N + K :]
  rep = lambda a: jnp.repeat(a, N // K, axis=2)  # noqa: E731
  repeated = jax.tree.map(lambda a: a, params)
  repeated["decoder"]["layers"]["attn"]["qkv"]["kernel"] = jnp.concatenate(
    [q, rep(k), rep(v)], axis=2
  )
  logits = lambda c, p: _run(lambda p: llama.Llama(c).apply({"params": p}, tokens), p)  # noqa: E731
  got, want = logits(cfg, params), logits(full, repeated)
  _close(got, want, 1e-5)
  # and a wrong grouping (key/value heads tiled, not repeated) is told apart
  tiled = jax.tree.map(lambda a: a, params)
  tiled["decoder"]["layers"]["attn"]["qkv"]["kernel"] = jnp.concatenate(
    [q, jnp.tile(k, (1, 1, N // K, 1)), jnp.tile(v, (1, 1, N // K, 1))], axis=2
  )
  assert np.abs(logits(full, tiled) - got).max() > 1e-3


# ----------------------------------------------------------------------------- memory
def _temp_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_and_mlp_use_less_memory():
  # a whole step of the model (loss and gradients): the float32 logits dominate at this vocab
  B, S, V = 1, 512, 8192
  cfg = models.get_config("llama", "tiny", num_layers=1, vocab_size=V)
  tokens = jax.ShapeDtypeStruct((B, S + 1), jnp.int32)
  params = jax.eval_shape(lambda t: llama.Llama(cfg).init(_KEY, t, None, method="loss"), tokens)

  def model_step(chunks):
    model = llama.Llama(dataclasses.replace(cfg, loss_chunks=chunks))
    f = lambda p, t: model.apply(p, t, method="loss")[0]  # noqa: E731
    return _temp_bytes(jax.value_and_grad(f), params, tokens)

  logits = B * S * V * 4  # the float32 logits, whole
  whole, chunked = model_step(1), model_step(8)
  assert whole >= logits and chunked < whole / 2, (whole, chunked, logits)

  # the MLP alone: its hidden activation dominates
  H, F = 64, 1024
  x = jax.ShapeDtypeStruct((B, 4 * S, H), jnp.bfloat16)
  w_up = jax.ShapeDtypeStruct((H, 2, F), jnp.float32)
  w_down = jax.ShapeDtypeStruct((F, H), jnp.float32)

  def mlp_step(chunks):
    f = lambda x, u, d: llama.chunked_swiglu(x, u, d, jnp.bfloat16, chunks).sum()  # noqa: E731
    return _temp_bytes(jax.value_and_grad(f, argnums=(0, 1, 2)), x, w_up, w_down)

  hidden = B * 4 * S * 2 * F * 2  # the bfloat16 gate and up activations, whole
  whole, chunked = mlp_step(1), mlp_step(8)
  assert whole >= hidden and chunked < whole / 2, (whole, chunked, hidden)


# ----------------------------------------------------------------------------- layer stream
def test_llama_pieces_compose_to_the_model():
  from models.layer_stream import llama_pieces

  pieces = llama_pieces("tiny", dtype="float32", loss_chunks=2)
  cfg = pieces.cfg
  tokens = _tokens(2, 17, cfg.vocab_size)
  params = _params(cfg, tokens)
  layers = params["decoder"]["layers"]
  one = jax.eval_shape(pieces.init_layer, jax.random.key(0))
  assert jax.tree.structure(one) == jax.tree.structure(layers)
  side = jax.eval_shape(pieces.init_side, jax.random.key(0), tokens)
  ep, hp = params["embed"], {"head": params["head"], "ln_final": params["decoder"]["ln_final"]}
  assert jax.tree.structure(side) == jax.tree.structure((ep, hp))

  def streamed(params):
    x = pieces.embed(ep, tokens)
    for i in range(cfg.num_layers):
      x = pieces.block(jax.tree.map(lambda a: a[i], layers), x)
    return pieces.head(hp, x, tokens)

  model = _run(lambda p: llama.Llama(cfg).apply({"params": p}, tokens, method="loss")[0], params)
  _close(_run(streamed, params), model, 1e-6)
