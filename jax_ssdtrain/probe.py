"""Store bandwidth probe: ``python -m jax_ssdtrain.probe DIR``.

Measures how fast the engine writes and reads a store directory (O_DIRECT where the
filesystem allows it, the engine's I/O threads, ``--size`` bytes in tensors of
``--tensor-size``), next to a raw O_DIRECT measurement of the same directory, then prints a
recommendation (I/O threads, host cache / read-ahead / host tier / staging sizes, bytes per
step that the store can move within ``--step-ms``) and the SSD wear of a plan (bytes written
per step x steps per day against the drive's rated endurance, ``--tbw`` or ``--dwpd`` and
``--capacity``).

    python -m jax_ssdtrain.probe /nvme/ssdtrain --step-ms 150 --bytes-per-step 1.2GB --tbw 1200
    python -m jax_ssdtrain.probe /dev/shm/x --bandwidth-cap 7GB/s --threads 8 --json

From Python, :func:`measure` returns a :class:`ProbeResult` (``write_gbps``, ``read_gbps``),
cached per directory (real path and device), size, threads, tensor size and cap in
``$XDG_CACHE_HOME/jax_ssdtrain/probe.json``; ``refresh=True`` measures again. The measurement
runs in a child process: the caller's store is left alone.

:func:`measure_disk_duplex` measures a directory reading and writing at once (plain O_DIRECT,
in this process, not cached): the load on a disk of a stream that reads one version of a state
while it writes the next, as ``offload_optimizer(location="nvme")`` does.

``python -m jax_ssdtrain.probe --link`` (and :func:`measure_link`) measures the PCIe link of a
GPU instead: pinned host <-> device copies, each direction alone and both at once, cached per
host, GPU model and size. The host tier moves its bytes over this link; the planner takes its
rate from here.
"""

# A thin CLI: the measurements live in jax_ssdtrain/_src/measure/ (one module per concern);
# this module re-exports their public names and parses, runs and prints them.

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from jax_ssdtrain._src.measure import disk as _disk
from jax_ssdtrain._src.measure.checks import positive
from jax_ssdtrain._src.measure.disk import (
  DEFAULT_SIZE,
  DEFAULT_TENSOR,
  DiskDuplexResult,
  ProbeResult,
  measure,
  measure_disk_duplex,
)
from jax_ssdtrain._src.measure.link import LinkResult, measure_link, measure_links
from jax_ssdtrain._src.measure.recommend import Recommendation, recommend
from jax_ssdtrain._src.measure.wear import Wear, wear
from jax_ssdtrain._src.options import GiB, MiB, parse_bandwidth, parse_size

__all__ = [
  "DiskDuplexResult",
  "LinkResult",
  "ProbeResult",
  "Recommendation",
  "Wear",
  "measure",
  "measure_disk_duplex",
  "measure_link",
  "measure_links",
  "recommend",
  "wear",
  "main",
]

# Importable from here as before the move (scripts/bench_emulated.py: stripe_directories).
RAW_BLOCK = _disk.RAW_BLOCK
stripe_directories = _disk.stripe_directories

# Keys of a plan JSON read by --plan (the first present wins; top level or one level down).
PLAN_BYTES_KEYS = (
  "disk_bytes_written_per_step",
  "nvme_bytes_per_step",
  "bytes_written_per_step",
  "offloaded_bytes_per_step",
)
PLAN_STEP_KEYS = ("predicted_step_ms", "step_ms")


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse_args(argv)
  if args.link:
    return _link_main(args)
  bytes_per_step, step_ms = args.bytes_per_step, args.step_ms
  try:
    if args.plan:
      plan_bytes, plan_ms = _read_plan(args.plan)
      bytes_per_step = bytes_per_step if bytes_per_step is not None else plan_bytes
      step_ms = step_ms if step_ms is not None else plan_ms
    results = [
      measure(
        args.directory,
        args.size,
        threads=t,
        tensor_bytes=args.tensor_size,
        bandwidth_cap=args.bandwidth_cap,
        raw=args.raw,
        refresh=args.refresh,
        stripes=args.stripes,
      )
      for t in args.threads
    ]
    rec = recommend(results, step_ms=step_ms, bytes_per_step=bytes_per_step)
    worn = None
    if bytes_per_step is not None and (step_ms is not None or args.steps_per_day is not None):
      worn = wear(
        bytes_per_step,
        step_ms=step_ms,
        steps_per_day=args.steps_per_day,
        tbw=args.tbw,
        dwpd=args.dwpd,
        capacity_bytes=args.capacity,
        warranty_years=args.warranty_years,
      )
  except (OSError, ValueError) as e:
    print(f"probe: error: {e}", file=sys.stderr)
    return 1
  if args.json:
    print(
      json.dumps(
        {
          "results": [dataclasses.asdict(r) for r in results],
          "recommendation": dataclasses.asdict(rec),
          "wear": dataclasses.asdict(worn) if worn else None,
          "step_ms": step_ms,
          "bytes_per_step": bytes_per_step,
        },
        indent=1,
      )
    )
  else:
    print(_report(results, rec, worn, step_ms))
  return 0


