"""How long a checkpoint of optimizer state in the store takes, against the disk it goes to.

One process, side by side: Adam's state for LEAVES parameter leaves of ROWS x COLS float32, in
the store (``--location``, default the host tier), saved with Orbax and restored, two ways:

- ``streamed``: ``jax_ssdtrain.checkpointing`` (each chunk read from the store and written into
  the checkpoint's tensorstore arrays, one at a time; the restore the other way);
- ``staged``: the whole state read into host memory first (``ssd.state_to_host``) and saved with
  Orbax's ``StandardSave``; restored with ``StandardRestore`` and ``ssd.state_from_host``.

The checkpoint directory is measured in the same run (``probe.measure(..., raw=True)``: plain
O_DIRECT writes and reads): each row's GB/s are also given as a fraction of those. Before each
restore the checkpoint's files are synced and dropped from the page cache, so that it reads the
disk. Median of ``--repeats`` saves and restores.

  python -m scripts.bench_checkpoint --ckpt-dir /var/tmp/ckpt [--leaves 8 --rows 4096 --cols 8192]
  python -m scripts.bench_checkpoint --tiny        (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jax_ssdtrain as ssd
from jax_ssdtrain import checkpointing
from scripts import bench_common as bc

VARIANTS = ("streamed", "staged")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--leaves", type=int, default=8)
  p.add_argument("--rows", type=int, default=4096)
  p.add_argument("--cols", type=int, default=8192)
  p.add_argument("--chunk", type=ssd.parse_size, default="64MiB", help="rows streamed at once")
  p.add_argument("--location", default="host", help="where the state lives (offload_optimizer)")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--store-dir", default=None, help="store directory (default: a private temp)")
  p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: a private temp)")
  bc.add_out_option(p)
  p.add_argument("--tiny", action="store_true", help="a CPU smoke run (small leaves, 1 repeat)")
  return p


def _drop_page_cache(directory: Path) -> None:
  """Syncs ``directory``'s files and drops them from the page cache (no root needed)."""
  os.sync()
  for path in directory.rglob("*"):
    if path.is_file():
      fd = os.open(path, os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _save(variant: str, manager, step: int, state) -> None:
  if variant == "streamed":
    manager.save(step, args=checkpointing.save_args({"opt": state}))
  else:
    manager.save(step, args=ocp.args.StandardSave({"opt": ssd.state_to_host(state)}))
  manager.wait_until_finished()


def _restore(variant: str, manager, step: int, like):
  if variant == "streamed":
    return checkpointing.restore(manager, {"opt": like}, step)["opt"]
  # tx's state as NumPy arrays of the layout's shapes (np.zeros: pages untouched until read),
  # not read out of the store: a template costs no I/O inside the timed restore
  layout = like.layout
  host = layout.treedef.unflatten([np.zeros(leaf.shape, leaf.dtype) for leaf in layout.leaves])
  restored = manager.restore(step, args=ocp.args.StandardRestore({"opt": host}))
  return ssd.state_from_host(restored["opt"], like)


def run(args) -> dict:
  shape = (args.rows, args.cols)
  keys = jax.random.split(jax.random.key(0), args.leaves)
  params = {f"w{i}": jax.random.normal(k, shape) * 0.02 for i, k in enumerate(keys)}
  grads = jax.tree.map(lambda p: 1e-3 * jnp.cos(p), params)
  state_bytes = 2 * args.leaves * args.rows * args.cols * 4  # Adam's two moments
  store = args.store_dir or tempfile.mkdtemp(prefix="bench-ckpt-store-")
  root = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
  root.mkdir(parents=True, exist_ok=True)
  from jax_ssdtrain import probe

  disk = probe.measure(root, min(max(state_bytes, 64 << 20), 4 << 30), raw=True, refresh=True)
  rows = []
  with ssd.configured(
    store,
    capacity_bytes=max(5 * state_bytes, 256 << 20),
    host_tier_bytes=max(3 * state_bytes, 64 << 20),
  ):
    tx = ssd.offload_optimizer(optax.adam(1e-3), location=args.location, chunk_bytes=args.chunk)
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads, state, params)  # moments that are not zeros
    jax.block_until_ready(state)
    for variant in args.variants.split(","):
      saves, restores = [], []
      for r in range(args.repeats):
        directory = root / f"{variant}_{r}"
        manager = ocp.CheckpointManager(
          directory, options=ocp.CheckpointManagerOptions(create=True)
        )
        t0 = time.perf_counter()
        _save(variant, manager, 1, state)
        saves.append(time.perf_counter() - t0)
        _drop_page_cache(directory)
        t0 = time.perf_counter()
        restored = _restore(variant, manager, 1, state)
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - t0)
        del restored
        ssd.collect()
        manager.close()
        shutil.rmtree(directory)
      save_s, restore_s = statistics.median(saves), statistics.median(restores)
      rows.append(
        dict(
          variant=variant,
          save_s=save_s,
          restore_s=restore_s,
          save_gbps=state_bytes / save_s / 1e9,
          restore_gbps=state_bytes / restore_s / 1e9,
          x_raw_write=state_bytes / save_s / 1e9 / disk.raw_write_gbps
          if disk.raw_write_gbps
          else None,
          x_raw_read=state_bytes / restore_s / 1e9 / disk.raw_read_gbps
          if disk.raw_read_gbps
          else None,
        )
      )
  return bc.bench_doc(
    "checkpoint",
    args,
    state_gb=state_bytes / 1e9,
    location=args.location,
    disk=dict(
      directory=str(root),
      raw_write_gbps=disk.raw_write_gbps,
      raw_read_gbps=disk.raw_read_gbps,
      o_direct=disk.raw_o_direct,
      size=disk.size,
    ),
    rows=rows,
  )


