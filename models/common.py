"""Shared transformer pieces, configs, activation tags and the remat policy factory.

Activation tags
---------------
Every block tags the tensors that the backward pass consumes with
``jax.ad_checkpoint.checkpoint_name``. A policy maps each tag to a *location*:

============  ============================  =================  ===========================
tag           tensor (per layer)            shape              models
============  ============================  =================  ===========================
``layer_in``  block input (scan carry)      (B, S, H)          gpt, bert, t5 enc+dec
``qkv``       fused q/k/v projection        (B, S, 3, N, D)    gpt, bert, t5 enc+dec
``attn``      attention output, before the  (B, S, N, D)       gpt, bert, t5 enc+dec
              out-projection (self *and*                       (t5 decoder: twice)
              cross attention)
``mlp_up``    MLP up-projection matmul      (B, S, F)          gpt, bert, t5 enc+dec
              output (before the GELU)
``cross_q``   cross-attention query proj.   (B, T, N, D)       t5 decoder
``cross_kv``  cross-attention k/v proj. of  (B, S, 2, N, D)    t5 decoder
              the encoder output
============  ============================  =================  ===========================

B batch, S/T sequence, H hidden, N heads, D head dim, F MLP dim.

The Llama model (``models/llama.py``) has the first four tags with its own shapes: ``qkv`` is
(B, S, N + 2K, D) with K key/value heads, ``mlp_up`` the fused gate and up projections
(B, c, 2, F) of one sequence chunk of c positions (its MLP runs in ``mlp_chunks`` chunks).

Locations: ``remat`` (recompute in backward), ``device`` (saved in device memory), ``host``
(the engine's pinned host tier), ``nvme`` (the store file). :func:`make_remat_policy` is the
only place that builds a policy from a locations mapping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .parallel import constrain_batch, gather_weight  # batch-split activations under a mesh

# ----------------------------------------------------------------------------- tags
LAYER_IN = "layer_in"
QKV = "qkv"
ATTN = "attn"
MLP_UP = "mlp_up"
CROSS_Q = "cross_q"
CROSS_KV = "cross_kv"
TAGS = (LAYER_IN, QKV, ATTN, MLP_UP, CROSS_Q, CROSS_KV)
LOCATIONS = ("remat", "device", "host", "nvme")
# Shortcuts for --remat-policy: None = no remat at all ("keep").
REMAT_SHORTCUTS: dict[str, dict[str, str] | None] = {
  "keep": None,
  "remat": {LAYER_IN: "device"},  # full recompute from the layer input
  "offload": {t: "nvme" for t in TAGS},
}


def parse_locations(spec: str | Mapping[str, str] | None) -> dict[str, str]:
  """``"qkv=nvme,attn=host"`` (or a mapping) -> validated ``{tag: location}``."""
  if spec is None:
    return {}
  if isinstance(spec, str):
    items = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
      name, sep, loc = part.partition("=")
      if not sep:
        raise ValueError(f"bad location entry {part!r}: expected TAG=LOCATION")
      items[name.strip()] = loc.strip()
    spec = items
  for name, loc in spec.items():
    if name not in TAGS:
      raise ValueError(f"unknown tag {name!r}; known tags: {', '.join(TAGS)}")
    if loc not in LOCATIONS:
      raise ValueError(f"unknown location {loc!r} for {name!r}; use one of {', '.join(LOCATIONS)}")
  return dict(spec)


def resolve_locations(remat_policy: str | None, locations: str | Mapping[str, str] | None):
  """Combine a ``--remat-policy`` shortcut with ``--locations`` overrides.

  Returns None for "keep" without overrides (no remat), else a ``{tag: location}`` mapping
  (tags not listed are recomputed).
  """
  if remat_policy is not None and remat_policy not in REMAT_SHORTCUTS:
    raise ValueError(
      f"unknown remat policy {remat_policy!r}; use one of {', '.join(REMAT_SHORTCUTS)}"
    )
  overrides = parse_locations(locations)
  base = REMAT_SHORTCUTS[remat_policy] if remat_policy else ({} if overrides else None)
  if base is None and not overrides:
    return None
  if base is None:  # "keep" + overrides: everything else stays on device
    base = {t: "device" for t in TAGS}
  return {**base, **overrides}


def make_remat_policy(locations: Mapping[str, str] | None, min_bytes: int = 1 << 20):
  """The single place where a locations mapping becomes a jax.checkpoint policy."""
  if locations is None:
    return None
  import jax_ssdtrain as ssd

  return ssd.location_policy(dict(locations), min_bytes=min_bytes, default="remat")


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  num_layers: int  # per stack (t5: encoder and decoder each)
  hidden: int
  num_heads: int
  mlp_dim: int
  max_len: int  # learned positions / default sequence length
  dtype: str = "bfloat16"  # compute dtype; params are float32
  norm: str = "layernorm"  # or "rmsnorm"
  tie_embeddings: bool = True
  positions: str = "learned"  # or "relative" (t5 bucketed relative bias)
  rel_buckets: int = 32
  rel_max_distance: int = 128
  # jax.nn.dot_product_attention implementation: "xla", "cudnn" or "auto" (cudnn on GPU for
  # bf16/fp16 with a supported head dim, else xla; JAX's own None always means xla).
  attention: str = "auto"
  # Llama only (models/llama.py); the defaults leave the other models as they are.
  num_kv_heads: int | None = None  # grouped-query attention's key/value heads (None: num_heads)
  rope_theta: float = 500000.0  # rotary positions' base (positions="rope"), Llama 3's
  mlp_chunks: int = 1  # the MLP over the sequence in this many chunks under remat (1: whole)
  loss_chunks: int = 1  # the logits and loss in this many sequence chunks under remat
  param_dtype: str = "float32"  # the parameters' dtype

  @property
  def head_dim(self) -> int:
    return self.hidden // self.num_heads

  @property
  def kv_heads(self) -> int:
    """Key/value heads: ``num_kv_heads``, or ``num_heads`` where it is None."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def __post_init__(self):
    if self.hidden % self.num_heads:
      raise ValueError(f"hidden {self.hidden} not divisible by num_heads {self.num_heads}")
    if self.norm not in ("layernorm", "rmsnorm") or self.positions not in _POSITIONS:
      raise ValueError(f"bad norm/positions: {self.norm!r}/{self.positions!r}")
    if self.attention not in ("auto", "xla", "cudnn"):
      raise ValueError(f"bad attention implementation {self.attention!r}: use auto, xla or cudnn")
    kv = self.num_kv_heads
    if kv is not None and (
      isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.num_heads % kv
    ):
      raise ValueError(
        f"num_kv_heads: {kv!r} does not divide num_heads {self.num_heads}; grouped-query "
        "attention needs a positive divisor of num_heads (None: one per query head)"
      )
    for name in ("mlp_chunks", "loss_chunks"):
      n = getattr(self, name)
      if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: expected a positive number of sequence chunks, got {n!r}")
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta: expected a positive base, got {self.rope_theta!r}")
    if self.param_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"param_dtype: {self.param_dtype!r}; use float32 or bfloat16")

  def attention_impl(self) -> str:
    if self.attention != "auto":
      return self.attention
    cudnn_ok = (
      jax.default_backend() == "gpu"
      and self.compute_dtype in (jnp.bfloat16, jnp.float16)
      and self.head_dim % 8 == 0
      and self.head_dim <= 128
    )
    return "cudnn" if cudnn_ok else "xla"


