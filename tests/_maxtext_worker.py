"""Subprocess of tests/test_maxtext.py: MaxText's own train.main on a tiny llama2-style model.

    python _maxtext_worker.py MODE DEVICES OUTDIR [MaxText key=value ...]

MODE: nvme | host (jax_ssdtrain.maxtext installed; the TAGS set to "offload"), device (the
same TAGS saved on the device by MaxText's own custom policy). An argument
``--optimizer=LOC[:min_bytes]`` (LOC: host | nvme | host,nvme | device) installs
jax_ssdtrain.maxtext with MaxText's optimizer state in our store (``device``: the same streamed
program with the state on the device). Prints one JSON line: the loss of every step, the store's
statistics and, with --optimizer, the optimizer state's location and its leaves' shardings.
"""

import json
import os
import sys

MODE, DEVICES, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
EXTRA = [a for a in sys.argv[4:] if not a.startswith("--optimizer=")]
OPTIMIZER = next((a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--optimizer=")), None)
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)

import maxtext  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402

import jax_ssdtrain as ssd  # noqa: E402
import jax_ssdtrain.maxtext as ssd_maxtext  # noqa: E402

TAGS = (
  "decoder_layer_input",
  "query_proj",
  "key_proj",
  "value_proj",
  "out_proj",
  "mlpwi_0",
  "mlpwi_1",
  "mlpwo",
)

OPT_MIN_BYTES = 0
if OPTIMIZER is not None and ":" in OPTIMIZER:
  OPTIMIZER, OPT_MIN_BYTES = OPTIMIZER.split(":")[0], int(OPTIMIZER.split(":")[1])
if MODE in ("nvme", "host") or OPTIMIZER:
  ssd_maxtext.install(
    MODE if MODE in ("nvme", "host") else "host",
    min_bytes=0,
    optimizer=OPTIMIZER,
    optimizer_options={"min_bytes": OPT_MIN_BYTES} if OPTIMIZER else None,
  )
ssd.configure(os.path.join(OUT, "store"), capacity_bytes=1 << 30)
ssd.reset_stats()
value = "device" if MODE == "device" else "offload"
base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
argv = [
  "",
  base,
  "run_name=t",
  f"base_output_directory={OUT}/out",
  "dataset_type=synthetic",
  "steps=3",
  "per_device_batch_size=1",
  "max_target_length=32",
  "base_emb_dim=64",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "base_mlp_dim=128",
  "base_num_decoder_layers=2",
  "head_dim=16",
  "vocab_size=256",
  "decoder_block=llama2",
  "enable_checkpointing=false",
  "enable_goodput_recording=false",
  "log_period=1",
  f"metrics_file={OUT}/metrics.jsonl",
  "remat_policy=custom",
]
argv += [f"{t}={value}" for t in TAGS] + EXTRA
STATES = []
if OPTIMIZER:  # the optimizer state of the last step, as train_loop returns it
  real_train_loop = train.train_loop

  def train_loop(config, recorder, state=None):
    out = real_train_loop(config, recorder, state)
    STATES.append(out)
    return out

  train.train_loop = train_loop
train.main(argv)
ssd.flush()
optimizer = None
if STATES:
  import jax  # noqa: E402
  from flax import nnx  # noqa: E402

  # nnx.State flattens the OffloadedState: its leaves (device, then handles) under opt_state
  leaves = jax.tree.leaves(nnx.as_pure(STATES[-1].optimizer.opt_state))
  handles = [x for x in leaves if x.dtype == jax.numpy.uint32 and x.shape[-1:] == (2,)]
  optimizer = {
    "leaves": len(leaves),
    "handles": len(handles),
    "handle_shapes": sorted({str(tuple(h.shape)) for h in handles}),
    "handle_specs": sorted({str(h.sharding.spec) for h in handles}),
    "specs": sorted({str(x.sharding.spec) for x in leaves}),
  }
stats = ssd.stats()
with open(os.path.join(OUT, "metrics.jsonl")) as f:
  losses = [json.loads(line)["learning/loss"] for line in f if line.strip()]
print(
  json.dumps(
    {
      "losses": losses,
      "installed": ssd_maxtext.installed() is not None,
      "optimizer": optimizer,
      "stats": {
        k: stats[k]
        for k in (
          "bytes_written",
          "tensors_written",
          "bytes_read",
          "host_tier_bytes_peak",
          "live_entries",
        )
      },
    },
    default=str,
  )
)
