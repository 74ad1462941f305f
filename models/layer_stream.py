"""The repository's models cut for jax_ssdtrain's layer stream.

Owns the cuts that ``scripts/train.py --stream-layers`` and ``scripts/bench_layer_stream.py``
share: :func:`gpt_pieces`, the GPT of ``models`` (its ``Block``, ``Embedding`` and an untied
``LMHead`` with the final norm and the loss) cut into the functions the layer stream takes: one
layer's ``init_layer`` (bfloat16) and ``block``, and the ``embed`` and ``head`` whose parameters
(float32) stay on the device; :func:`llama_pieces`, the Llama of ``models.llama`` cut the same
way (its head with the final norm and the loss in ``loss_chunks`` sequence chunks).
``jax_ssdtrain.StreamedTrainer`` trains a cut (its ``embed``, ``block``, ``head``,
``init_layer`` and ``init_side``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import Block, Embedding, LMHead, Norm, cross_entropy, get_config


@dataclasses.dataclass(frozen=True)
class GPTPieces:
  """A GPT cut for the layer stream (see :func:`gpt_pieces`)."""

  cfg: Any  # the models.ModelConfig (untied embeddings)
  init_layer: Callable[[Any], Any]  # key -> one layer's parameters (bfloat16)
  block: Callable[[Any, Any], Any]  # (layer params, x) -> x
  init_side: Callable[[Any, Any], Any]  # (key, batch) -> (embedding params, head params)
  embed: Callable[[Any, Any], Any]  # (embedding params, batch) -> x
  head: Callable[[Any, Any, Any], Any]  # (head params, x, batch) -> the mean loss


def gpt_pieces(preset: str, num_layers: int | None = None, **overrides: Any) -> GPTPieces:
  """The GPT of ``preset`` (``num_layers``: the stack's depth, default the preset's) cut for the
  layer stream. The head is untied from the embedding (their parameters are separate trees).
  A batch is int32 tokens ``[batch, seq + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
  if num_layers is not None:
    overrides["num_layers"] = num_layers
  cfg = get_config("gpt", preset, tie_embeddings=False, **overrides)

  class Head(nn.Module):  # the final norm, the untied head and the loss
    cfg: Any

    @nn.compact
    def __call__(self, x, targets):
      logits = LMHead(self.cfg, name="head")(Norm(self.cfg, "ln_final")(x), None)
      return cross_entropy(logits, targets)[0]

  return _pieces(cfg, Block(cfg, causal=True), Embedding(cfg), Head(cfg))


def llama_pieces(preset: str, num_layers: int | None = None, **overrides: Any) -> GPTPieces:
  """The Llama of ``preset`` cut for the layer stream as :func:`gpt_pieces` cuts the GPT: its
  ``LlamaBlock``, ``LlamaEmbedding``, and a head of the final norm and ``LlamaHead``'s loss (in
  ``loss_chunks`` chunks); the same batches ``[batch, seq + 1]``."""
  from models.llama import LlamaBlock, LlamaEmbedding, LlamaHead, RMSNorm

  if num_layers is not None:
    overrides["num_layers"] = num_layers
  cfg = get_config("llama", preset, **overrides)

  class Head(nn.Module):  # the final norm, the head and the loss
    cfg: Any

    @nn.compact
    def __call__(self, x, targets):
      return LlamaHead(self.cfg, name="head")(RMSNorm(self.cfg, "ln_final")(x), targets)[0]

  return _pieces(cfg, LlamaBlock(cfg), LlamaEmbedding(cfg), Head(cfg))


def _pieces(cfg, block_mod, embed_mod, head_mod) -> GPTPieces:
  """The layer stream's functions of a block, an embedding and a head module."""

  def init_layer(key):  # bfloat16 (the float32 master copy starts from these values)
    x = jnp.zeros((1, 8, cfg.hidden), cfg.compute_dtype)
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), block_mod.init(key, x)["params"])

  def block(p, x):
    return block_mod.apply({"params": p}, x)[0]

  def embed(ep, batch):
    return embed_mod.apply({"params": ep}, batch[:, :-1])

  def head(hp, x, batch):
    return head_mod.apply({"params": hp}, x, batch[:, 1:])

  def init_side(key, batch):
    k1, k2 = jax.random.split(key)
    ep = embed_mod.init(k1, batch[:, :-1])["params"]
    x = jnp.zeros(batch[:, :-1].shape + (cfg.hidden,), cfg.compute_dtype)
    return ep, head_mod.init(k2, x, batch[:, 1:])["params"]

  return GPTPieces(cfg, init_layer, block, init_side, embed, head)