# "learned": a table of max_len positions (gpt, bert); "relative": t5's bucketed bias; "rope":
# rotary positions computed for any length (llama).
_POSITIONS = ("learned", "relative", "rope")

# (layers, hidden, heads, max_len); mlp_dim = 4 * hidden.
_SHAPES = {
  "tiny": (2, 64, 4, 32),
  "small": (12, 768, 12, 1024),  # GPT-2 124M
  "medium": (24, 1024, 16, 1024),  # GPT-2 350M
  "large": (36, 1280, 20, 1024),  # GPT-2 774M
  "xl": (48, 1600, 25, 1024),  # GPT-2 1.5B
  "gpt-1.3b": (24, 2048, 16, 2048),
  # Larger GPTs of the same structure (GPT-3's 2.7B and 6.7B shapes; 4B and 8B between and past).
  "gpt-2.7b": (32, 2560, 32, 2048),
  "gpt-4b": (36, 3072, 24, 2048),
  "gpt-6.7b": (32, 4096, 32, 2048),
  "gpt-8b": (40, 4096, 32, 2048),
  # Past one GPU's memory (their parameters and gradients streamed from the store), heads of
  # 128. Parameters with the tied embedding and 2048 learned positions (12 x hidden^2 + 13 x
  # hidden per layer, 52352 x hidden + 2 x hidden besides; 50304 x hidden more with an untied
  # head, as scripts/bench_layer_stream.py trains): 13B 12.85B (OPT-13B's shape), 20B 20.26B
  # (GPT-NeoX-20B's width and depth), 30B 29.97B (OPT-30B's), 34B 34.26B (66B-class width 8192,
  # 42 layers).
  "gpt-13b": (40, 5120, 40, 2048),
  "gpt-20b": (44, 6144, 48, 2048),
  "gpt-30b": (48, 7168, 56, 2048),
  "gpt-34b": (42, 8192, 64, 2048),
  # SSDTrain evaluation shapes (few layers, very wide, head dim 128).
  "ssdtrain-h8192": (4, 8192, 64, 1024),
  "ssdtrain-h12288": (3, 12288, 96, 1024),
  "ssdtrain-h16384": (2, 16384, 128, 1024),
}
# Llama 3's shapes: (layers, hidden, heads, key/value heads, mlp_dim, max_len); max_len is the
# default sequence length only (rotary positions have no cap). Another model at such a preset
# gets its layers, hidden, heads and mlp_dim (and one key/value head per query head).
_LLAMA_SHAPES = {
  "llama3-1b": (16, 2048, 32, 8, 8192, 8192),
  "llama3-3b": (28, 3072, 24, 8, 8192, 8192),
  "llama3-8b": (32, 4096, 32, 8, 14336, 8192),
}
PRESETS = tuple(_SHAPES) + tuple(_LLAMA_SHAPES)
# The config fields only models/llama.py reads.
_LLAMA_FIELDS = ("num_kv_heads", "rope_theta", "mlp_chunks", "loss_chunks", "param_dtype")
# Per-model defaults (vocab sizes padded to multiples of 64; Llama 3's is 128256 = 2004 x 64).
_MODEL_DEFAULTS = {
  "gpt": dict(vocab_size=50304),
  "bert": dict(vocab_size=30528),
  "t5": dict(vocab_size=32128, norm="rmsnorm", positions="relative"),
  "llama": dict(vocab_size=128256, norm="rmsnorm", positions="rope", tie_embeddings=False),
}


