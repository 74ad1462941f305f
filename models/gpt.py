"""GPT: decoder-only causal LM with learned positions and tied or untied embeddings."""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from .common import Embedding, LMHead, ModelConfig, Stack, cross_entropy


class GPT(nn.Module):
  cfg: ModelConfig
  policy: Any = None  # jax.checkpoint policy for each block; None = no remat

  def setup(self):
    self.embed = Embedding(self.cfg)
    self.decoder = Stack(self.cfg, self.policy, causal=True)
    self.head = LMHead(self.cfg)

  def __call__(self, tokens):  # (B,S) int -> (B,S,V) float32 logits
    return self.head(self.decoder(self.embed(tokens)), self.embed)

  def loss(self, tokens, rng=None):
    """Next-token prediction on a (B,S) batch; returns (loss, metrics)."""
    logits = self(tokens[:, :-1])
    loss, n = cross_entropy(logits, tokens[:, 1:])
    return loss, {"loss": loss, "tokens": n}
