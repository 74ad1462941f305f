"""``python -m jax_ssdtrain.maxtext [--ssd-location nvme|host] [--ssd-min-bytes N]
[--ssd-dir DIR] [--ssd-optimizer host|nvme|host,nvme|device] [--ssd-optimizer-min-bytes N]
[--ssd-optimizer-chunk-bytes N] <MaxText's train arguments>``: MaxText's own ``train.main``
with its offloaded tags, and with ``--ssd-optimizer`` its optimizer state, in the jax_ssdtrain
store (see jax_ssdtrain.maxtext)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
    prog="python -m jax_ssdtrain.maxtext",
    add_help=False,
    usage="%(prog)s [--ssd-location nvme|host] [--ssd-min-bytes N] [--ssd-dir DIR] "
    "[--ssd-optimizer host|nvme|host,nvme|device] [--ssd-optimizer-min-bytes N] "
    "[--ssd-optimizer-chunk-bytes N] CONFIG.yml [key=value ...]  (MaxText's train arguments)",
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
  parser.add_argument(
    "--ssd-optimizer",
    default=None,
    choices=("host", "nvme", "host,nvme", "device"),
    help="the optimizer state in our store (offload_optimizer's location; 'device': the same "
    "streamed program with the state on the device); default: MaxText's own",
  )
  parser.add_argument(
    "--ssd-optimizer-min-bytes", default=None, help="smaller state leaves stay on the device"
  )
  parser.add_argument(
    "--ssd-optimizer-chunk-bytes", default=None, help="bytes of a leaf streamed at once"
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
  opt_options = {}
  try:
    for key, value in (
      ("min_bytes", ours.ssd_optimizer_min_bytes),
      ("chunk_bytes", ours.ssd_optimizer_chunk_bytes),
    ):
      if value is not None:
        if ours.ssd_optimizer is None:
          raise ValueError(
            f"--ssd-optimizer-{key.replace('_', '-')}: given without --ssd-optimizer"
          )
        opt_options[key] = ssd.parse_size(value, what=f"--ssd-optimizer-{key.replace('_', '-')}")
    mt.install(
      ours.ssd_location,
      min_bytes=min_bytes,
      store={"directory": ours.ssd_dir} if ours.ssd_dir else None,
      optimizer=ours.ssd_optimizer,
      optimizer_options=opt_options or None,
    )
  except (ImportError, RuntimeError, ValueError, OSError) as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  from absl import app  # MaxText's own (optional, heavy) dependencies: only to run it
  from maxtext.trainers.pre_train import train

  app.run(train.main, argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
  main()
