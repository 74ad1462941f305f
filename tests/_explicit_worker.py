"""Subprocess of tests/test_explicit_sharding.py: 4 CPU devices, a 2x2 (data, model) mesh with
Explicit or Auto axis types. Prints one JSON object: per layout (DP, FSDP, TP), whether the
offloading program's grads equal the same program saving on the device bit for bit, their
difference from the unsharded program, and each device's stored/loaded bytes."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jax_ssdtrain as ssd  # noqa: E402

EXPLICIT = sys.argv[1] == "explicit"
AXIS = AxisType.Explicit if EXPLICIT else AxisType.Auto
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AXIS, AXIS))
B, D, LAYERS = 2, 64, 2  # one row per data shard: a local leading dim the mesh cannot split
# (w1, w2, x) specs per layout
LAYOUTS = {
  "dp": (P(), P(), P("data")),
  "fsdp": (P("data"), P(None, "data"), P("data")),
  "tp": (P(None, "model"), P("model", None), P("data")),
}


def block(w1, w2, x, explicit=EXPLICIT):
  if explicit:  # sharding is part of the types: gather FSDP weights, name the TP contraction
    w1, w2 = (
      jax.sharding.reshard(w, P()) if "data" in tuple(w.aval.sharding.spec) else w for w in (w1, w2)
    )
  h = checkpoint_name(jnp.tanh(x @ w1), "h")
  o = jnp.einsum("bd,df->bf", h, w2, out_sharding=P("data", None)) if explicit else h @ w2
  return jnp.sin(o)


def loss(policy, ws, x, explicit=EXPLICIT):
  for w1, w2 in ws:
    x = jax.checkpoint(lambda *a: block(*a, explicit=explicit), policy=policy)(w1, w2, x)
  return jnp.sum(x**2)


def grads(policy, ws, x, explicit=EXPLICIT):
  out = jax.jit(jax.grad(lambda ws, x: loss(policy, ws, x, explicit), argnums=(0, 1)))(ws, x)
  # Every device's part of the step (reading a replicated result waits for one shard only).
  jax.block_until_ready(out)
  return [np.asarray(g) for g in jax.tree.leaves(out)]


keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
ws_host = [
  (jax.random.normal(keys[2 * i], (D, D)) / 8, jax.random.normal(keys[2 * i + 1], (D, D)) / 8)
  for i in range(LAYERS)
]
x_host = jax.random.normal(keys[-1], (B, D))
unsharded = grads(jax.checkpoint_policies.save_only_these_names("h"), ws_host, x_host, False)

out = {}
use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
with use_mesh(mesh):
  for name, (s1, s2, sx) in LAYOUTS.items():
    ws = [
      (jax.device_put(a, NamedSharding(mesh, s1)), jax.device_put(b, NamedSharding(mesh, s2)))
      for a, b in ws_host
    ]
    x = jax.device_put(x_host, NamedSharding(mesh, sx))
    ssd.flush()
    ssd.reset_stats()
    ours = grads(ssd.offload_policy(["h"], min_bytes=0), ws, x)
    ssd.flush()
    per_device = ssd.device_stats()
    device = grads(jax.checkpoint_policies.save_only_these_names("h"), ws, x)
    out[name] = {
      "bitwise_vs_device_saving": all(np.array_equal(a, b) for a, b in zip(ours, device)),
      "vs_unsharded": max(float(np.max(np.abs(a - b))) for a, b in zip(ours, unsharded)),
      "bytes_written": [per_device.get(d.id, {}).get("bytes_written", 0) for d in jax.devices()],
      "bytes_read": [per_device.get(d.id, {}).get("bytes_read", 0) for d in jax.devices()],
    }
print(json.dumps(out))
