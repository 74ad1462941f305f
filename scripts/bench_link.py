"""The PCIe link next to running kernels: what a plain pinned copy reaches while the GPU computes.

    python -m scripts.bench_link [--out DIR] [--size 1GiB] [--repeats 10] [--load-s 2]

The engine's host-tier copies run next to the step's kernels. This measures the reference they
should be held to: ``cudaMemcpyAsync`` between registered host memory (as the engine's arenas)
and the device, on streams of its own (``jax_ssdtrain.probe.measure_link``'s copies), first on
an idle GPU, then while a jitted loop keeps the GPU busy:

- ``idle``: nothing else runs;
- ``matmul``: bf16 8192x8192 matmuls back to back (compute-bound, as a transformer's layers);
- ``hbm``: an elementwise update of a 4 GiB array (bound by device memory bandwidth).

Each loaded row dispatches the loop (sized to run ``--load-s`` seconds alone) once the copies'
buffers are ready (``probe_link``'s ``on_ready``: allocating pinned and device memory may wait
for running kernels), and checks that the loop was still running when the last copy ended (else
the row is marked ``overlap: false`` and the script exits 1). Writes
OUT/link_load_<device>_<date>.json, .md and .png (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from scripts import bench_common

LOADS = ("idle", "matmul", "hbm")


UNROLL = 8  # body applications per dispatched call


def _load_fn(kind: str):
  """(jitted fn(state) -> state applying the body UNROLL times, its initial state). Many calls
  are dispatched back to back from a thread of their own: a loop with a dynamic trip count
  would make XLA read its condition back on every iteration, and the runtime bounds the calls
  in flight, so that dispatching blocks until the work is nearly done."""
  import jax
  import jax.numpy as jnp

  if kind == "matmul":
    a = jnp.ones((8192, 8192), jnp.bfloat16) * 1e-3

    def body(x):
      return jnp.dot(x, a, preferred_element_type=jnp.bfloat16)

    state = a
  elif kind == "hbm":
    state = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB

    def body(x):
      return x * 0.999 + 1e-3
  else:
    raise ValueError(f"load: expected one of {LOADS[1:]}, got {kind!r}")

  @jax.jit
  def run(x):
    for _ in range(UNROLL):
      x = jax.lax.optimization_barrier(body(x))  # one kernel per application, not one fused
    return x

  return run, state


def _dispatch(run, state, calls: int):
  for _ in range(calls):
    state = run(state)
  return state


def measure(size: int, repeats: int, load_s: float) -> list[dict]:
  import jax

  from jax_ssdtrain._src import native

  rows = []
  for kind in LOADS:
    row = {"load": kind}
    if kind == "idle":
      rates = native.probe_link(0, size, repeats, "registered")
      row.update(copy_s=rates.copy_seconds, overlap=None)
    else:
      run, state = _load_fn(kind)
      jax.block_until_ready(_dispatch(run, state, 2))  # compile, warm up
      t0 = time.perf_counter()
      jax.block_until_ready(_dispatch(run, state, 10))
      calls = max(10, int(load_s / ((time.perf_counter() - t0) / 10)))
      t0 = time.perf_counter()
      jax.block_until_ready(_dispatch(run, state, calls))
      alone = time.perf_counter() - t0
      started = {}

      def dispatch():
        started["out"] = _dispatch(run, state, calls)
        started["dispatched"] = time.perf_counter() - started["t"]

      def start_loop():
        # Dispatch from a thread and let the kernels start before the first copy.
        started["t"] = time.perf_counter()
        started["thread"] = threading.Thread(target=dispatch, daemon=True)
        started["thread"].start()
        time.sleep(min(0.1, alone / 10))
        started["copies_from"] = time.perf_counter()

      rates = native.probe_link(0, size, repeats, "registered", on_ready=start_loop)
      started["thread"].join()
      jax.block_until_ready(started["out"])
      loaded = time.perf_counter() - started["t"]
      copies_end = started["copies_from"] - started["t"] + rates.copy_seconds
      row.update(
        calls=calls,
        unroll=UNROLL,
        load_s_alone=alone,
        load_s_with_copies=loaded,
        dispatch_s=started["dispatched"],
        copy_s=rates.copy_seconds,
        copies_end_s=copies_end,
        overlap=copies_end < min(alone, loaded),
      )
    d2h, h2d, dd2h, dh2d = rates[:4]
    row.update(d2h_GBps=d2h, h2d_GBps=h2d, duplex_d2h_GBps=dd2h, duplex_h2d_GBps=dh2d)
    rows.append(row)
    print(
      f"{kind:7s} D2H {d2h:6.1f}  H2D {h2d:6.1f}  both {dd2h:6.1f} / {dh2d:6.1f} GB/s"
      + (
        f"  (loop {row['load_s_alone']:.2f} s alone, {row['load_s_with_copies']:.2f} s with "
        f"the copies, dispatched in {row['dispatch_s']:.2f} s; copies "
        f"{row['copies_end_s'] - row['copy_s']:.2f}-{row['copies_end_s']:.2f} s)"
        if kind != "idle"
        else ""
      ),
      flush=True,
    )
  return rows


def table(rows: list[dict]) -> str:
  idle = rows[0]
  lines = [
    "| GPU running | D2H GB/s | H2D GB/s | both: D2H / H2D GB/s | D2H × idle | H2D × idle | "
    "copies within the loop |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['load']} | {r['d2h_GBps']:.1f} | {r['h2d_GBps']:.1f} | "
      f"{r['duplex_d2h_GBps']:.1f} / {r['duplex_h2d_GBps']:.1f} | "
      f"{r['d2h_GBps'] / idle['d2h_GBps']:.2f} | {r['h2d_GBps'] / idle['h2d_GBps']:.2f} | "
      f"{'–' if r['overlap'] is None else ('yes' if r['overlap'] else 'NO')} |"
    )
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> None:
  rows = doc["rows"]
  keys = ("d2h_GBps", "h2d_GBps", "duplex_d2h_GBps", "duplex_h2d_GBps")
  labels = ("D2H", "H2D", "D2H (both)", "H2D (both)")
  with bench_common.figure(plt, path, figsize=(7, 4), dpi=120) as (_, ax):
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
      xs = [k + i * width for k in range(len(keys))]
      ax.bar(xs, [r[k] for k in keys], width, label=r["load"])
    ax.set_xticks([k + width * (len(rows) - 1) / 2 for k in range(len(keys))], labels)
    ax.set_ylabel("GB/s (pinned, registered host memory)")
    ax.set_title("PCIe copies next to running kernels")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--size", default="1GiB", help="bytes per copy (size suffixes accepted)")
  p.add_argument("--repeats", type=int, default=10, help="copies per direction (median)")
  p.add_argument(
    "--load-s",
    type=float,
    default=2.0,
    help="seconds the loaded loops run alone (the copies must fit inside)",
  )
  bench_common.add_out_option(p)
  args = p.parse_args(argv)
  from jax_ssdtrain import parse_size

  try:
    size = parse_size(args.size, what="--size")
  except ValueError as e:
    p.error(str(e))
  if args.repeats < 1 or args.load_s <= 0:
    p.error("--repeats and --load-s must be positive")
  import jax

  if jax.default_backend() != "gpu":
    print("bench_link: needs a GPU (the copies are CUDA's)", file=sys.stderr)
    return 2
  rows = measure(size, args.repeats, args.load_s)
  device = str(jax.devices()[0].device_kind)
  args.out.mkdir(parents=True, exist_ok=True)
  stem = args.out / f"link_load_{bench_common.slug(device)}_{bench_common.today()}"
  doc = {
    "date": bench_common.today(),
    "env": bench_common.host_env(),
    "device": device,
    "size": size,
    "repeats": args.repeats,
    "rows": rows,
    "loaded_over_idle_median": statistics.median(
      r[k] / rows[0][k] for r in rows[1:] for k in ("d2h_GBps", "h2d_GBps")
    ),
  }
  bench_common.write_results(stem, doc, table(rows), plot)
  return 0 if all(r["overlap"] is not False for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
