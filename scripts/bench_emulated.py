"""ROK curves for faster arrays, emulated: step time and model TFLOP/s against offloaded bytes
per step, for stores on RAM (``/dev/shm``) capped at 7, 14 and 28 GB/s per direction
(``bandwidth_cap``), and the real disk uncapped.

The points are the ``ssd_nvme_sweep_*`` policies of the benchmarks' stack (growing subsets of
the tags sent to the store, the rest saved on the device; host cache of ``--sweep-host-cache`` so
that the store is really used), each in a process of its own through
``scripts.bench_rok.run_policy``; the
``selective`` policy (nothing offloaded) is the baseline. Each store is probed first
(``jax_ssdtrain.probe``, through the engine, with its cap). Writes ``emulated_<device>_<date>
.json``, a table and a PNG to ``--out``. ``--budget-s`` skips the points left when the run
has taken that long (default 330 s, so that the run ends within about 6 minutes).

    python -m scripts.bench_emulated          # 4096,2048,4,8; sweep 2,3,4; 7/14/28 GB/s; disk
    python -m scripts.bench_emulated --caps 7,28 --points 2,4 --no-disk
    python -m scripts.bench_emulated --tiny --caps 0.02 --points 4 --no-disk --no-probe  # CPU smoke
    python -m scripts.bench_emulated --replot benchmarks/emulated.json   # table and plot again
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as common
from scripts import bench_rok

DEFAULT_SHAPE = (4096, 2048, 4, 8)
DEFAULT_CAPS = (7.0, 14.0, 28.0)  # GB/s
DEFAULT_POINTS = (2, 3, 4)  # ssd_nvme_sweep_K; 1 adds a point below the 7 GB/s knee
BASELINE = "selective"


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.replot:  # each JSON again, in place
    for path in args.replot:
      common.replot([path], args.out, "emulated", report, keys=(), field="rows")
    return 0
  t_start = time.perf_counter()
  made = []
  shm_dir = args.shm_dir or tempfile.mkdtemp(prefix="jax_ssdtrain-emul-", dir="/dev/shm")
  disk_dir = args.disk_dir or os.environ.get("SSDTRAIN_DIR", "").split(":")[0] or None
  if disk_dir is None and not args.no_disk:
    disk_dir = tempfile.mkdtemp(prefix="bench_emulated-", dir="/tmp")
    made.append(disk_dir)
  if not args.shm_dir:
    made.append(shm_dir)
  stores = [
    {"store": f"shm_{cap:g}GBps", "dir": shm_dir, "cap_GBps": cap, "stripes": args.stripes}
    for cap in args.caps
  ]
  if not args.no_disk:
    stores.append({"store": "disk", "dir": disk_dir, "cap_GBps": None, "stripes": 1})
  rows = []
  try:
    for d in {s["dir"] for s in stores}:
      os.makedirs(d, exist_ok=True)
    check_space(args, shm_dir)
    for s in stores:
      s["probe"] = probe(args, s)
    base_args = rok_args(args, None)
    rows.append(row_of(bench_rok.run_policy(base_args, BASELINE, args.shape, shm_dir, rows), None))
    for s in stores:
      run_args = rok_args(args, s["cap_GBps"])
      for k in args.points:
        name = f"ssd_nvme_sweep_{k}"
        if time.perf_counter() - t_start > args.budget_s:
          rows.append(
            row_of(
              {"policy": name, "error": f"skipped: --budget-s {args.budget_s:g} s spent"},
              s,
              args.shape,
            )
          )
          continue
        rows.append(
          row_of(bench_rok.run_policy(run_args, name, args.shape, store_dirs(s), rows), s)
        )
  finally:
    for d in made:
      shutil.rmtree(d, ignore_errors=True)
  device = common.device_kind(rows)
  env = common.host_env() | {
    "device_kind": device,
    "platform": next((r["platform"] for r in rows if "platform" in r), None),
  }
  doc = {
    "date": common.today(),
    "env": env,
    "shape": list(args.shape),
    "stores": [{k: v for k, v in s.items()} for s in stores],
    "rows": rows,
    "wall_s": time.perf_counter() - t_start,
    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
  }
  args.out.mkdir(parents=True, exist_ok=True)
  report(doc, args.out / f"emulated_{common.slug(device)}_{doc['date']}")
  bad = [
    f"{r.get('store')} {r.get('policy')}: {r['error']}"
    for r in rows
    if "error" in r and not str(r["error"]).startswith("skipped")
  ]
  for line in bad:
    print(f"FAIL {line}", file=sys.stderr)
  return 1 if bad else 0


def store_dirs(store: dict) -> list[str]:
  """The store's directories: ``stripes`` subdirectories (one engine file each) of a RAM
  store, since tmpfs serialises the writes to one file (its inode lock); the probe measures
  the same layout (``jax_ssdtrain.probe.stripe_directories``)."""
  from jax_ssdtrain.probe import stripe_directories

  dirs = stripe_directories(store["dir"], store.get("stripes", 1))
  for d in dirs:
    os.makedirs(d, exist_ok=True)
  return dirs


def rok_args(args, cap_gbps: float | None):
  """bench_rok's options for one store (its child runs the policy)."""
  argv = [
    "--steps",
    str(args.steps),
    "--warmup",
    str(args.warmup),
    "--check" if args.check else "--no-check",
    "--no-probe",
    "--child-timeout",
    str(args.child_timeout),
  ]
  if args.tiny:
    argv.append("--tiny")
  argv += ["--shape", ",".join(map(str, args.shape))]
  if args.sweep_host_cache:
    argv += ["--sweep-host-cache", args.sweep_host_cache]
  if args.min_bytes is not None:
    argv += ["--min-bytes", str(args.min_bytes)]
  options = list(args.ssd)
  if cap_gbps is not None:
    options.append(f"bandwidth_cap={int(cap_gbps * 1e9)}")
  for opt in options:
    argv += ["--ssd", opt]
  return bench_rok.parse_args(argv)


