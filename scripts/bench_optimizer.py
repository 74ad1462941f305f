"""The optimizer update with its state in the store against the state on the device.

One process, side by side: Adam's update of LEAVES parameter leaves of ROWS x COLS float32 with
its state (two moments) kept on the device (plain optax), the same streamed program with the
state on the device (``location="device"``), in the host tier and in the store files, and (on a
GPU) JAX's own memory kinds: the state in ``pinned_host``, moved to the device inside the step and
back, as MaxText's ``optimizer_memory_host_offload`` does. The GPU's link is measured in the
same run (pinned copies each way, and both at once): the streamed update moves the state both
ways, so its rate is compared with the two-way rate. Likewise the store directory, read and
written at once with plain O_DIRECT (``probe.measure_disk_duplex``), for the ``nvme`` row.

  python -m scripts.bench_optimizer [--leaves 8 --rows 4096 --cols 8192] [--out DIR]
  python -m scripts.bench_optimizer --devices 2   (FSDP: each device ROWS rows of every leaf)
  python -m scripts.bench_optimizer --tiny        (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

import jax_ssdtrain as ssd
from jax_ssdtrain._src.optimizer import offload_optimizer
from scripts import bench_common as bc

VARIANTS = ("device", "streamed_device", "host", "nvme", "jax_pinned_host")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--leaves", type=int, default=8)
  p.add_argument("--rows", type=int, default=4096)
  p.add_argument("--cols", type=int, default=8192)
  p.add_argument("--chunk", type=ssd.parse_size, default="64MiB", help="rows streamed at once")
  p.add_argument("--min-bytes", type=ssd.parse_size, default="1MiB", help="smaller leaves stay")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--store-dir", default=None, help="store directory (default: a private temp)")
  p.add_argument(
    "--devices",
    type=int,
    default=1,
    help="shard every leaf's rows over this many devices (each holds ROWS rows: weak scaling); "
    "each streams its own blocks",
  )
  p.add_argument(
    "--timeline",
    action="store_true",
    help="write the last step's GPU copies of the host and nvme rows as a Chrome trace "
    "(optimizer_timeline_<device>.json in --out; the JSON keeps a per-operation summary)",
  )
  p.add_argument("--tiny", action="store_true", help="a CPU smoke run (small leaves, 2 steps)")
  bc.add_out_option(p)
  return p


def _time(step, params, state, grads, steps, warmup, timeline=False):
  """Median step time, the parameters, and (``timeline``) the last step's GPU copies."""
  times, last_step = [], []
  for i in range(warmup + steps):
    last = timeline and i == warmup + steps - 1
    if last:
      ssd.timeline()  # forget the copies of the steps before
    t0 = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    if i >= warmup:
      times.append(time.perf_counter() - t0)
    if last:
      last_step = ssd.timeline()
    ssd.collect()  # the last version of the state, untimed (see docs/optimizer.md)
  return statistics.median(times), params, last_step


def _step_for(tx):
  def step(p, s, g):
    return ssd.apply_gradients(tx, g, s, p)  # ours: the parameters updated inside the stream

  return jax.jit(step, donate_argnums=(0, 1))


def _jax_pinned_host_step(tx, params):
  dev = jax.devices()[0]
  on_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  state = jax.device_put(tx.init(params), on_host)
  state_sh = jax.tree.map(lambda _: on_host, state)

  def step(p, s, g):
    s = jax.device_put(s, on_device)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), jax.device_put(s, on_host)

  return jax.jit(step, donate_argnums=(0, 1), out_shardings=(None, state_sh)), state


