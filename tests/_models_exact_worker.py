"""Subprocess of tests/test_models.py: one model's loss and gradients with its block tags in the
files against the same step with them saved on the device, compiled without FMA. Prints one JSON
object: the leaves that differ (path, elements, largest difference) and the store's bytes.

XLA:CPU contracts a multiply and the add that uses it into one FMA where its vectorizer emits
them together, so two programs that fuse the same arithmetic differently round it differently
(with jaxlib 0.12.0.1, Llama's rotary embedding of a stored ``qkv``, read from the loaded buffer,
and of the device reference's, read from the saved stack through a dynamic-slice, are 1e-9
apart, and so is every gradient behind them). Compiled for AVX, which has no FMA, each multiply
and add rounds once in both programs; the dots are XLA's runtime's either way. The flag is set
here, not for the whole test session: it changes the rounding of every CPU program, and the
tests that compare against plain optax within a tolerance are calibrated without it."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_models import loss_and_grads  # noqa: E402  (this file's directory is on sys.path)

import jax_ssdtrain as ssd  # noqa: E402
from scripts import training  # noqa: E402

model, dtype, tags = sys.argv[1], sys.argv[2], sys.argv[3].split(",")


common = dict(model=model, batch=4, dtype=dtype, min_bytes=0)
ssd.reset_stats()
nvme = jax.block_until_ready(
  loss_and_grads(training.RunConfig(locations=",".join(f"{t}=nvme" for t in tags), **common))
)
stats = ssd.stats()
device = loss_and_grads(
  training.RunConfig(locations=",".join(f"{t}=device" for t in tags), **common)
)
differ = []
for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nvme), jax.tree.leaves(device)):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not np.array_equal(a, b):
    differ.append([jax.tree_util.keystr(path), int((a != b).sum()), float(np.abs(a - b).max())])
print(
  json.dumps(
    {
      "differ": differ,
      "bytes_written": stats["bytes_written"],
      "bytes_read": stats["bytes_read"],
      "xla_flags": os.environ["XLA_FLAGS"],
    }
  )
)
