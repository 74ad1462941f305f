"""Subprocess of tests/test_optimizer.py: optimizer state in the store, sharded over the devices
(4 CPU devices, or SSD_OPT_DEVICES GPUs with SSD_OPT_PLATFORM=gpu). Prints one JSON object.

Parameters placed FSDP-style on a 1-D mesh (rows sharded, columns sharded, a replicated leaf, a
small leaf kept on the device); for each transformation, 3 steps of ``tx`` itself on the device,
and of ``offload_optimizer(tx)`` with the state on the device (the same streamed program), in the
host tier and in the files. Then each device's bytes written against its blocks, the handles'
sharding, a checkpoint round trip and the resumed run (for the chain), scripts.training's FSDP
path, sweeps between the steps of a donating loop, and the refusal of a transformation that
needs whole leaves (LAMB's per-leaf norms).
"""

import functools
import json
import os
import tempfile

GPU = os.environ.get("SSD_OPT_PLATFORM", "cpu") == "gpu"
# The first N devices of the machine's (SSD_OPT_CPU_DEVICES: the CPU devices to make, default N)
N = int(os.environ.get("SSD_OPT_DEVICES", "2" if GPU else "4"))
if GPU:  # an embedding's gradient (scripts.training's case) is a scatter-add: no atomics
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
if not GPU:  # CPU devices also on a GPU machine (whose memory the test process holds)
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={os.environ.get('SSD_OPT_CPU_DEVICES', N)}"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ssdtrain as ssd  # noqa: E402

if GPU:  # no TF32: the gradients are compared with plain tx's
  jax.config.update("jax_default_matmul_precision", "highest")

STEPS = 3
MiB = 1 << 20
CHUNK = 32 << 10  # several chunks per block, and blocks of one chunk (a scan of one step)
mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
SPECS = {
  "rows": P("data", None),  # 64N x 512: a 64-row block per device, 4 chunks
  "cols": P(None, "data"),  # 128 x 24N: one chunk per device
  "vec": P("data"),  # 4096N: a block of one row
  "repl": P(),  # replicated: each device streams all of it
  "small": P(),  # below min_bytes: stays on the device
}


def make_params():
  k = jax.random.split(jax.random.key(0), 5)
  shapes = {"rows": (64 * N, 512), "cols": (128, 24 * N), "vec": (4096 * N,), "repl": (96, 64)}
  p = {n: jax.random.normal(kk, s) * 0.5 for (n, s), kk in zip(shapes.items(), k)}
  p["small"] = jax.random.normal(k[4], (16,))
  return {n: jax.device_put(x, NamedSharding(mesh, SPECS[n])) for n, x in p.items()}


def loss(p, x):
  h = jnp.tanh(x @ p["rows"])[:, :128] @ p["cols"]
  return (
    jnp.sum(h**2)
    + jnp.sum(jnp.sin(p["vec"]) ** 2)
    + jnp.sum(jnp.cos(p["repl"]))
    + jnp.sum(p["small"] ** 3)
  )


X = jax.random.normal(jax.random.key(7), (8, 64 * N)) * 0.05  # gentle steps: ulps stay ulps


def transformations():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
  decay = lambda p: {n: x.ndim > 1 for n, x in p.items()}  # noqa: E731
  return {
    "chain": optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1, mask=decay)
    ),
    "adam": optax.adam(1e-2),
    "sgd_momentum": optax.sgd(1e-2, momentum=0.9),
    "lion": optax.lion(1e-3),
  }


def train(tx, params, steps, state=None):
  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p, X)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params) if state is None else state
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(host(a), host(b)))


def rel(a, b) -> float:
  return max(
    float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) or 1.0)) for x, y in zip(host(a), host(b))
  )


def same_state(a, b) -> bool:
  """Two train states of the same structure: every value bit for bit, every leaf placed alike."""
  from scripts import training

  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  placed = all(
    x.sharding.is_equivalent_to(y.sharding, x.ndim)
    for x, y in zip(la, lb)
    if isinstance(x, jax.Array)
  )
  va = jax.tree.leaves(training._state_on_host(a))
  vb = jax.tree.leaves(training._state_on_host(b))
  return placed and len(va) == len(vb) and all(np.array_equal(x, y) for x, y in zip(va, vb))


def block_bytes(layout) -> int:
  """Bytes one device stores for one version of the state: its block of each stored leaf."""
  return sum(leaf.block_nbytes for leaf in layout.leaves if leaf.stored)