def check_space(args, shm_dir: str) -> None:
  """The RAM store must hold a step's offload (slots are reused across steps) and the probe."""
  from jax_ssdtrain import parse_size  # imports JAX; starts no backend

  min_bytes = args.min_bytes if args.min_bytes is not None else (0 if args.tiny else 1 << 20)
  step = max(
    common.offload_bytes(common.POLICIES[f"ssd_nvme_sweep_{k}"], *args.shape, min_bytes)
    for k in args.points
  )
  probe_bytes = 0 if args.no_probe else parse_size(args.probe_size, what="--probe-size")
  need = int(1.25 * step) + probe_bytes
  free = shutil.disk_usage(shm_dir).free
  if free < need:
    raise SystemExit(
      f"bench_emulated: {shm_dir} has {free / 2**30:.1f} GiB free, the RAM "
      f"store needs about {need / 2**30:.1f} GiB: give --shm-dir on a larger "
      f"tmpfs, or fewer --points"
    )


def _io_threads(args) -> int:
  """The engine's I/O threads in the runs (--ssd io_threads=N, else the default 8)."""
  for opt in args.ssd:
    key, _, value = opt.partition("=")
    if key.strip() == "io_threads" and value.strip().isdigit():
      return int(value)
  return 8


def probe(args, store: dict) -> dict:
  """The store's bandwidth through the engine, with its cap (jax_ssdtrain.probe)."""
  if args.no_probe:
    return {"note": "--no-probe"}
  from jax_ssdtrain import probe as ssd_probe  # its worker is a child process

  cap = int(store["cap_GBps"] * 1e9) if store["cap_GBps"] else None
  try:
    r = ssd_probe.measure(
      store["dir"],
      args.probe_size,
      threads=_io_threads(args),
      bandwidth_cap=cap,
      stripes=store.get("stripes", 1),
      refresh=True,
    )
  except (OSError, ValueError) as e:
    return {"note": f"probe failed: {e}"}
  print(
    f"probe {store['store']}: write {r.write_gbps:.2f} GB/s, read {r.read_gbps:.2f} GB/s",
    flush=True,
  )
  return {
    "write_GBps": r.write_gbps,
    "read_GBps": r.read_gbps,
    "size": r.size,
    "o_direct": r.o_direct,
  }


def row_of(row: dict, store: dict | None, shape=None) -> dict:
  if shape is not None:
    row |= dict(zip(("H", "S", "B", "L"), shape))
  if store is None:
    return row | {"store": "none", "cap_GBps": None}
  return row | {"store": store["store"], "cap_GBps": store["cap_GBps"], "store_dir": store["dir"]}


def _ok(row) -> bool:
  return "error" not in row and bool(row.get("step_ms_median"))