def run(args) -> dict:
  tx = optax.adam(1e-3)
  n = args.devices
  if n > len(jax.devices()):
    raise SystemExit(f"--devices {n}: only {len(jax.devices())} device(s) here")
  shape = (args.rows * n, args.cols)
  place = lambda x: x  # noqa: E731
  if n > 1:  # FSDP: rows sharded; init sees the placed parameters and shards the state alike
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
    by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    place = lambda x: jax.device_put(x, by_rows)  # noqa: E731
  keys = jax.random.split(jax.random.key(0), args.leaves)
  make = lambda: {f"w{i}": place(jax.random.normal(k, shape) * 0.02) for i, k in enumerate(keys)}
  grads = {f"w{i}": place(jax.random.normal(k, shape) * 1e-3) for i, k in enumerate(keys[::-1])}
  param_bytes = args.leaves * args.rows * n * args.cols * 4
  state_bytes = 2 * param_bytes  # Adam's two moments
  gpu = jax.default_backend() == "gpu"
  link = None
  if gpu:
    from jax_ssdtrain import probe

    size = min(state_bytes // n, 1 << 30)
    # several devices: each GPU's link while all n copy at once (the host may bind, not the
    # links), the mean over them; one device: its link alone
    rs = probe.measure_links(range(n), size) if n > 1 else [probe.measure_link(size=size)]
    mean = lambda f: sum(getattr(r, f) for r in rs) / len(rs)  # noqa: E731
    link = dict(
      d2h=mean("d2h_gbps"),
      h2d=mean("h2d_gbps"),
      duplex_d2h=mean("duplex_d2h_gbps"),
      duplex_h2d=mean("duplex_h2d_gbps"),
      gpus_at_once=n,
      per_gpu=[dataclasses.asdict(r) for r in rs],
    )
  store = args.store_dir or tempfile.mkdtemp(prefix="bench-opt-")
  disk = None
  if "nvme" in args.variants.split(","):  # the disk reading one version while writing the next
    from jax_ssdtrain import probe

    Path(store).mkdir(parents=True, exist_ok=True)
    d = probe.measure_disk_duplex(store, min(state_bytes, 2 << 30))
    disk = dict(each_way=d.each_way_gbps, read=d.read_gbps, write=d.write_gbps, size=d.size)
  rows = []
  with ssd.configured(
    store,
    # Room for the versions the store holds at once: the current state, the one being
    # written, and the one the next sweep releases (see docs/optimizer.md).
    capacity_bytes=max(5 * state_bytes, 256 << 20),
    host_tier_bytes=max(5 * state_bytes, 64 << 20),
  ):
    for variant in args.variants.split(","):
      if variant == "jax_pinned_host" and (not gpu or n > 1):
        continue
      params = make()
      if variant == "device":
        step, state = _step_for(tx), tx.init(params)
      elif variant == "jax_pinned_host":
        step, state = _jax_pinned_host_step(tx, params)
      else:
        loc = "device" if variant == "streamed_device" else variant
        otx = offload_optimizer(tx, location=loc, chunk_bytes=args.chunk, min_bytes=args.min_bytes)
        step, state = _step_for(otx), otx.init(params)
      ssd.flush()
      ssd.reset_stats()
      stored = variant in ("host", "nvme")
      t, _, last_step = _time(
        step, params, state, grads, args.steps, args.warmup, timeline=stored and args.timeline
      )
      ssd.flush()
      s = ssd.stats()
      row = dict(variant=variant, step_s=t, state_gb=state_bytes / 1e9)
      if stored:
        runs = args.steps + args.warmup
        row["engine"] = bc.engine_row(s, runs)  # per step: link busy time, loads served, ...
        if last_step:
          row["timeline"] = last_step
        row["read_gb_per_step"] = s["bytes_read"] / runs / 1e9
        row["written_gb_per_step"] = s["bytes_written"] / runs / 1e9
        row["each_way_gbps"] = state_bytes / n / t / 1e9  # per device: each has its own link
        if link and variant == "host":
          row["x_two_way_link"] = row["each_way_gbps"] / min(link["duplex_d2h"], link["duplex_h2d"])
        if disk and variant == "nvme":  # every device's state goes to the one directory
          row["x_two_way_disk"] = state_bytes / t / 1e9 / disk["each_way"]
      rows.append(row)
      del step, state
  base = next((r["step_s"] for r in rows if r["variant"] == "device"), None)
  for r in rows:
    r["x_device"] = r["step_s"] / base if base else None
  return bc.bench_doc(
    "optimizer",
    args,
    devices=n,
    param_gb=param_bytes / 1e9,
    state_gb=state_bytes / 1e9,
    link_gbps=link,
    disk_duplex_gbps=disk,
    rows=rows,
  )


def table(doc: dict) -> str:
  link = doc["link_gbps"]
  head = (
    f"Adam over {doc['param_gb']:.2f} GB of float32 parameters, {doc['state_gb']:.2f} GB of state"
    + (f", sharded over {doc['devices']} devices" if doc.get("devices", 1) > 1 else "")
    + (
      f"; link {link['d2h']:.1f}/{link['h2d']:.1f} GB/s one way, "
      f"{link['duplex_d2h']:.1f}/{link['duplex_h2d']:.1f} both at once"
      + (
        f" (per GPU, mean of {link['gpus_at_once']} GPUs copying at once)"
        if link.get("gpus_at_once", 1) > 1
        else ""
      )
      if link
      else ""
    )
  )
  disk = doc.get("disk_duplex_gbps")
  if disk:
    head += (
      f"; store directory read and written at once (raw O_DIRECT, {disk['size'] / 1e9:.2f} GB "
      f"each way): {disk['each_way']:.2f} GB/s each way"
    )
  lines = [
    head,
    "",
    "| variant | step ms | x device | state GB/s each way (per device) | x two-way link or disk |",
    "|---|---|---|---|---|",
  ]
  for r in doc["rows"]:
    rate = f"{r['each_way_gbps']:.2f}" if "each_way_gbps" in r else "-"
    ratio = r.get("x_two_way_link", r.get("x_two_way_disk"))
    xl = f"{ratio:.2f}" if ratio is not None else "-"
    xd = f"{r['x_device']:.3f}" if r["x_device"] is not None else "-"
    lines.append(f"| {r['variant']} | {1e3 * r['step_s']:.1f} | {xd} | {rate} | {xl} |")
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> None:
  with bc.figure(plt, path, figsize=(6, 3)) as (_, ax):
    names = [r["variant"] for r in doc["rows"]]
    ax.barh(names, [1e3 * r["step_s"] for r in doc["rows"]])
    ax.set_xlabel("optimizer step, ms (median)")
    ax.set_title(f"Adam, {doc['state_gb']:.1f} GB of state")


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  if args.tiny:
    args.leaves, args.rows, args.cols, args.steps, args.warmup = 2, 300, 256, 2, 1
    args.chunk, args.min_bytes = 32 << 10, 4096
  doc = run(args)
  kind = bc.slug(jax.devices()[0].device_kind) + (f"_x{args.devices}" if args.devices > 1 else "")
  if any(r.get("timeline") for r in doc["rows"]):  # GPU copies (none on a CPU)
    bc.write_timelines(
      Path(args.out) / f"optimizer_timeline_{kind}.json",
      doc["rows"],
      lambda r: f"{r['variant']} {1e3 * r['step_s']:.1f} ms",
    )
  bc.write_bench(args.out, f"optimizer_{kind}", doc, table(doc), plot)
  return doc


if __name__ == "__main__":
  main()
