"""Subprocess of tests/test_multihost.py: one process of a DP training job of a tiny GPT with
every tag offloaded to a store directory templated by process index.

    python _multihost_worker.py PROCESS_ID NUM_PROCESSES PORT STORE_TEMPLATE OUT_JSON

NUM_PROCESSES = 0: the single-process, single-device reference. Otherwise each process has 2
CPU devices and joins the coordinator on 127.0.0.1:PORT (gloo collectives).
"""

import json
import os
import sys

process_id, num_processes, port, template, out_path = sys.argv[1:6]
process_id, num_processes = int(process_id), int(num_processes)
if num_processes:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  )

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _limits import HANG_S  # noqa: E402

if num_processes:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=HANG_S,
  )

import jax_ssdtrain as ssd  # noqa: E402
from models import parallel, training  # noqa: E402

STEPS, BATCH = 3, 8


def main():
  ssd.configure(directory=template)  # after initialize: {process} is this process's index
  run = training.RunConfig(
    preset="tiny",
    batch=BATCH,
    seq_len=16,
    steps=STEPS,
    min_bytes=0,
    dtype="float32",
    locations={t: "nvme" for t in ("layer_in", "qkv", "attn", "mlp_up")},
  )
  state, _, _ = training.create_train_state(run)
  data = np.random.RandomState(0).randint(0, 256, (STEPS, BATCH, 17)).astype(np.int32)
  rng = jax.random.key(1)
  if num_processes:
    par = parallel.Parallelism(data=jax.device_count())
    mesh = par.mesh()
    state, shardings = training.shard_train_state(state, par, mesh)
    step_fn = training.jit_train_step(shardings)
    batches = [training.shard_batch(b, par, mesh) for b in data]
  else:
    step_fn = training.jit_train_step()
    batches = list(data)
  losses = []
  for tokens in batches:
    state, metrics = step_fn(state, tokens, rng)
    losses.append(float(metrics["loss"]))
  params = [
    np.asarray(p.addressable_data(0)) if num_processes else np.asarray(p)
    for p in jax.tree.leaves(state.params)
  ]
  ssd.flush()
  result = {
    "losses": losses,
    "param_sums": [float(np.abs(p).sum()) for p in params],
    "store_directories": list(ssd.store_directories()),
    "device_stats": {str(k): v for k, v in ssd.device_stats().items()},
    "local_devices": [d.id for d in jax.local_devices()],
  }
  with open(out_path, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