def _read_plan(path: str) -> tuple[int | None, float | None]:
  """Bytes written per step and step time (ms) of a plan JSON (PLAN_*_KEYS)."""
  try:
    doc = json.loads(Path(path).read_text())
  except OSError as e:
    raise OSError(e.errno, f"--plan {path!r}: {e.strerror}") from None
  except ValueError as e:
    raise ValueError(f"--plan {path!r} is not JSON: {e}") from None
  scopes = [doc] + [v for v in doc.values() if isinstance(v, dict)] if isinstance(doc, dict) else []
  pick = lambda keys: next((s[k] for s in scopes for k in keys if k in s), None)  # noqa: E731
  nbytes, step_ms = pick(PLAN_BYTES_KEYS), pick(PLAN_STEP_KEYS)
  if nbytes is None:
    raise ValueError(
      f"--plan {path!r}: none of the keys {list(PLAN_BYTES_KEYS)} (top level or one level down)"
    )
  positive(f"--plan {path!r}: bytes per step", nbytes, zero=True)
  if step_ms is not None:
    positive(f"--plan {path!r}: step_ms", step_ms)
  return int(nbytes), step_ms


def _fmt_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _report(
  results: Sequence[ProbeResult], rec: Recommendation, worn: Wear | None, step_ms: float | None
) -> str:
  r0 = results[0]
  lines = [
    f"store {r0.directory} (device {r0.device}), {r0.size / GiB:.2f} GiB in "
    f"{r0.tensor_bytes // MiB} MiB tensors, backend {r0.backend}, "
    f"O_DIRECT {'on' if r0.o_direct else 'off'}"
    + (f", cap {r0.bandwidth_cap / 1e9:.2f} GB/s" if r0.bandwidth_cap else ""),
    "",
  ]
  head = (
    "threads",
    "write GB/s",
    "read GB/s",
    "engine busy w/r",
    "raw write",
    "raw read",
    "cached",
  )
  rows = [
    (
      str(r.threads),
      f"{r.write_gbps:.2f}",
      f"{r.read_gbps:.2f}",
      f"{r.engine_write_gbps:.2f}/{r.engine_read_gbps:.2f}",
      "-" if r.raw_write_gbps is None else f"{r.raw_write_gbps:.2f}",
      "-" if r.raw_read_gbps is None else f"{r.raw_read_gbps:.2f}",
      "yes" if r.cached else "no",
    )
    for r in results
  ]
  widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
  lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [head] + rows]
  lines += [
    "",
    "recommended settings:",
    f"  io_threads       {rec.io_threads}",
    f"  host_cache_bytes {_fmt_bytes(rec.host_cache_bytes)}",
    f"  prefetch_bytes   {_fmt_bytes(rec.prefetch_bytes)}",
    f"  host_tier_bytes  {_fmt_bytes(rec.host_tier_bytes)}",
    f"  staging_bytes    {_fmt_bytes(rec.staging_bytes)}",
  ]
  if rec.fit_bytes_per_step is not None:
    lines.append(
      f"  fits per step    {rec.fit_bytes_per_step / 1e9:.2f} GB written and read "
      f"back in {step_ms:g} ms (at {rec.write_gbps:.2f} / {rec.read_gbps:.2f} GB/s)"
    )
  else:
    lines.append("  fits per step    (give --step-ms)")
  lines += [f"  note: {n}" for n in rec.notes]
  if worn is not None:
    lines += [
      "",
      "SSD wear:",
      f"  {worn.bytes_per_step / 1e9:.3f} GB written per step x "
      f"{worn.steps_per_day:,.0f} steps/day = {worn.tb_per_day:.2f} TB/day",
    ]
    if worn.drive_writes_per_day is not None:
      lines.append(f"  {worn.drive_writes_per_day:.2f} drive writes per day")
    if worn.rated_tbw is not None:
      days = worn.days_to_rated
      when = "never" if math.isinf(days) else f"{days:,.0f} days ({days / 365:.1f} years)"
      lines.append(f"  rated endurance {worn.rated_tbw:,.0f} TBW reached in {when}")
    else:
      lines.append("  (give --tbw, or --dwpd and --capacity, for days to rated endurance)")
  return "\n".join(lines)


def _add_parsed(p: argparse.ArgumentParser, flag: str, parse, **kw) -> None:
  """Option ``flag`` read with ``parse`` (parse_size / parse_bandwidth), its errors naming it."""

  def convert(text: str):
    try:
      return parse(text, what=flag)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None

  p.add_argument(flag, type=convert, **kw)


