"""Llama: a decoder-only causal LM for long sequences, with the repository's activation tags.

Llama 3's structure: rotary positions (computed for any length: no cap on the sequence but
memory), RMSNorm, a SwiGLU MLP, grouped-query attention (``num_kv_heads`` key/value heads,
passed to ``jax.nn.dot_product_attention`` as they are: it groups the query heads itself), an
untied head, no biases; bfloat16 compute and float32 parameters by default (``dtype``,
``param_dtype``). Attention is ``jax.nn.dot_product_attention`` with the config's
``attention_impl()`` (cuDNN's flash attention on a GPU, XLA's elsewhere), causal.

Two things keep the per-layer working set from growing with the sequence beyond attention's own:

* ``mlp_chunks``: the MLP runs over the sequence in chunks, one ``jax.checkpoint`` of a chunk at
  a time under ``lax.map``, so the hidden activation ``[B, S, 2, F]`` (gate and up) is never
  whole; the backward pass recomputes a chunk's hidden activation when it reaches the chunk.
* ``loss_chunks``: the head's logits and the cross entropy run over the sequence in chunks the
  same way, float32 logits ``[B, S / loss_chunks, vocab]`` and a float32 logsumexp at a time:
  never the whole ``[B, S, vocab]``.

Tags (``models.common``'s names, so every policy, the planner and MaxText's names apply):
``layer_in`` the block input, ``qkv`` the fused projection ``(B, S, N + 2K, D)`` before the
rotary positions, ``attn`` the attention output ``(B, S, N, D)``, ``mlp_up`` the fused gate and
up projections of one MLP chunk ``(B, c, 2, F)``. With chunks, ``mlp_up`` is tagged inside each
chunk: while differentiating a block under a policy, JAX applies the block's policy inside the
chunk's checkpoint too, so ``mlp_up`` in the store writes each chunk's hidden activation as a
tensor of its own (``mlp_chunks`` stores and loads per layer, a chunk's bytes each) and loads it
back in the backward pass instead of recomputing the chunk's up projections; ``mlp_up`` saved on
the device keeps every chunk's, the whole ``[B, S, 2, F]`` (the chunking then saves no memory);
recomputed (the default of a policy that does not name it), the chunk's own checkpoint holds one
chunk at a time.

Sequence lengths that ``mlp_chunks`` or ``loss_chunks`` do not divide run too: the chunks are
``ceil(S / chunks)`` positions and the remainder is one chunk more of the same function.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .common import ATTN, LAYER_IN, MLP_UP, QKV, ModelConfig, SplitPolicy
from .parallel import constrain_batch, gather_weight

RMS_EPS = 1e-5  # Llama 3's RMSNorm epsilon
_INIT = nn.initializers.normal(0.02)


# ----------------------------------------------------------------------------- functions
def rotary_tables(length: int, head_dim: int, theta: float):
  """``(cos, sin)``, each float32 ``(length, head_dim // 2)``, of the positions ``0 .. length-1``
  (computed, not looked up: any length)."""
  if head_dim % 2:
    raise ValueError(f"head_dim: rotary positions need an even head dimension, got {head_dim}")
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
  """Rotates ``x`` ``(B, S, heads, D)`` by its positions (the two halves of D as the pairs),
  in float32; returns ``x``'s dtype."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _chunked(fn, chunks: int, *xs):
  """``fn`` over sequence chunks of ``xs`` (arrays ``(B, S, ...)``), each under
  ``jax.checkpoint`` (nothing saved inside a chunk: its backward pass recomputes it). Chunks of
  ``c = ceil(S / chunks)`` positions: returns ``(whole, rest)``, ``lax.map``'s results over the
  ``S // c`` whole chunks (stacked on a leading axis) and the remainder's (None where none)."""
  length = xs[0].shape[1]
  size = -(-length // chunks)
  n, left = divmod(length, size)
  step = jax.checkpoint(fn)

  def split(a):  # (B, S, ...) -> (n, B, c, ...)
    a = a[:, : n * size]
    return jnp.moveaxis(a.reshape(a.shape[0], n, size, *a.shape[2:]), 1, 0)

  whole = jax.lax.map(lambda c: step(*c), tuple(split(a) for a in xs))
  rest = step(*(a[:, n * size :] for a in xs)) if left else None
  return whole, rest


def _unsplit(a):  # (n, B, c, ...) -> (B, n * c, ...)
  a = jnp.moveaxis(a, 0, 1)
  return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def swiglu(x, w_up, w_down, dtype):
  """The SwiGLU MLP of ``x`` ``(B, S, H)``: ``w_up`` ``(H, 2, F)`` (gate, up), ``w_down``
  ``(F, H)``, computed in ``dtype``; tags the fused projection ``(B, S, 2, F)`` ``mlp_up``."""
  h = jnp.einsum("bsh,hgf->bsgf", x.astype(dtype), w_up.astype(dtype))
  h = checkpoint_name(constrain_batch(h), MLP_UP)
  return jnp.einsum("bsf,fh->bsh", nn.silu(h[:, :, 0]) * h[:, :, 1], w_down.astype(dtype))


def chunked_swiglu(x, w_up, w_down, dtype, chunks: int = 1):
  """:func:`swiglu` over ``chunks`` sequence chunks, each under ``jax.checkpoint`` (1: whole)."""
  if chunks == 1:
    return swiglu(x, w_up, w_down, dtype)
  whole, rest = _chunked(lambda xc: swiglu(xc, w_up, w_down, dtype), chunks, x)
  whole = _unsplit(whole)
  return whole if rest is None else jnp.concatenate([whole, rest], axis=1)


def token_losses_sum(x, kernel, targets, dtype):
  """The sum over ``(B, S)`` of ``logsumexp(logits) - logits[target]``, the logits ``x @ kernel``
  (``x`` ``(B, S, H)`` and ``kernel`` ``(H, V)`` in ``dtype``, float32 products)."""
  logits = jnp.einsum(
    "bsh,hv->bsv", x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32
  )
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return (jax.nn.logsumexp(logits, axis=-1) - target).sum()


def chunked_cross_entropy(x, kernel, targets, dtype, chunks: int = 1):
  """Mean next-token cross entropy of the head ``kernel`` ``(H, V)`` over ``x`` ``(B, S, H)``
  with int ``targets`` ``(B, S)``; with ``chunks`` > 1 the logits of one sequence chunk at a
  time, each under ``jax.checkpoint`` (the backward pass recomputes a chunk's logits): never the
  whole ``[B, S, V]``. Returns ``(loss, number of tokens)``."""
  n = targets.size
  if chunks == 1:
    total = token_losses_sum(x, kernel, targets, dtype)
  else:
    fn = lambda xc, tc: token_losses_sum(xc, kernel, tc, dtype)  # noqa: E731
    whole, rest = _chunked(fn, chunks, x, targets)
    total = whole.sum() if rest is None else whole.sum() + rest
  return total / n, jnp.asarray(n, jnp.float32)


# ----------------------------------------------------------------------------- modules
def _param_dtype(cfg: ModelConfig):
  return jnp.dtype(cfg.param_dtype)


def RMSNorm(cfg: ModelConfig, name: str) -> nn.Module:
  return nn.RMSNorm(
    epsilon=RMS_EPS, dtype=cfg.compute_dtype, param_dtype=_param_dtype(cfg), name=name
  )


def _dense(cfg: ModelConfig, features, axis=-1, name=None):
  return nn.DenseGeneral(
    features,
    axis=axis,
    use_bias=False,
    dtype=cfg.compute_dtype,
    param_dtype=_param_dtype(cfg),
    kernel_init=_INIT,
    name=name,
  )


class _Kernel(nn.Module):
  """A bare weight ``kernel`` (used where a function of it runs in sequence chunks)."""

  shape: tuple[int, ...]
  dtype: Any

  @nn.compact
  def __call__(self):
    return self.param("kernel", _INIT, self.shape, self.dtype)


class LlamaAttention(nn.Module):
  """Causal grouped-query self attention with rotary positions."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):  # (B,S,H) -> (B,S,H)
    cfg, n, k, d = self.cfg, self.cfg.num_heads, self.cfg.kv_heads, self.cfg.head_dim
    qkv = checkpoint_name(constrain_batch(_dense(cfg, (n + 2 * k, d), name="qkv")(x)), QKV)
    q, key, value = qkv[:, :, :n], qkv[:, :, n : n + k], qkv[:, :, n + k :]  # (B,S,N|K|K,D)
    cos, sin = rotary_tables(x.shape[1], d, cfg.rope_theta)
    q, key = apply_rotary(q, cos, sin), apply_rotary(key, cos, sin)
    # K key/value heads as they are: query head i attends with key/value head i // (N // K)
    out = jax.nn.dot_product_attention(
      q, key, value, is_causal=True, implementation=cfg.attention_impl()
    )
    out = checkpoint_name(constrain_batch(out), ATTN)  # (B,S,N,D)
    return _dense(cfg, cfg.hidden, axis=(-2, -1), name="out")(out)


class LlamaMlp(nn.Module):
  """SwiGLU in ``mlp_chunks`` sequence chunks (:func:`chunked_swiglu`)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg, dt = self.cfg, _param_dtype(self.cfg)
    w_up = _Kernel((cfg.hidden, 2, cfg.mlp_dim), dt, name="up")()
    w_down = _Kernel((cfg.mlp_dim, cfg.hidden), dt, name="down")()
    return chunked_swiglu(x, w_up, w_down, cfg.compute_dtype, cfg.mlp_chunks)


class LlamaBlock(nn.Module):
  """Pre-norm Llama block; ``(x) -> (x, None)`` like ``models.common.Block`` (for nn.scan)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    x = checkpoint_name(constrain_batch(x), LAYER_IN)
    x = constrain_batch(x + LlamaAttention(self.cfg, name="attn")(RMSNorm(self.cfg, "ln_attn")(x)))
    x = constrain_batch(x + LlamaMlp(self.cfg, name="mlp")(RMSNorm(self.cfg, "ln_mlp")(x)))
    return x, None


class LlamaStack(nn.Module):
  """``num_layers`` blocks as ``nn.scan(nn.remat(LlamaBlock))`` (remat only with a policy), then
  the final norm; a :class:`models.common.SplitPolicy` applies the stacked parameters by two
  scans, one per policy, as ``models.common.Stack`` does."""

  cfg: ModelConfig
  policy: Any = None

  @nn.compact
  def __call__(self, x):
    policy, L = self.policy, self.cfg.num_layers
    if isinstance(policy, SplitPolicy):
      if policy.split > L:
        raise ValueError(f"split: {policy.split} layers > num_layers {L}")
      if 0 < policy.split < L and not self.is_initializing():
        import jax_ssdtrain as ssd

        block = LlamaBlock(self.cfg)
        x = ssd.split_scan(
          lambda p, h: block.apply({"params": p}, h)[0],
          self.variables["params"]["layers"],
          x,
          split=policy.split,
          policies=(policy.first, policy.rest),
        )
        return RMSNorm(self.cfg, "ln_final")(x)
      policy = policy.rest if policy.split == 0 else policy.first
    block = LlamaBlock if policy is None else nn.remat(LlamaBlock, policy=policy, prevent_cse=False)
    layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
    x, _ = layers(self.cfg, name="layers")(x)
    return RMSNorm(self.cfg, "ln_final")(x)


class LlamaEmbedding(nn.Module):
  """The token embedding ``embedding`` ``(V, H)``, looked up in the compute dtype."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, ids):  # (B,S) int -> (B,S,H)
    cfg = self.cfg
    table = self.param("embedding", _INIT, (cfg.vocab_size, cfg.hidden), _param_dtype(cfg))
    # the table in the compute dtype, gathered once under FSDP (as models.common.Embedding)
    table = gather_weight(table.astype(cfg.compute_dtype))
    return constrain_batch(jnp.take(table, ids, axis=0))


class LlamaHead(nn.Module):
  """The untied head ``kernel`` ``(H, V)``: all the float32 logits of ``x`` (short inputs), or
  with ``targets`` the mean cross entropy in ``loss_chunks`` chunks, ``(loss, tokens)``."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, targets=None):
    cfg = self.cfg
    kernel = self.param("kernel", _INIT, (cfg.hidden, cfg.vocab_size), _param_dtype(cfg))
    kernel = gather_weight(kernel)
    if targets is not None:
      return chunked_cross_entropy(x, kernel, targets, cfg.compute_dtype, cfg.loss_chunks)
    w = kernel.astype(cfg.compute_dtype)
    x = x.astype(cfg.compute_dtype)
    return jnp.einsum("bsh,hv->bsv", x, w, preferred_element_type=jnp.float32)


class Llama(nn.Module):
  """Llama-style causal LM (see the module doc); ``loss(tokens, rng) -> (loss, metrics)``."""

  cfg: ModelConfig
  policy: Any = None  # jax.checkpoint policy for each block; None = no remat

  def setup(self):
    cfg = self.cfg
    if cfg.positions != "rope" or cfg.tie_embeddings:
      raise ValueError(
        f"Llama: rotary positions and an untied head, got positions={cfg.positions!r}, "
        f"tie_embeddings={cfg.tie_embeddings}; use get_config('llama', preset)"
      )
    self.embed = LlamaEmbedding(cfg)
    self.decoder = LlamaStack(cfg, self.policy)
    self.head = LlamaHead(cfg)

  def __call__(self, tokens):  # (B,S) int -> (B,S,V) float32 logits (all of them: short inputs)
    return self.head(self.decoder(self.embed(tokens)))

  def loss(self, tokens, rng=None):
    """Next-token prediction on a (B,S) batch in ``loss_chunks`` chunks; (loss, metrics)."""
    loss, n = self.head(self.decoder(self.embed(tokens[:, :-1])), tokens[:, 1:])
    return loss, {"loss": loss, "tokens": n}


def parameter_count(cfg: ModelConfig) -> int:
  """The parameters of ``Llama(cfg)``: per layer ``H (N + 2K) D + N D H + 3 H F + 2 H``, the
  embedding and the head ``2 V H``, the final norm ``H``."""
  H, N, K, D, F = cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
  per_layer = H * (N + 2 * K) * D + N * D * H + 3 * H * F + 2 * H
  return cfg.num_layers * per_layer + 2 * cfg.vocab_size * H + H


__all__ = [
  "Llama",
  "LlamaAttention",
  "LlamaBlock",
  "LlamaEmbedding",
  "LlamaHead",
  "LlamaMlp",
  "LlamaStack",
  "apply_rotary",
  "chunked_cross_entropy",
  "chunked_swiglu",
  "parameter_count",
  "rotary_tables",
  "swiglu",
  "token_losses_sum",
]
