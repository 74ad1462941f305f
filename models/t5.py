"""T5-style encoder-decoder: RMSNorm, shared relative-position bias per stack (or learned
positions), decoder blocks with cross attention. Trained as a denoiser: the encoder sees the
BERT-noised sequence, the decoder reconstructs the clean one with teacher forcing."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .common import Embedding, LMHead, ModelConfig, RelativeBias, Stack, cross_entropy, mlm_noise


class T5(nn.Module):
  cfg: ModelConfig
  policy: Any = None

  def setup(self):
    relative = self.cfg.positions == "relative"
    self.embed = Embedding(self.cfg)  # shared by encoder, decoder and (tied) output
    self.enc_bias = RelativeBias(self.cfg, bidirectional=True) if relative else None
    self.dec_bias = RelativeBias(self.cfg, bidirectional=False) if relative else None
    self.encoder = Stack(self.cfg, self.policy)
    self.decoder = Stack(self.cfg, self.policy, causal=True, cross=True)
    self.head = LMHead(self.cfg)

  def __call__(self, enc_tokens, dec_tokens):  # (B,S), (B,T) -> (B,T,V) float32 logits
    s, t = enc_tokens.shape[1], dec_tokens.shape[1]
    enc_bias = self.enc_bias(s, s) if self.enc_bias is not None else None  # (1,N,S,S)
    dec_bias = self.dec_bias(t, t) if self.dec_bias is not None else None  # (1,N,T,T)
    enc = self.encoder(self.embed(enc_tokens), bias=enc_bias)
    dec = self.decoder(self.embed(dec_tokens), enc, dec_bias)
    return self.head(dec, self.embed)

  def loss(self, tokens, rng):
    """Denoising loss on a (B,S) batch; decoder input = targets shifted right (BOS id 0)."""
    noised, _ = mlm_noise(tokens, rng, self.cfg.vocab_size)
    dec_in = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))  # (B,S): [0, t0, ..., t_{S-2}]
    loss, n = cross_entropy(self(noised, dec_in), tokens)
    return loss, {"loss": loss, "tokens": n}