def _threads(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or any(not 1 <= v <= 256 for v in values):
    raise argparse.ArgumentTypeError(
      f"--threads: expected integers in [1, 256] separated by commas, got {text!r}"
    )
  return sorted(set(values))


def _number(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value <= 0:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
  return value


def _link_main(args) -> int:
  size = args.size if args.size != DEFAULT_SIZE else 1 * GiB
  try:
    r = measure_link(args.device, size, host=args.host_memory, refresh=args.refresh)
  except (OSError, ValueError) as e:
    print(f"probe: error: {e}", file=sys.stderr)
    return 1
  if args.json:
    print(json.dumps(dataclasses.asdict(r)))  # one line: bench_rok.py reads it
  else:
    print(
      f"GPU {r.device} ({r.device_kind}), pinned copies of {_fmt_bytes(r.size)} "
      f"({r.host} host memory)"
      f"{' (cached)' if r.cached else ''}:\n"
      f"  device -> host {r.d2h_gbps:6.1f} GB/s alone, {r.duplex_d2h_gbps:6.1f} while both run\n"
      f"  host -> device {r.h2d_gbps:6.1f} GB/s alone, {r.duplex_h2d_gbps:6.1f} while both run"
    )
  return 0


def _plain(doc: str) -> str:
  """A docstring as plain text for --help (no reStructuredText roles or literals)."""
  doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
  return doc.replace("``", "")


def _parse_args(argv):
  p = argparse.ArgumentParser(
    prog="python -m jax_ssdtrain.probe",
    description=_plain(__doc__),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument(
    "directory",
    nargs="?",
    help="store directory to measure (created, private, if it does not exist)",
  )
  _add_parsed(
    p,
    "--size",
    parse_size,
    default=DEFAULT_SIZE,
    help="bytes written and read per measurement (default 4GiB)",
  )
  p.add_argument(
    "--threads",
    type=_threads,
    default=[4, 8, 16],
    help="engine I/O thread counts to try (default 4,8,16)",
  )
  _add_parsed(
    p,
    "--tensor-size",
    parse_size,
    default=DEFAULT_TENSOR,
    help="size of one stored tensor (default 64MiB)",
  )
  _add_parsed(
    p,
    "--bandwidth-cap",
    parse_bandwidth,
    default=None,
    help="measure the store capped at this rate (e.g. 7GB/s: emulation)",
  )
  p.add_argument(
    "--raw",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also measure raw O_DIRECT pwrite/pread (default on)",
  )
  p.add_argument(
    "--stripes",
    type=int,
    default=1,
    help="stripe the engine's bytes over N files in DIR/stripe<i> (RAM stores)",
  )
  p.add_argument("--refresh", action="store_true", help="measure again (ignore the cache)")
  p.add_argument("--step-ms", type=_number, help="training step time, ms")
  _add_parsed(
    p,
    "--bytes-per-step",
    parse_size,
    help="bytes written to the store per step (e.g. 1.2GB)",
  )
  p.add_argument(
    "--plan",
    help=f"plan JSON giving one of {', '.join(PLAN_BYTES_KEYS)} (and "
    f"optionally {' or '.join(PLAN_STEP_KEYS)})",
  )
  p.add_argument("--steps-per-day", type=_number, help="default: 86400 s / step time")
  p.add_argument("--tbw", type=_number, help="drive's rated endurance, TB written")
  p.add_argument("--dwpd", type=_number, help="drive's rated drive writes per day")
  _add_parsed(
    p,
    "--capacity",
    parse_size,
    help="drive capacity (with --dwpd), e.g. 3.84TB",
  )
  p.add_argument("--warranty-years", type=_number, default=5.0)
  p.add_argument("--json", action="store_true", help="print JSON instead of the table")
  p.add_argument(
    "--link",
    action="store_true",
    help="measure the PCIe link of a GPU (pinned host <-> device) instead of a "
    "directory (--size default 1GiB)",
  )
  p.add_argument("--device", type=int, default=0, help="CUDA ordinal for --link (default 0)")
  p.add_argument(
    "--host-memory",
    default="registered",
    choices=["registered", "alloc", "registered_hugepages"],
    help="--link: host buffers registered as the engine's arenas (default), "
    "cudaHostAlloc'ed, or registered on huge pages",
  )
  args = p.parse_args(argv)
  if args.link and args.directory:
    p.error("--link measures a GPU's link, not a directory: give one or the other")
  if not args.link and not args.directory:
    p.error("the store DIRECTORY to measure is required (or --link)")
  if args.tbw is not None and args.dwpd is not None:
    p.error("give --tbw or --dwpd, not both")
  if args.dwpd is not None and args.capacity is None:
    p.error("--dwpd needs --capacity")
  return args


if __name__ == "__main__":
  sys.exit(main())
