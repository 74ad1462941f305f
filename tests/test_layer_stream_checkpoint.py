"""Checkpoints of streamed layer stacks (jax_ssdtrain.checkpointing with
jax_ssdtrain._src.layer_stream's StreamedStack and StreamedOptState)."""

import jax
import jax.numpy as jnp
import pytest

import jax_ssdtrain as ssd
from jax_ssdtrain import checkpointing

MiB = 1 << 20
D = 8


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=128 * MiB, host_tier_bytes=32 * MiB):
    yield


def _init_layer(key):
  k1, k2 = jax.random.split(key)
  return {"w": jax.random.normal(k1, (D, D)), "b": jax.random.normal(k2, (D,)).astype(jnp.bfloat16)}


def test_a_stack_in_the_store_is_refused(store):
  stack = ssd.init_streamed(_init_layer, jax.random.key(0), 3, location="host")
  for fn in (checkpointing.save_args, checkpointing.restore_args):
    with pytest.raises(TypeError, match=r"StreamedStack\(params, 3 layers.*stack_to_tree"):
      fn({"stack": stack, "step": 1})
