"""``python -m jax_ssdtrain.maxtext [--ssd-location nvme|host] [--ssd-min-bytes N]
[--ssd-dir DIR] <MaxText's train arguments>``: MaxText's own ``train.main`` with its offloaded
tags in the jax_ssdtrain store (see jax_ssdtrain.maxtext)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
    prog="python -m jax_ssdtrain.maxtext",
    add_help=False,
    usage="%(prog)s [--ssd-location nvme|host] [--ssd-min-bytes N] [--ssd-dir DIR] "
    "CONFIG.yml [key=value ...]  (MaxText's train arguments)",
  )
  parser.add_argument(
    "--ssd-location",
    default="nvme",
    choices=("nvme", "host"),
    help="where MaxText's 'offload' tags go (default: nvme)",
  )
  parser.add_argument("--ssd-min-bytes", default=None, help="smaller tags stay on the device")
  parser.add_argument(
    "--ssd-dir", default=None, help="store directory (default: $SSDTRAIN_DIR or a private temp dir)"
  )
  if any(a in ("-h", "--help") for a in argv):
    parser.print_help()
    print("\nThe remaining arguments go to MaxText's train.main unchanged.")
    return
  ours, rest = parser.parse_known_args(argv)
  import jax_ssdtrain as ssd  # after --help: the help needs neither JAX nor MaxText
  import jax_ssdtrain.maxtext as mt

  min_bytes = (
    ssd.parse_size(ours.ssd_min_bytes, what="--ssd-min-bytes")
    if ours.ssd_min_bytes is not None
    else mt.DEFAULT_MIN_BYTES
  )
  try:
    mt.install(
      ours.ssd_location,
      min_bytes=min_bytes,
      store={"directory": ours.ssd_dir} if ours.ssd_dir else None,
    )
  except (ImportError, RuntimeError, ValueError, OSError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  from absl import app  # MaxText's own (optional, heavy) dependencies: only to run it
  from maxtext.trainers.pre_train import train

  app.run(train.main, argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
  main()
