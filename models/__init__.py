"""Flax transformer models (GPT, BERT, T5, Llama) with activation tags for jax_ssdtrain policies."""

from .bert import BERT
from .common import (
  ATTN,
  CROSS_KV,
  CROSS_Q,
  LAYER_IN,
  LOCATIONS,
  MLP_UP,
  PRESETS,
  QKV,
  REMAT_SHORTCUTS,
  TAGS,
  ModelConfig,
  SplitPolicy,
  get_config,
  make_remat_policy,
  parse_locations,
  resolve_locations,
)
from .gpt import GPT
from .llama import Llama
from .t5 import T5

MODELS = {"gpt": GPT, "bert": BERT, "t5": T5, "llama": Llama}
# The tags each model has (only T5's decoder has cross attention).
MODEL_TAGS = {
  "gpt": (LAYER_IN, QKV, ATTN, MLP_UP),
  "bert": (LAYER_IN, QKV, ATTN, MLP_UP),
  "t5": TAGS,
  "llama": (LAYER_IN, QKV, ATTN, MLP_UP),
}


def build_model(name: str, cfg: ModelConfig, policy=None):
  """``MODELS[name](cfg, policy)``; every model has ``loss(tokens, rng) -> (loss, metrics)``."""
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")
  return MODELS[name](cfg, policy)
