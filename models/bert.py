"""BERT: bidirectional encoder with a masked-LM head (tied decoder + output bias)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .common import Embedding, ModelConfig, Norm, Stack, cross_entropy, mlm_noise


class BERT(nn.Module):
  cfg: ModelConfig
  policy: Any = None

  def setup(self):
    self.embed = Embedding(self.cfg)
    self.encoder = Stack(self.cfg, self.policy)
    self.transform = nn.Dense(self.cfg.hidden, dtype=self.cfg.compute_dtype)
    self.ln_head = Norm(self.cfg)
    self.head = (
      nn.DenseGeneral(self.cfg.vocab_size, dtype=self.cfg.compute_dtype)
      if not self.cfg.tie_embeddings
      else None
    )
    self.out_bias = self.param("out_bias", nn.initializers.zeros, (self.cfg.vocab_size,))

  def __call__(self, tokens):  # (B,S) -> (B,S,V) float32 MLM logits
    h = self.ln_head(nn.gelu(self.transform(self.encoder(self.embed(tokens)))))
    logits = self.embed.attend(h) if self.head is None else self.head(h)
    return logits.astype(jnp.float32) + self.out_bias

  def loss(self, tokens, rng):
    """Masked-LM loss over the noised positions of a (B,S) batch."""
    inputs, weights = mlm_noise(tokens, rng, self.cfg.vocab_size)
    loss, n = cross_entropy(self(inputs), tokens, weights)
    return loss, {"loss": loss, "tokens": n}
