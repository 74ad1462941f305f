"""Subprocess of tests/test_multidevice.py: 4 CPU devices (the XLA flag must be set before jax
starts, which the pytest process already did). Prints one JSON object.

For each layout (DP, FSDP, TP on the MLP) and tier (nvme, host): the grads of a tiny GPT with
every tag offloaded vs. the single-device grads and vs. the same sharded program saving on the
device; the collectives of both compiled programs; per-device bytes stored vs. the shard bytes
of each tagged activation; a shard_map program.
"""

import json
import os
import re
import tempfile

# SSD_MD_DEVICES GPUs instead (tests/test_multidevice.py's gpu tests): 2 by default there, the
# first N of the machine's. SSD_MD_CPU_DEVICES: the CPU devices to make (default N), of which
# the meshes take the first N, as on a machine with more GPUs than the test needs.
GPU = os.environ.get("SSD_MD_PLATFORM", "cpu") == "gpu"
N = int(os.environ.get("SSD_MD_DEVICES", "2" if GPU else "4"))
if not GPU:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={os.environ.get('SSD_MD_CPU_DEVICES', N)}"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jax_ssdtrain as ssd  # noqa: E402
from models import parallel  # noqa: E402
from scripts import training  # noqa: E402

TAGS = ("layer_in", "qkv", "attn", "mlp_up")
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
LAYOUTS = {
  "dp": parallel.Parallelism(data=N),
  "fsdp": parallel.Parallelism(data=N, fsdp=True),
  "tp": parallel.Parallelism(data=N // 2, model=2),
}
if GPU:  # no TF32: grads compared with the single-device run
  jax.config.update("jax_default_matmul_precision", "highest")


def collectives(hlo: str) -> dict[str, int]:
  return {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}


def run_config(locations):
  return training.RunConfig(
    preset="tiny", batch=8, seq_len=16, locations=locations, min_bytes=0, dtype="float32"
  )


def grad_fn(state):
  def grads(params, tokens):
    return jax.grad(lambda p: state.apply_fn({"params": p}, tokens, None, method="loss")[0])(params)

  return grads


def grads_of(locations, tokens, par=None):
  """(grads as numpy, compiled HLO text, per-device bytes written)."""
  state, _, _ = training.create_train_state(run_config(locations))
  fn = grad_fn(state)
  if par is None:
    jitted, args = jax.jit(fn), (state.params, tokens)
  else:
    mesh = par.mesh()
    state, shardings = training.shard_train_state(state, par, mesh)

    def sharded(params, tokens):  # as scripts.training.jit_train_step: batch-split activations
      with parallel.batch_sharded_activations(mesh):
        return fn(params, tokens)

    jitted = jax.jit(sharded, out_shardings=shardings.params)
    args = (state.params, training.shard_batch(tokens, par, mesh))
  compiled = jitted.lower(*args).compile()
  ssd.flush()
  ssd.reset_stats()
  out = jax.block_until_ready(compiled(*args))
  from jax_ssdtrain._src import native

  live_after_step = native.stats()["live_entries"]  # counted releases, before any sweep
  hlo = compiled.as_text()
  ssd.flush()
  stats = ssd.device_stats()
  stats["live_after_step"] = live_after_step
  return [np.asarray(g) for g in jax.tree.leaves(out)], hlo, stats


def max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def shard_bytes(par):
  """Bytes each device stores for one step: every tag's local shard over the layers."""
  cfg = run_config(None).model_config()
  b, s, h, f = 8 // par.data, 16, cfg.hidden, cfg.mlp_dim // par.model
  per_layer = 4 * (b * s * h + b * s * 3 * h + b * s * h + b * s * f)  # float32 tags
  return per_layer * cfg.num_layers


def shard_map_case():
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:  # older JAX
    from jax.experimental.shard_map import shard_map
  mesh = parallel.Parallelism(data=N).mesh()
  policy = ssd.offload_policy(["h"], min_bytes=0)

  def local(w, x):  # per-device loss of the local batch shard
    h = jax.ad_checkpoint.checkpoint_name(jnp.tanh(x @ w), "h")
    return jnp.sum(jnp.tanh(h @ w.T))[None]

  def loss(w, x, remat_policy):
    f = jax.checkpoint(local, policy=remat_policy)
    per = shard_map(f, mesh=mesh, in_specs=(P(), P(parallel.DATA)), out_specs=P(parallel.DATA))
    return jnp.sum(per(w, x))

  w = jnp.linspace(-1, 1, 64 * 64, dtype=jnp.float32).reshape(64, 64) / 8
  x = jax.device_put(
    jnp.linspace(-1, 1, 32 * 64, dtype=jnp.float32).reshape(32, 64),
    NamedSharding(mesh, P(parallel.DATA)),
  )
  ours = jax.jit(jax.grad(loss), static_argnums=2)
  ssd.reset_stats()
  g = np.asarray(ours(w, x, policy))
  ssd.flush()
  ref = np.asarray(
    jax.jit(jax.grad(loss), static_argnums=2)(
      w, x, jax.checkpoint_policies.save_only_these_names("h")
    )
  )
  return {
    "diff": float(np.max(np.abs(g - ref))),
    "device_stats": ssd.device_stats(),
    "expected_shard_bytes": 32 // N * 64 * 4,
  }


def per_device_directories_case():
  """``{device}`` store directories: each device's tensors land in its own directory only
  (a temporary directory, removed with the store's files when the case ends)."""
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  mesh = parallel.Parallelism(data=N).mesh()
  with tempfile.TemporaryDirectory(prefix="ssd-md-") as root:
    try:
      return _per_device_directories(mesh, shard_map, root)
    finally:
      ssd.shutdown()  # close the {device} store before its directories are removed


def _per_device_directories(mesh, shard_map, root):
  cfg = ssd.configure(
    directory=os.path.join(root, "d{device}"),
    capacity_bytes=64 << 20,
    forwarding=False,
    host_cache_bytes=1 << 20,
  )

  def local(x):  # (16, 64) float32 per device: 4096 bytes, one file block
    h = jax.ad_checkpoint.checkpoint_name(jnp.sin(x) + 1.0, "h")
    return jnp.sum(h * h)[None]

  def loss(x):
    f = jax.checkpoint(local, policy=ssd.offload_policy(["h"], min_bytes=0))
    return jnp.sum(
      shard_map(f, mesh=mesh, in_specs=P(parallel.DATA), out_specs=P(parallel.DATA))(x)
    )

  x = jax.device_put(
    jnp.linspace(-1, 1, N * 16 * 64, dtype=jnp.float32).reshape(N * 16, 64),
    NamedSharding(mesh, P(parallel.DATA)),
  )
  ssd.reset_stats()
  jax.block_until_ready(jax.jit(jax.grad(loss))(x))
  ssd.flush()
  s, per_device = ssd.stats(), ssd.device_stats()
  # Local device index i -> directory i (the order {device} expands in).
  return {
    "device_groups": cfg.device_groups,
    "directories": len(cfg.directories),
    # every directory: those of devices outside the mesh stay empty
    "file_bytes_written": [s[f"file{i}_bytes_written"] for i in range(len(cfg.directories))],
    "file_bytes_read": [s[f"file{i}_bytes_read"] for i in range(len(cfg.directories))],
    "device_bytes_written": [per_device[d.id]["bytes_written"] for d in jax.local_devices()[:N]],
  }


def wrong_device_case():
  """A handle moved to another device (ppermute) must be refused by the engine, naming both."""
  from jax._src import core as jax_core

  from jax_ssdtrain._src.primitives import load_p, store_p

  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  mesh = parallel.Parallelism(data=N).mesh()

  def local(x):
    y, handle = store_p.bind(x, site=10**9, tier=0, name="moved", uses=-1)
    handle = jax.lax.ppermute(handle, parallel.DATA, [(i, (i + 1) % N) for i in range(N)])
    return (
      load_p.bind(
        handle, aval=jax_core.ShapedArray(x.shape, x.dtype), site=10**9, tier=0, name="moved"
      )
      + y
    )

  f = jax.jit(shard_map(local, mesh=mesh, in_specs=P(parallel.DATA), out_specs=P(parallel.DATA)))
  try:
    jax.block_until_ready(f(jnp.ones((N * 8, 8), jnp.float32)))
  except Exception as e:  # noqa: BLE001 - the message is what the test checks
    return {"error": str(e)}
  return {"error": None}


def main():
  if len(jax.devices()) < N:
    raise SystemExit(f"expected {N} devices, got {jax.devices()}")
  tokens = np.random.RandomState(0).randint(0, 256, (8, 17)).astype(np.int32)
  device = {t: "device" for t in TAGS}
  result = {"layouts": {}}
  single, _, _ = grads_of(device, tokens)
  keeps = {name: grads_of(device, tokens, par) for name, par in LAYOUTS.items()}
  # Every layout with the nvme tier; the host tier (same partitioning, other engine path) on TP.
  for name, tier in [("dp", "nvme"), ("fsdp", "nvme"), ("tp", "nvme"), ("tp", "host")]:
    par = LAYOUTS[name]
    ours, hlo, stats = grads_of({t: tier for t in TAGS}, tokens, par)
    keep, keep_hlo, _ = keeps[name]
    result["layouts"][f"{name}-{tier}"] = {
      "vs_single": max_diff(ours, single),
      "vs_device_saving": max_diff(ours, keep),
      "collectives": collectives(hlo),
      "collectives_device_saving": collectives(keep_hlo),
      "stores_in_hlo": hlo.count('custom_call_target="ssdtrain_store"'),
      "live_after_step": stats.pop("live_after_step"),
      "device_stats": {str(k): v for k, v in stats.items()},
      "expected_shard_bytes": shard_bytes(par),
    }
  result["shard_map"] = shard_map_case()
  result["shard_map"]["device_stats"] = {
    str(k): v for k, v in result["shard_map"]["device_stats"].items()
  }
  result["wrong_device"] = wrong_device_case()
  result["per_device_dirs"] = per_device_directories_case()
  result["devices"] = [str(d.id) for d in jax.devices()[:N]]
  result["visible_devices"] = len(jax.devices())
  print(json.dumps(result))


if __name__ == "__main__":
  main()