def train_case() -> dict:
  """scripts.training's FSDP path (scripts/train.py --mesh dp=N,fsdp): the train state placed on
  the mesh with its optimizer state in the store, 2 steps, against the state on the devices;
  the collectives of each compiled step ("kept": leaves under min_bytes stay on the device)."""
  from models import parallel
  from scripts import training
  from scripts.bench_multigpu import count_collectives

  par = parallel.Parallelism(data=N, fsdp=True)
  mesh = par.mesh()  # the first N devices, as scripts/train.py's
  out, collectives, kept_specs, made_same = {}, {}, {}, {}
  for case, loc, min_bytes in (
    ("None", None, 0),
    ("device", "device", 0),
    ("host", "host", 0),
    ("kept", "host", 4096),  # the tiny model's biases and norms (512 bytes) on the device
  ):
    run = training.RunConfig(
      preset="tiny",
      batch=8,
      seq_len=16,
      optimizer_location=loc,
      min_bytes=min_bytes,
      dtype="float32",
    )
    state, _, _ = training.create_train_state(run)
    state, shardings = training.shard_train_state(state, par, mesh)
    # made on the mesh (scripts/train.py's --mesh): no device holds the whole model
    made, _, _ = training.create_train_state(run, parallelism=par, mesh=mesh)
    made_same[case] = same_state(made, state)
    step = training.jit_train_step(shardings)
    tokens = training.shard_batch(
      np.random.default_rng(0).integers(0, 256, (8, 17), dtype=np.int32), par, mesh
    )
    hlo = step.lower(state, tokens, jax.random.key(1)).compile().as_text()
    collectives[case] = count_collectives(hlo)["ops"]
    if case == "kept":
      offloaded = state.opt_state
      kept = [leaf for leaf in offloaded.layout.leaves if not leaf.stored]
      kept_specs = {
        leaf.path: [str(leaf.spec), str(x.sharding.spec)] for leaf, x in zip(kept, offloaded.device)
      }
    for _ in range(2):
      state, metrics = step(state, tokens, jax.random.key(1))
    out[case] = (host(state.params), float(metrics["loss"]), state)
  stored = out["host"][2].opt_state
  return {
    "collectives": collectives,
    "made_on_mesh_same": made_same,
    "kept_specs": kept_specs,
    "kept_stored_leaves": len(out["kept"][2].opt_state.handles),
    "kept_eq_host": all(np.array_equal(a, b) for a, b in zip(out["kept"][0], out["host"][0])),
    "stored_leaves": len(stored.handles),
    "handle_rows": sorted({h.shape[0] for h in stored.handles}),
    "host_eq_device": all(np.array_equal(a, b) for a, b in zip(out["host"][0], out["device"][0])),
    "vs_tx": max(
      float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) or 1.0))
      for a, b in zip(out["host"][0], out["None"][0])
    ),
    "loss": [out["host"][1], out["None"][1]],
  }


def collect_between_steps() -> list[int]:
  """What ``ssd.collect()`` releases after each step of a loop that donates its state (the
  handle arrays are sharded: reading them makes per-shard arrays, which a sweep must not take
  for the results of a program dispatched meanwhile)."""
  tx = ssd.offload_optimizer(optax.adam(1e-3), location="host", min_bytes=4096, chunk_bytes=CHUNK)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, s):
    u, s = tx.update(jax.grad(loss)(p, X), s, p)
    return optax.apply_updates(p, u), s

  p = make_params()
  s = tx.init(p)
  released = []
  for _ in range(4):
    p, s = jax.block_until_ready(step(p, s))
    released.append(ssd.collect())
  return released


def in_place_case() -> dict:
  """Adam's sharded state updated in place (each device consuming its own blocks' entries) in a
  donating loop, against the same program with the state on the devices."""
  out = {}
  for loc, in_place in (("device", False), ("host", True)):
    kw = dict(location=loc, min_bytes=4096, chunk_bytes=CHUNK, in_place=in_place)
    tx = ssd.offload_optimizer(optax.adam(1e-3), **kw)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, tx=tx):
      return ssd.apply_gradients(tx, jax.grad(loss)(p, X), s, p)

    p = make_params()
    s = tx.init(p)
    for _ in range(STEPS):
      p, s = step(p, s)
    out[loc] = host(p)
  ssd.flush()
  ssd.collect()
  per_version = N * sum(len(leaf.bounds) for leaf in s.layout.leaves if leaf.stored)
  return {
    "eq_device": all(np.array_equal(a, b) for a, b in zip(out["host"], out["device"])),
    "live_entries": [ssd.stats()["live_entries"], per_version],
  }


