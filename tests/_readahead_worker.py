"""Subprocess of tests/test_readahead.py: a tensor-parallel program on 4 CPU devices (the XLA
flag must be set before JAX starts) run under every host cache and read-ahead size of the sweep.
Prints one JSON object: the sweep's statistics and each run's largest gradient difference from
the same sharded program saving on the device."""

import json
import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from test_readahead import error, sweep  # noqa: E402

import jax_ssdtrain as ssd  # noqa: E402

L, B, H, F = 6, 64, 256, 1024
TAGS = ("up", "out")
# Per device and layer: "up" (B/2, F/2) and "out" (B/2, H) float32 = 64 + 32 KiB.
TENSOR, STEP = 32 << 10, 4 * L * (96 << 10)


def layer(w, x):  # Megatron MLP: w1 split by columns, w2 by rows over "model"
  up = checkpoint_name(jnp.tanh(x @ w["w1"]), "up")
  out = checkpoint_name(jnp.sin(up @ w["w2"]), "out")
  return x + out


def loss(policy, w, x):
  f = jax.checkpoint(layer, policy=policy)
  y, _ = jax.lax.scan(lambda c, wi: (f(wi, c), None), x, w)
  return jnp.sum(y**2)


def main():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))  # auto axes
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  w = {
    "w1": jax.device_put(
      jax.random.normal(k1, (L, H, F)) / 16, NamedSharding(mesh, P(None, None, "model"))
    ),
    "w2": jax.device_put(
      jax.random.normal(k2, (L, F, H)) / 32, NamedSharding(mesh, P(None, "model", None))
    ),
  }
  x = jax.device_put(jax.random.normal(k3, (B, H)), NamedSharding(mesh, P("data", None)))

  def step(policy):
    return jax.jit(jax.grad(lambda w, x: loss(policy, w, x)))

  want = step(jax.checkpoint_policies.save_only_these_names(*TAGS))(w, x)
  ours = step(ssd.offload_policy(TAGS, min_bytes=0))
  print(json.dumps(sweep(lambda: error(ours(w, x), want), os.environ["SSD_RA_DIR"], TENSOR, STEP)))


if __name__ == "__main__":
  main()