def get_config(model: str, preset: str, **overrides: Any) -> ModelConfig:
  if model not in _MODEL_DEFAULTS:
    raise ValueError(f"unknown model {model!r}; use one of {', '.join(_MODEL_DEFAULTS)}")
  if preset in _LLAMA_SHAPES:
    layers, hidden, heads, kv_heads, mlp_dim, max_len = _LLAMA_SHAPES[preset]
  elif preset in _SHAPES:
    (layers, hidden, heads, max_len), kv_heads = _SHAPES[preset], None
    mlp_dim = 4 * hidden
  else:
    raise ValueError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
  kw = dict(
    num_layers=layers,
    hidden=hidden,
    num_heads=heads,
    mlp_dim=mlp_dim,
    max_len=max_len,
    **_MODEL_DEFAULTS[model],
  )
  if model == "llama":  # grouped-query attention (the tiny preset: 2 key/value heads for 4)
    kw["num_kv_heads"] = 2 if preset == "tiny" else kv_heads
  if preset == "tiny":
    kw["vocab_size"] = 256
  given = sorted(set(overrides) & set(_LLAMA_FIELDS)) if model != "llama" else []
  if given or (model != "llama" and overrides.get("positions") == "rope"):
    what = ", ".join(f"{k}={overrides[k]!r}" for k in given) or "positions='rope'"
    raise ValueError(
      f"get_config: {what} for model {model!r}: only the llama model has "
      f"{', '.join(_LLAMA_FIELDS)} and rotary positions; use get_config('llama', ...)"
    )
  kw.update(overrides)
  return ModelConfig(**kw)


# ----------------------------------------------------------------------------- layers
def Norm(cfg: ModelConfig, name: str | None = None) -> nn.Module:
  cls = nn.RMSNorm if cfg.norm == "rmsnorm" else nn.LayerNorm
  return cls(dtype=cfg.compute_dtype, name=name)


def _dense(cfg, features, axis=-1, name=None):
  return nn.DenseGeneral(
    features,
    axis=axis,
    dtype=cfg.compute_dtype,
    name=name,
    kernel_init=nn.initializers.normal(0.02),
  )