def two_pass_case() -> dict:
  """Transformations streamed in two passes (a number built from every parameter's state: each
  device's partial of each sum joined over the mesh) against the same on the devices."""
  out = {}
  for name, tx in {"prodigy": optax.contrib.prodigy(1.0), "dog": optax.contrib.dog(1.0)}.items():
    params = make_params()
    ref, _ = train(tx, params, STEPS)
    runs = {}
    for loc in ("device", "host"):
      otx = ssd.offload_optimizer(tx, location=loc, min_bytes=4096, chunk_bytes=CHUNK)
      runs[loc] = train(otx, params, STEPS)
    out[name] = {
      "host_eq_device": equal(runs["host"][0], runs["device"][0]),
      "state_host_eq_device": equal(
        ssd.optimizer_state(runs["host"][1]), ssd.optimizer_state(runs["device"][1])
      ),
      "vs_tx": rel(runs["host"][0], ref),
      "stored_leaves": len(runs["host"][1].handles),
    }
    del runs
    ssd.collect()
  return out


def main():
  result = {"devices": N, "platform": jax.default_backend(), "tx": {}}
  result["visible_devices"] = len(jax.devices())
  root = tempfile.mkdtemp(prefix="ssd-opt-")
  with ssd.configured(
    os.path.join(root, "store"), capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB
  ):
    for name, tx in transformations().items():
      params = make_params()
      ref, _ = train(tx, params, STEPS)
      runs, r = {}, {}
      for loc in ("device", "host", "nvme"):
        otx = ssd.offload_optimizer(tx, location=loc, min_bytes=4096, chunk_bytes=CHUNK)
        ssd.flush()
        ssd.reset_stats()
        runs[loc] = train(otx, params, STEPS)
        ssd.flush()
        if loc != "device":
          state = runs[loc][1]
          r[f"{loc}_written_per_device"] = {
            str(d): s["bytes_written"] for d, s in ssd.device_stats().items()
          }
          r["expected_per_device"] = block_bytes(state.layout) * (STEPS + 1)  # init + steps
      state = runs["host"][1]
      # A sweep between steps keeps one version of each live state (host and nvme), no more.
      ssd.collect()
      per_version = N * sum(len(leaf.bounds) for leaf in state.layout.leaves if leaf.stored)
      r["live_entries"] = [ssd.stats()["live_entries"], 2 * per_version]
      r["handles"] = [[list(h.shape), str(h.sharding.spec)] for h in state.handles]
      r["params_specs"] = {n: str(x.sharding.spec) for n, x in runs["host"][0].items()}
      r["host_eq_device"] = equal(runs["host"][0], runs["device"][0])
      r["nvme_eq_device"] = equal(runs["nvme"][0], runs["device"][0])
      r["state_host_eq_device"] = equal(
        ssd.optimizer_state(state), ssd.optimizer_state(runs["device"][1])
      )
      r["vs_tx"] = rel(runs["host"][0], ref)
      result["tx"][name] = r
      if name != "chain":  # the checkpoint path is the same for every transformation
        del runs, state
        ssd.collect()
        continue
      # A checkpoint of the sharded state, restored into a fresh one, resumed for a step.
      saved = ssd.state_to_host(state)
      r["saved_eq_state"] = equal(saved, ssd.optimizer_state(state))
      otx = ssd.offload_optimizer(tx, location="host", min_bytes=4096, chunk_bytes=CHUNK)
      fresh = otx.init(make_params())
      restored = ssd.state_from_host(saved, fresh)
      a = train(otx, runs["host"][0], 1, state=restored)
      b = train(otx, runs["host"][0], 1, state=state)
      r["resumed_eq"] = equal(a[0], b[0]) and equal(
        ssd.optimizer_state(a[1]), ssd.optimizer_state(b[1])
      )
      del runs, state, fresh, restored, a, b
      ssd.collect()
    result["two_pass"] = two_pass_case()
    result["train"] = train_case()
    result["collect_between_steps"] = collect_between_steps()
    result["in_place"] = in_place_case()
    try:
      train(ssd.offload_optimizer(optax.lamb(1e-3), min_bytes=4096), make_params(), 1)
      result["lamb"] = "accepted"
    except ssd.OptimizerOffloadError as e:
      result["lamb"] = str(e)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