def table(doc: dict) -> str:
  disk = doc["disk"]
  lines = [
    f"Adam's state, {doc['state_gb']:.2f} GB in the store ({doc['location']}), saved with Orbax and "
    f"restored; checkpoint directory {disk['directory']}: raw writes "
    f"{disk['raw_write_gbps']:.2f} GB/s, reads {disk['raw_read_gbps']:.2f} GB/s "
    f"({disk['size'] / 1e9:.2f} GB, O_DIRECT {disk['o_direct']})",
    "",
    "| variant | save s | save GB/s | x raw write | restore s | restore GB/s | x raw read |",
    "|---|---|---|---|---|---|---|",
  ]
  fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
  for r in doc["rows"]:
    lines.append(
      f"| {r['variant']} | {r['save_s']:.2f} | {r['save_gbps']:.2f} | {fmt(r['x_raw_write'])} | "
      f"{r['restore_s']:.2f} | {r['restore_gbps']:.2f} | {fmt(r['x_raw_read'])} |"
    )
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> None:
  with bc.figure(plt, path, figsize=(6, 3)) as (_, ax):
    names = [r["variant"] for r in doc["rows"]]
    ax.barh([f"{n} save" for n in names], [r["save_gbps"] for r in doc["rows"]])
    ax.barh([f"{n} restore" for n in names], [r["restore_gbps"] for r in doc["rows"]])
    ax.axvline(doc["disk"]["raw_write_gbps"], color="k", ls="--", lw=1, label="raw write")
    ax.set_xlabel("GB/s (median)")
    ax.set_title(f"checkpoint of {doc['state_gb']:.1f} GB of optimizer state")
    ax.legend(loc="lower right")


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  if args.tiny:
    args.leaves, args.rows, args.cols, args.repeats, args.chunk = 2, 300, 256, 1, 32 << 10
  doc = run(args)
  kind = bc.slug(jax.devices()[0].device_kind)
  bc.write_bench(args.out, f"checkpoint_{kind}", doc, table(doc), plot)
  return doc


if __name__ == "__main__":
  main()
