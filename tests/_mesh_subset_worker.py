"""Subprocess of tests/test_multidevice.py: meshes smaller than the machine, on 4 CPU devices
(the flag that makes them must be set before JAX starts). Prints one JSON object.

A 2-device mesh through models.parallel (the first 2 devices by default, refused with a
message when more are asked than exist) and through scripts/train.py's ``--mesh dp=2``, with
the first devices and with ``--devices 2,3``: which devices stored the offloaded activations.
"""

import json
import os
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402

import jax_ssdtrain as ssd  # noqa: E402
from models import parallel  # noqa: E402
from scripts import train  # noqa: E402


def ids(mesh):
  return [[d.id for d in row] for row in mesh.devices]


def error_of(fn) -> str | None:
  try:
    fn()
  except (ValueError, SystemExit) as e:
    return str(e)
  return None


def train_run(tmp: str, name: str, *flags: str) -> dict:
  summary = train.main(
    [
      "--model", "gpt", "--preset", "tiny", "--batch", "4", "--seq-len", "16", "--steps", "2",
      "--locations", "layer_in=nvme,mlp_up=host", "--store-dir", os.path.join(tmp, name),
      *flags,
    ]
  )  # fmt: skip
  ssd.flush()
  return {
    "final_loss": summary["final_loss"],
    "gb_written": summary["gb_written"],
    "stored_by": sorted(d for d, s in ssd.device_stats().items() if s["bytes_written"]),
  }


def main():
  tmp = tempfile.gettempdir()  # the test's tmp_path
  result = {
    "devices": [d.id for d in jax.devices()],
    "dp2": ids(parallel.Parallelism(data=2).mesh()),
    "tp2": ids(parallel.Parallelism(model=2).mesh()),
    "dp1": ids(parallel.Parallelism().mesh()),
    "explicit": ids(parallel.Parallelism(data=2).mesh(parallel.select_devices("3,1"))),
    "too_many": error_of(lambda: parallel.Parallelism(data=4, model=2).mesh()),
    "no_such_device": error_of(lambda: parallel.select_devices("1,7")),
    "train_first": train_run(tmp, "first", "--mesh", "dp=2"),
    "train_chosen": train_run(tmp, "chosen", "--mesh", "dp=2", "--devices", "2,3"),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