def _offloaded(row) -> float:
  return row.get("offload_GB_per_step") or row.get("expected_offload_GB_per_step") or 0.0


def table(doc: dict) -> str:
  base = next((r for r in doc["rows"] if r.get("policy") == BASELINE and _ok(r)), None)
  head = (
    "store",
    "cap GB/s",
    "policy",
    "offload GB/step",
    "step ms",
    "x sel",
    "TFLOP/s",
    "temp GB",
    "disk MB/step w/r",
    "stall ms",
    "engine w/r GB/s",
  )
  lines = []
  for r in doc["rows"]:
    if not _ok(r):
      lines.append(
        (
          r.get("store", "?"),
          _fmt(r.get("cap_GBps"), "{:g}"),
          r.get("policy", "?"),
          f"ERROR: {r.get('error', '?')}",
        )
      )
      continue
    engine = "engine" in r
    lines.append(
      (
        r["store"],
        _fmt(r.get("cap_GBps"), "{:g}"),
        r["policy"],
        f"{_offloaded(r):.3f}",
        f"{r['step_ms_median']:.1f}",
        _fmt(r["step_ms_median"] / base["step_ms_median"] if base else None, "{:.3f}"),
        f"{r['model_tflops']:.1f}",
        _fmt(r.get("temp_GB")),
        f"{r['disk_MB_written_per_step']:.0f}/{r['disk_MB_read_per_step']:.0f}" if engine else "-",
        _fmt(r.get("stall_ms_per_step"), "{:.1f}") if engine else "-",
        f"{r['write_GBps']:.2f}/{r['read_GBps']:.2f}" if engine else "-",
      )
    )
  widths = [
    max(len(str(x[i])) for x in [head] + [ln for ln in lines if len(ln) > i])
    for i in range(len(head))
  ]
  fmt = lambda ln: "  ".join(str(v).ljust(w) for v, w in zip(ln, widths)).rstrip()  # noqa: E731
  foot = [
    f"probe {s['store']}: write {s['probe']['write_GBps']:.2f} GB/s, read "
    f"{s['probe']['read_GBps']:.2f} GB/s"
    if (s.get("probe") or {}).get("write_GBps")
    else f"probe {s['store']}: {(s.get('probe') or {}).get('note', 'not run')}"
    for s in doc.get("stores", [])
  ]
  return "\n".join([fmt(head)] + [fmt(ln) for ln in lines] + foot)


def _fmt(v, spec="{:.2f}"):
  return "-" if v is None else spec.format(v)


def plot(plt, doc: dict, path: Path) -> str | None:
  """Left: step time vs offloaded GB/step, one line per store; right: model TFLOP/s."""
  rows = [r for r in doc["rows"] if _ok(r)]
  if not rows:
    return "no plot: no successful rows"
  base = next((r for r in rows if r["policy"] == BASELINE), None)
  with common.figure(plt, path, 1, 2, figsize=(13, 5), dpi=110) as (fig, (ax_ms, ax_tf)):
    for s in doc.get("stores", []):
      pts = sorted((r for r in rows if r.get("store") == s["store"]), key=_offloaded)
      if base:
        pts = [base] + pts
      if not pts:
        continue
      xs = [_offloaded(r) if r is not base else 0.0 for r in pts]
      label = s["store"] + (
        f" (probe w/r {s['probe']['write_GBps']:.3g}/{s['probe']['read_GBps']:.3g} GB/s)"
        if (s.get("probe") or {}).get("write_GBps")
        else ""
      )
      (line,) = ax_ms.plot(xs, [r["step_ms_median"] for r in pts], "o-", label=label)
      ax_tf.plot(xs, [r["model_tflops"] for r in pts], "o-", color=line.get_color(), label=label)
      w = (s.get("probe") or {}).get("write_GBps")
      knee = w * base["step_ms_median"] / 1e3 if w and base else None
      if knee and knee <= 1.2 * max(xs):  # what the store writes in one baseline step
        ax_ms.axvline(knee, color=line.get_color(), ls=":", lw=0.8)
    if base:
      ax_ms.axhline(
        base["step_ms_median"],
        color="k",
        lw=0.6,
        ls="--",
        label=f"{BASELINE} {base['step_ms_median']:.0f} ms",
      )
      ax_tf.axhline(base["model_tflops"], color="k", lw=0.6, ls="--", label=BASELINE)
    shape = ",".join(map(str, doc.get("shape", [])))
    ax_ms.set(
      xlabel="offloaded GB per step",
      ylabel="step time (ms, median)",
      title=f"step time vs offload, H,S,B,L = {shape} (dotted: probe write x {BASELINE} step)",
    )
    ax_tf.set(
      xlabel="offloaded GB per step", ylabel="model TFLOP/s", title="model TFLOP/s vs offload"
    )
    for ax in (ax_ms, ax_tf):
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7, loc="best")
    env = doc.get("env", {})
    fig.suptitle(
      f"emulated arrays (RAM store + bandwidth_cap)  {env.get('device_kind')}  "
      f"jax {env.get('jax')}  {doc.get('date')}",
      fontsize=9,
    )
  return None