class Attention(nn.Module):
  """Self attention (``kv=None``) or cross attention over ``kv``."""

  cfg: ModelConfig
  causal: bool = False

  @nn.compact
  def __call__(self, x, kv=None, bias=None):
    cfg, n, d = self.cfg, self.cfg.num_heads, self.cfg.head_dim
    if kv is None:
      qkv = checkpoint_name(
        constrain_batch(_dense(cfg, (3, n, d), name="qkv")(x)), QKV
      )  # (B,S,3,N,D)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each (B,S,N,D)
    else:
      q = checkpoint_name(_dense(cfg, (n, d), name="q")(x), CROSS_Q)  # (B,T,N,D)
      kv = checkpoint_name(_dense(cfg, (2, n, d), name="kv")(kv), CROSS_KV)  # (B,S,2,N,D)
      k, v = kv[:, :, 0], kv[:, :, 1]
    if bias is not None:
      bias = bias.astype(q.dtype)  # (1,N,T,S)
    out = jax.nn.dot_product_attention(
      q, k, v, bias=bias, is_causal=self.causal, implementation=cfg.attention_impl()
    )
    out = checkpoint_name(constrain_batch(out), ATTN)  # (B,T,N,D)
    return _dense(cfg, cfg.hidden, axis=(-2, -1), name="out")(out)  # (B,T,H)


class Mlp(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    h = checkpoint_name(constrain_batch(_dense(self.cfg, self.cfg.mlp_dim, name="up")(x)), MLP_UP)
    return _dense(self.cfg, self.cfg.hidden, name="down")(nn.gelu(h))


class Block(nn.Module):
  """Pre-norm transformer block; with ``cross`` a decoder block attending to ``enc``."""

  cfg: ModelConfig
  causal: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, enc=None, bias=None):
    x = checkpoint_name(constrain_batch(x), LAYER_IN)
    x = constrain_batch(
      x + Attention(self.cfg, self.causal, name="attn")(Norm(self.cfg, "ln_attn")(x), bias=bias)
    )
    if self.cross:
      x = constrain_batch(
        x + Attention(self.cfg, name="cross")(Norm(self.cfg, "ln_cross")(x), kv=enc)
      )
    x = constrain_batch(x + Mlp(self.cfg, name="mlp")(Norm(self.cfg, "ln_mlp")(x)))
    return x, None  # (carry, per-layer output) for nn.scan


@dataclasses.dataclass(frozen=True)
class SplitPolicy:
  """The first ``split`` layers of a stack use ``first``, the others ``rest`` (jax.checkpoint
  policies; None: no remat). The parameter layout does not depend on the split."""

  first: Any
  rest: Any
  split: int

  def __post_init__(self):
    if isinstance(self.split, bool) or not isinstance(self.split, int) or self.split < 0:
      raise ValueError(f"split: expected an integer >= 0, got {self.split!r}")


class Stack(nn.Module):
  """``num_layers`` blocks as ``nn.scan(nn.remat(Block))`` (remat only with a policy) + final norm.

  With a :class:`SplitPolicy`, the stacked ``layers`` parameters are applied by two scans, one
  per policy (same parameters, same layout). Gradients equal the single scan's, except that
  a cross-attending stack sums the encoder output's cotangent in two parts (bf16 rounding)."""

  cfg: ModelConfig
  policy: Any = None
  causal: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, enc=None, bias=None):
    policy, L = self.policy, self.cfg.num_layers
    if isinstance(policy, SplitPolicy):
      if policy.split > L:
        raise ValueError(f"split: {policy.split} layers > num_layers {L}")
      if 0 < policy.split < L and not self.is_initializing():
        x = self._split_layers(policy, x, enc, bias)
        return Norm(self.cfg, "ln_final")(x)
      policy = policy.rest if policy.split == 0 else policy.first  # one segment, or init
    block = Block if policy is None else nn.remat(Block, policy=policy, prevent_cse=False)
    layers = nn.scan(
      block,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, nn.broadcast),
      length=L,
    )
    x, _ = layers(self.cfg, self.causal, self.cross, name="layers")(x, enc, bias)
    return Norm(self.cfg, "ln_final")(x)

  def _split_layers(self, policy: SplitPolicy, x, enc, bias):
    import jax_ssdtrain as ssd  # here: importing models checks no store setting (scripts/train)

    params = self.variables["params"]["layers"]  # every leaf (L, ...)
    block = Block(self.cfg, self.causal, self.cross)
    return ssd.split_scan(
      lambda p, h: block.apply({"params": p}, h, enc, bias)[0],
      params,
      x,
      split=policy.split,
      policies=(policy.first, policy.rest),
    )


