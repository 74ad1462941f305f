"""Subprocess of tests/test_multihost.py: one process of a DP training job of a tiny GPT with
every tag offloaded to a store directory templated by process index.

    python _multihost_worker.py PROCESS_ID NUM_PROCESSES PORT STORE_TEMPLATE OUT_JSON

On CPU (the default): NUM_PROCESSES = 0 is the single-process reference (one device, or
SSD_MH_DEVICES of them); otherwise each process has SSD_MH_DEVICES CPU devices (default 2) and
joins the coordinator on 127.0.0.1:PORT (gloo collectives).

SSD_MH_OPTIMIZER=host|nvme|host,nvme puts the optimizer state in the store
(``offload_optimizer``), SSD_MH_FSDP=1 shards parameters and that state over the data axis
(every device streams its own blocks), SSD_MH_CHECKPOINT=DIR saves the state after the last step
with ``jax_ssdtrain.checkpointing`` and restores it into a fresh state (its digest is reported).

With SSD_MH_PLATFORM=gpu (the GPU test): each of the NUM_PROCESSES processes drives the one GPU
that its CUDA_VISIBLE_DEVICES leaves it (NCCL collectives across the processes), and
NUM_PROCESSES = 0 is the reference: one process driving every visible GPU, with the same DP
mesh over them (the same partitioned program, collectives within the process).
"""

import hashlib
import json
import os
import sys

GPU = os.environ.get("SSD_MH_PLATFORM", "cpu") == "gpu"
OPTIMIZER = os.environ.get("SSD_MH_OPTIMIZER") or None
FSDP = os.environ.get("SSD_MH_FSDP") == "1"
CHECKPOINT = os.environ.get("SSD_MH_CHECKPOINT") or None
process_id, num_processes, port, template, out_path = sys.argv[1:6]
process_id, num_processes = int(process_id), int(num_processes)
CPU_DEVICES = int(os.environ.get("SSD_MH_DEVICES", "2" if num_processes else "1"))
if CPU_DEVICES > 1 and not GPU:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}"
  )

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _limits import HANG_S  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

if num_processes:
  if not GPU:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=HANG_S,
  )

import jax_ssdtrain as ssd  # noqa: E402
from models import parallel  # noqa: E402
from scripts import training  # noqa: E402

STEPS, BATCH = 3, 8
# the GPU reference, and a CPU reference of several devices, are sharded over them too
SHARDED = bool(num_processes) or GPU or CPU_DEVICES > 1


def open_files_in(directory: str) -> int:
  """How many of this process's open files live in ``directory`` (Linux: /proc/self/fd)."""
  prefix, n = os.path.join(os.path.realpath(directory), ""), 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      n += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
    except OSError:  # closed since listed
      pass
  return n


def _local_state_bytes(state) -> list[bytes]:
  """This process's part of the optimizer state: its blocks of every stored leaf, from the
  store, and the leaves kept on the device."""
  from jax_ssdtrain._src.optimizer import OffloadedState, stream_out

  out = []
  for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, OffloadedState)):
    if isinstance(s, OffloadedState):
      stream_out(s, lambda i, leaf, index, value: out.append((i, str(index), value.tobytes())))
  return sorted(out)


def main():
  # after initialize: {process} is this process's index
  if GPU:  # the GPU machine's memory: no pinned host tier (every tag goes to nvme)
    ssd.configure(directory=template, host_tier_bytes="64MiB", host_cache_bytes="256MiB")
  else:
    ssd.configure(directory=template)
  run = training.RunConfig(
    preset="tiny",
    batch=BATCH,
    seq_len=16,
    steps=STEPS,
    min_bytes=0,
    dtype="float32",
    locations={t: "nvme" for t in ("layer_in", "qkv", "attn", "mlp_up")},
    optimizer_location=OPTIMIZER,
  )
  state, _, _ = training.create_train_state(run)
  data = np.random.RandomState(0).randint(0, 256, (STEPS, BATCH, 17)).astype(np.int32)
  rng = jax.random.key(1)
  if SHARDED:
    par = parallel.Parallelism(data=jax.device_count(), fsdp=FSDP)
    mesh = par.mesh()
    state, shardings = training.shard_train_state(state, par, mesh)
    step_fn = training.jit_train_step(shardings)
    batches = [training.shard_batch(b, par, mesh) for b in data]
  else:
    step_fn = training.jit_train_step()
    batches = list(data)
  losses, grad_norms = [], []
  for tokens in batches:
    state, metrics = step_fn(state, tokens, rng)
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
  # every process the whole parameters (FSDP: the blocks of every process's devices gathered)
  params = [
    np.asarray(multihost_utils.process_allgather(p, tiled=True)) if SHARDED else np.asarray(p)
    for p in jax.tree.leaves(state.params)
  ]
  restored_equal = None
  if CHECKPOINT:  # saved and restored by every process at once; each compares its own blocks
    import orbax.checkpoint as ocp

    from jax_ssdtrain import checkpointing

    manager = ocp.CheckpointManager(CHECKPOINT)
    manager.save(STEPS, args=checkpointing.save_args(state))
    manager.wait_until_finished()
    restored = checkpointing.restore(manager, like=state)
    restored_equal = _local_state_bytes(state) == _local_state_bytes(restored)
  ssd.flush()
  digest = hashlib.sha256()
  for p in params:
    digest.update(np.ascontiguousarray(p).tobytes())
  directories = list(ssd.store_directories())
  result = {
    "losses": losses,
    "grad_norms": grad_norms,
    "param_sums": [float(np.abs(p).sum()) for p in params],
    "params_sha256": digest.hexdigest(),  # bitwise comparisons of the parameters
    "store_directories": directories,
    # the store's files are O_TMPFILE (no name): its open files in each directory instead
    "store_open_files": {d: open_files_in(d) for d in directories},
    "store_stats": {
      k: v for k, v in ssd.stats().items() if k in ("directories", "open_files") or "file0" in k
    },
    "device_stats": {str(k): v for k, v in ssd.device_stats().items()},
    "local_devices": [d.id for d in jax.local_devices()],
    "process_count": jax.process_count(),
    "device_kinds": sorted({d.device_kind for d in jax.devices()}),
    "platform": jax.default_backend(),
    "restored_equal": restored_equal,
  }
  with open(out_path, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