def report(doc: dict, stem: Path) -> None:
  common.write_results(stem, doc, table(doc), plot)
  print(f"wrote {stem}.json")


def _caps(text: str):
  try:
    caps = tuple(float(v) for v in text.split(",") if v.strip())
  except ValueError:
    caps = ()
  if not caps or min(caps) <= 0:
    raise argparse.ArgumentTypeError(
      f"expected positive GB/s values separated by commas, got {text!r}"
    )
  return caps


def _points(text: str):
  try:
    points = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
  except ValueError:
    points = ()
  if not points or not set(points) <= set(range(1, len(common.SWEEP) + 1)):
    raise argparse.ArgumentTypeError(
      f"expected sweep points among 1..{len(common.SWEEP)} separated by commas, got {text!r}"
    )
  return points


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--shape",
    type=common.parse_shape,
    default=None,
    help="H,S,B,L (default 4096,2048,4,8; --tiny: 256,128,2,2)",
  )
  p.add_argument("--tiny", action="store_true", help="CPU smoke preset (bench_rok's --tiny)")
  p.add_argument(
    "--caps",
    type=_caps,
    default=DEFAULT_CAPS,
    help="bandwidth caps of the RAM store, GB/s (default 7,14,28)",
  )
  p.add_argument(
    "--points",
    type=_points,
    default=DEFAULT_POINTS,
    help="ssd_nvme_sweep_K points (default 2,3,4): "
    + "; ".join(f"{k}: {'+'.join(s)}" for k, s in enumerate(common.SWEEP, 1)),
  )
  p.add_argument(
    "--stripes",
    type=int,
    default=8,
    help="files (subdirectories) the RAM store is striped over (default 8)",
  )
  p.add_argument(
    "--shm-dir", default=None, help="RAM-backed store directory (default: a new dir under /dev/shm)"
  )
  p.add_argument(
    "--disk-dir",
    default=None,
    help="real-disk store (default: $SSDTRAIN_DIR, else a temp dir under /tmp)",
  )
  p.add_argument("--no-disk", action="store_true", help="skip the uncapped real-disk curve")
  p.add_argument("--steps", type=int, default=10, help="timed steps per point (default 10)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument(
    "--check",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="bench_rok's correctness check for each point (default off: time)",
  )
  p.add_argument(
    "--sweep-host-cache",
    default=None,
    help="host cache of the sweep policies (bench_rok's default: 512MiB)",
  )
  p.add_argument("--min-bytes", type=int, default=None)
  p.add_argument(
    "--ssd",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="ssd.configure option for every store, e.g. io_threads=16",
  )
  p.add_argument("--probe-size", default="1GiB", help="bytes per store probe (default 1GiB)")
  p.add_argument("--no-probe", action="store_true")
  p.add_argument(
    "--budget-s",
    type=float,
    default=330,
    help="skip the points left once the run has taken this long (default 330)",
  )
  p.add_argument("--child-timeout", type=float, default=300)
  common.add_out_option(p)
  p.add_argument(
    "--replot", type=Path, nargs="+", metavar="JSON", help="table and plot of saved JSON(s) again"
  )
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 1:
    p.error("--steps and --warmup must be >= 1")
  if args.shape is None:
    args.shape = common.TINY_SHAPES[0] if args.tiny else DEFAULT_SHAPE
  for opt in args.ssd:
    if "=" not in opt:
      p.error(f"--ssd: expected KEY=VALUE, got {opt!r}")
  return args


if __name__ == "__main__":
  sys.exit(main())