class Embedding(nn.Module):
  """Token embedding (+ learned positions); ``attend`` gives logits with the tied table."""

  cfg: ModelConfig

  def setup(self):
    init = nn.initializers.normal(0.02)
    self.tokens = nn.Embed(
      self.cfg.vocab_size, self.cfg.hidden, dtype=self.cfg.compute_dtype, embedding_init=init
    )
    if self.cfg.positions == "learned":
      self.pos = nn.Embed(
        self.cfg.max_len, self.cfg.hidden, dtype=self.cfg.compute_dtype, embedding_init=init
      )

  def _table(self):
    # As nn.Embed: the table in the compute dtype. Under FSDP its vocab-split parameter is
    # gathered once (in bf16) for the lookup and the tied head, instead of the partitioner
    # all-reducing looked-up rows and exchanging logits.
    return gather_weight(self.tokens.embedding.astype(self.cfg.compute_dtype))

  def __call__(self, ids):  # (B,S) -> (B,S,H)
    x = jnp.take(self._table(), ids, axis=0)
    if self.cfg.positions == "learned":
      if ids.shape[1] > self.cfg.max_len:
        raise ValueError(f"sequence length {ids.shape[1]} > max_len {self.cfg.max_len}")
      x = x + self.pos(jnp.arange(ids.shape[1]))[None]
    return constrain_batch(x)

  def attend(self, x):  # (B,S,H) -> (B,S,V), as nn.Embed.attend
    return jnp.dot(x.astype(self.cfg.compute_dtype), self._table().T)


class LMHead(nn.Module):
  """Logits over the vocabulary: tied to ``embed`` or an untied dense layer. Returns float32."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, embed: Embedding):
    if self.cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(self.cfg, self.cfg.vocab_size, name="logits")(x)
    # Batch-split logits: under FSDP the (vocab-split) table is gathered, not the logits.
    return constrain_batch(logits).astype(jnp.float32)


def relative_buckets(rel, bidirectional: bool, num_buckets: int, max_distance: int):
  """T5-style bucketing of relative positions ``rel = key - query`` (int array)."""
  out = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    out = jnp.where(rel > 0, num_buckets, 0)
    rel = jnp.abs(rel)
  else:
    rel = jnp.maximum(-rel, 0)
  exact = num_buckets // 2
  log_part = (
    jnp.log(jnp.maximum(rel, 1) / exact) / math.log(max_distance / exact) * (num_buckets - exact)
  )
  large = jnp.minimum(exact + log_part.astype(rel.dtype), num_buckets - 1)
  return out + jnp.where(rel < exact, rel, large)


class RelativeBias(nn.Module):
  """Attention bias (1, N, T, S) from bucketed relative positions, shared by all layers."""

  cfg: ModelConfig
  bidirectional: bool = True

  @nn.compact
  def __call__(self, q_len: int, k_len: int):
    rel = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]  # (T,S)
    buckets = relative_buckets(
      rel, self.bidirectional, self.cfg.rel_buckets, self.cfg.rel_max_distance
    )
    table = nn.Embed(self.cfg.rel_buckets, self.cfg.num_heads, dtype=self.cfg.compute_dtype)
    return jnp.transpose(table(buckets), (2, 0, 1))[None]  # (T,S,N) -> (1,N,T,S)


def cross_entropy(logits, targets, weights=None):
  """Weighted mean token cross entropy; returns (loss, number of weighted tokens)."""
  import optax

  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  weights = jnp.ones_like(losses) if weights is None else weights.astype(losses.dtype)
  denom = jnp.maximum(weights.sum(), 1.0)
  return (losses * weights).sum() / denom, denom


def mlm_noise(tokens, rng, vocab_size: int, rate: float = 0.15):
  """BERT masking: pick ``rate`` of positions; 80% -> [MASK] (id vocab-1), 10% random, 10% kept.

  Returns (noised tokens, float weights of the picked positions)."""
  k_pick, k_kind, k_rand = jax.random.split(rng, 3)
  picked = jax.random.uniform(k_pick, tokens.shape) < rate
  kind = jax.random.uniform(k_kind, tokens.shape)
  rand = jax.random.randint(k_rand, tokens.shape, 0, vocab_size, tokens.dtype)
  noised = jnp.where(kind < 0.8, vocab_size - 1, jnp.where(kind < 0.9, rand, tokens))
  return jnp.where(picked, noised, tokens), picked.astype(jnp.float32)
