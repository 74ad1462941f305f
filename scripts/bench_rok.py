"""ROK benchmark (Runtime / Offload / Keep): step time against device memory, per policy.

A GPT-like block stack (bf16, heads of 128, ``lax.scan`` over layers; tags ``layer_in``,
``qkv``, ``attn``, ``mlp_up``) is trained under JAX's own policies (keep, recompute,
selective, JAX pinned-host offload) and jax_ssdtrain's (host tier, NVMe, and a sweep that sends
growing subsets of the tags to NVMe, the rest saved on the device as in ``selective``). Each
policy runs in a process of its own, so the peak memory is that policy's alone; this process
only orchestrates, probes the store directory's raw bandwidth, and writes
``rok_<device>_<date>.json``, a table and a ROK plot (PNG) to ``--out``. The stack and the
policies are ``scripts.bench_common``'s; ``run_policy`` (one policy in its own processes) is
also what ``scripts.bench_emulated`` runs. From the repository root:

    python -m scripts.bench_rok                        # 4096,2048,4,8 and 8192,2048,2,4, every policy
    python -m scripts.bench_rok --shape 4096,2048,4,8 --policies 'selective,ssd_nvme_sweep_*'
    python -m scripts.bench_rok --merge ...            # add rows to today's JSON in --out
    python -m scripts.bench_rok --tiny --steps 2 --no-probe      # CPU smoke
    python -m scripts.bench_rok --replot a.json b.json --out DIR  # runs merged: table and plot

Policies: keep, recompute, selective (save the 4 tags), jax_host_layer_in, jax_host_named
(JAX ``save_and_offload_only_these_names`` to pinned_host), ssd_host_named, ssd_nvme_named,
ssd_host_layer_in and ssd_nvme_layer_in (the rest recomputed), ssd_nvme_sweep_1..4 (host cache of
``--sweep-host-cache`` so that the disk is really used). An ssd policy takes store options of its
own after colons, e.g. ``ssd_host_named:staging_bytes=1GiB:forwarding=0`` (a row of its own).

``--link-probe`` measures the GPU's PCIe link in the same run (``jax_ssdtrain.probe --link``)
and the table puts the link rates the engine achieved (bytes over the copy streams' busy time,
from CUDA events) beside it. ``--timeline`` writes one timed step's device copies and waits
of every ssd row as a Chrome trace (``rok_timeline_<device>_<date>.json``: chrome://tracing or
https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as common
from scripts.bench_common import HEAD_DIM, POLICIES, make_step, model_flops, offload_bytes

DEFAULT_SHAPES, TINY_SHAPES = common.DEFAULT_SHAPES, common.TINY_SHAPES


# ---------------------------------------------------------------------------------------------
# Child: one policy, one shape, one JSON line


def _compare_fn():
  """jit(a, b, ref) -> (a bitwise equal to b, max over leaves of max|a - ref| / max|ref|)."""
  import jax
  import jax.numpy as jnp

  def bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))

  def compare(a, b, ref):
    la, lb, lr = (jax.tree.leaves(t) for t in (a, b, ref))
    same = jnp.all(jnp.stack([jnp.array_equal(bits(x), bits(y)) for x, y in zip(la, lb)]))
    rel = [
      jnp.max(jnp.abs(x.astype(jnp.float32) - r.astype(jnp.float32)))
      / jnp.maximum(jnp.max(jnp.abs(r.astype(jnp.float32))), 1e-30)
      for x, r in zip(la, lr)
    ]
    rel = jnp.max(jnp.stack(rel))
    return same, jnp.where(jnp.isnan(rel), jnp.inf, rel)

  return jax.jit(compare)


def run_check(step, reference, params, shape, cfg: dict) -> dict:
  """Fresh inputs, each twice through ``step`` (bitwise equal?) and once through ``reference``
  (selective). A race shows up as repeats that differ or an error that moves from step to
  step. ``cfg["check_steps"]`` inputs, fewer (>= 3) if that would exceed
  ``cfg["check_budget_s"]`` at the timed step times."""
  import jax
  import jax.numpy as jnp

  H, S, B, L = shape
  per_input = (2 * cfg["step_ms"] + cfg["selective_ms"]) / 1e3
  n = max(3, min(cfg["check_steps"], int(cfg["check_budget_s"] / max(per_input, 1e-9))))
  compare = _compare_fn()
  identical, ref_deterministic, rels = True, True, []
  for i in range(n):
    x = jax.random.normal(jax.random.key(1000 + i), (B, S, H), jnp.bfloat16)
    a = step(params, x)
    b = step(params, x)
    r = reference(params, x)
    same, rel = (v.item() for v in compare(a, b, r))
    rels.append(float(rel))
    if not same:
      identical = False
      ref_deterministic &= bool(compare(r, reference(params, x), r)[0].item())
    del a, b, r
  tol = cfg["check_tol"]
  out = {
    "check_steps": n,
    "check_identical_repeats": identical,
    "check_max_rel_diff_vs_selective": max(rels),
    "check_rel_diffs": rels,
    "check_tol": tol,
    "check_ok": (identical or not ref_deterministic) and max(rels) <= tol,
  }
  if not identical:  # the reference too: the program is not deterministic, the check is weak
    out["check_reference_deterministic"] = ref_deterministic
  return out


def child(cfg: dict) -> int:
  """``cfg["mode"]``: "time" (compile, warm up, time, engine stats) or "check"."""
  import jax

  name, shape = cfg["policy"], tuple(cfg["shape"])
  H, S, B, L = shape
  base, own_options = split_policy(name)
  spec = POLICIES[base]
  dev = jax.devices()[0]
  row = {"policy": name, "H": H, "S": S, "B": B, "L": L}
  ssd = None
  if spec.ssd:
    import jax_ssdtrain as ssd

    options = dict(cfg["ssd_options"])
    if spec.small_cache:
      options["host_cache_bytes"] = cfg["sweep_host_cache"]
    options.update(own_options)
    row["store_config"] = dataclasses.asdict(ssd.configure(directory=cfg["store_dir"], **options))
  params, x0 = common.stack_params(*shape)
  impl = "cudnn" if dev.platform == "gpu" else None
  compile_ = lambda policy: make_step(policy, H // HEAD_DIM, impl).lower(params, x0).compile()  # noqa: E731
  t0 = time.perf_counter()
  step = compile_(spec.policy(cfg["min_bytes"]))
  compile_s = time.perf_counter() - t0

  if cfg["mode"] == "check":
    reference = compile_(POLICIES["selective"].policy(0))
    row.update(run_check(step, reference, params, shape, cfg))
    print(json.dumps(row), flush=True)
    return 0

  row.update(
    heads=H // HEAD_DIM,
    device_kind=dev.device_kind,
    platform=dev.platform,
    jax=jax.__version__,
    steps=cfg["steps"],
    offloaded=list(spec.offloaded),
    saved=list(spec.saved),
    via=spec.via if spec.offloaded else None,
    expected_offload_GB_per_step=offload_bytes(spec, *shape, cfg["min_bytes"]) / 1e9,
    compile_s=compile_s,
  )
  ma = step.memory_analysis()
  for key in ("temp", "host_temp", "argument", "output"):
    row[f"{key}_GB"] = getattr(ma, f"{key}_size_in_bytes", 0) / 1e9 if ma is not None else None
  for _ in range(cfg["warmup"]):
    out = step(params, x0)
  jax.block_until_ready(out)
  del out
  if ssd:
    ssd.reset_stats()
    ssd.timeline()  # forget the warm-up's copies
  times = []
  last_step = []  # the engine's timeline of the last timed step
  for i in range(cfg["steps"]):
    if ssd and cfg.get("timeline") and i == cfg["steps"] - 1:
      ssd.timeline()  # forget the copies of the steps before
      host_start = time.monotonic()  # the clock of the engine's timeline
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x0))
    times.append(time.perf_counter() - t0)
    if ssd and cfg.get("timeline") and i == cfg["steps"] - 1:
      ssd.flush()  # every copy of the step done, so that all of them are in the timeline
      last_step = ssd.timeline()
  if ssd:
    row.update(common.engine_row(ssd.stats(), cfg["steps"]))
    if cfg.get("timeline"):
      # times from the step's dispatch (host clock); the first record shows any offset
      row["timeline"] = [
        dict(r, start=r["start"] - host_start, end=r["end"] - host_start) for r in last_step
      ]
  ms = statistics.median(times) * 1e3
  row.update(
    step_ms_median=ms,
    step_ms_min=min(times) * 1e3,
    step_ms_all=[t * 1e3 for t in times],
    model_tflops=model_flops(*shape) / ms / 1e9,
  )
  mem = dev.memory_stats() or {}
  row["peak_GB"] = mem["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in mem else None
  print(json.dumps(row), flush=True)
  return 0


# ---------------------------------------------------------------------------------------------
# Parent: orchestration, table, plot


def _policies(text: str):
  out = []
  for item in (p.strip() for p in text.split(",") if p.strip()):
    pattern, *options = item.split(":")
    for opt in options:  # KEY=VALUE store options of an ssd policy's own row
      _option(opt)
    hits = [n for n in POLICIES if fnmatch.fnmatchcase(n, pattern)]
    if not hits:
      raise argparse.ArgumentTypeError(f"unknown policy {pattern!r}; known: {', '.join(POLICIES)}")
    if options and not all(POLICIES[n].ssd for n in hits):
      raise argparse.ArgumentTypeError(f"{item!r}: store options apply to ssd_* policies only")
    out += [":".join([n, *options]) for n in hits if ":".join([n, *options]) not in out]
  return out


def split_policy(name: str) -> tuple[str, dict]:
  """``"ssd_host_named:staging_bytes=1GiB"`` -> ``("ssd_host_named", {"staging_bytes": ...})``."""
  base, *options = name.split(":")
  return base, dict(_option(o) for o in options)


def _option(text: str):
  key, sep, value = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
  low = value.strip().lower()
  parsed = {"true": True, "on": True, "false": False, "off": False, "auto": None, "none": None}.get(
    low, value.strip()
  )
  if isinstance(parsed, str) and parsed.isdigit():
    parsed = int(parsed)
  return key.strip(), parsed


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--shape",
    type=common.parse_shape,
    action="append",
    help="H,S,B,L (repeatable; default: 4096,2048,4,8 and 8192,2048,2,4)",
  )
  p.add_argument(
    "--tiny",
    action="store_true",
    help="CPU smoke preset: shape 256,128,2,2, --min-bytes 0, small sweep cache",
  )
  p.add_argument(
    "--policies",
    type=_policies,
    default=list(POLICIES),
    help="comma-separated names or globs (default: all)",
  )
  p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument(
    "--check",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="correctness check (default: on for ssd_* policies only)",
  )
  p.add_argument("--check-steps", type=int, default=20, help="fresh inputs (default 20)")
  p.add_argument(
    "--check-budget-s",
    type=float,
    default=120,
    help="fewer check inputs (>= 3) where 20 would take longer than this",
  )
  p.add_argument(
    "--check-xla-flags",
    default="--xla_gpu_exclude_nondeterministic_ops=true",
    help="XLA_FLAGS added for the check on GPU: cuDNN attention's backward is "
    "not deterministic otherwise, and a repeat check would mean nothing",
  )
  p.add_argument(
    "--check-tol",
    type=float,
    default=1e-2,
    help="max relative gradient difference vs selective (bf16)",
  )
  p.add_argument(
    "--min-bytes",
    type=int,
    default=None,
    help="ssd policies: smaller tags stay on device (default 1 MiB; --tiny: 0)",
  )
  p.add_argument(
    "--store-dir",
    default=None,
    help="store directory (default: $SSDTRAIN_DIR, else a temp dir under /tmp)",
  )
  p.add_argument(
    "--ssd",
    type=_option,
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="ssd.configure option for every ssd policy, e.g. io_threads=16",
  )
  p.add_argument(
    "--sweep-host-cache",
    default=None,
    help="host cache of the ssd_nvme_sweep_* policies, small so that the disk is "
    "used (default 512MiB; --tiny: 1MiB)",
  )
  p.add_argument("--probe-gb", type=float, default=2.0)
  p.add_argument(
    "--probe-script",
    type=Path,
    default=None,
    help="storage_probe.py (default: <repo>/../shared/tools or <repo>/shared/tools)",
  )
  p.add_argument("--no-probe", action="store_true", help="skip the storage probe")
  p.add_argument(
    "--link-probe",
    action="store_true",
    help="measure the GPU's PCIe link (pinned copies) in this run",
  )
  p.add_argument(
    "--timeline",
    action="store_true",
    help="record one timed step's device copies of every ssd row (Chrome trace)",
  )
  common.add_out_option(p)
  p.add_argument(
    "--merge",
    action="store_true",
    help="merge into the JSON of the same name (same policy and shape replaced)",
  )
  p.add_argument(
    "--replot",
    type=Path,
    nargs="+",
    metavar="JSON",
    help="table and plot of saved JSON(s) again; several are merged (later rows "
    "win) into --out/rok_<device>_<date>.json",
  )
  p.add_argument("--child-timeout", type=float, default=900)
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 1 or args.check_steps < 1:
    p.error("--steps, --warmup and --check-steps must be >= 1")
  args.shapes = args.shape or (TINY_SHAPES if args.tiny else DEFAULT_SHAPES)
  if args.min_bytes is None:
    args.min_bytes = 0 if args.tiny else 1 << 20
  if args.sweep_host_cache is None:
    args.sweep_host_cache = "1MiB" if args.tiny else "512MiB"
  return args


def _key(row):
  return row.get("policy"), row.get("H"), row.get("S"), row.get("B"), row.get("L")


def _ok(row):
  return "error" not in row and row.get("step_ms_median")


def derive(doc: dict) -> None:
  """Fields relative to other rows or to the probes (recomputed on merge and replot). Each row
  is compared with the ``selective`` row and the probes of its own run (of merged runs: the
  run in ``sources`` that its ``source`` names)."""
  sources = doc.get("sources") or [doc]
  src = lambda r: sources[r.get("source", 0)] if "sources" in doc else doc  # noqa: E731
  selective = {
    (r.get("source", 0), _key(r)[1:]): r
    for r in doc["rows"]
    if r.get("policy") == "selective" and _ok(r)
  }
  for r in doc["rows"]:
    if not _ok(r):
      continue
    sel = selective.get((r.get("source", 0), _key(r)[1:]))
    r["x_selective"] = r["step_ms_median"] / sel["step_ms_median"] if sel else None
    r["device_GB"] = (r.get("temp_GB") or 0) + (r.get("staging_GB_peak") or 0)
    probe = src(r).get("probe") or {}
    for io in ("write", "read"):
      engine, raw = r.get(f"{io}_GBps"), probe.get(f"{io}_GBps")
      r[f"{io}_vs_probe"] = engine / raw if engine and raw else None
    link = src(r).get("link") or {}
    for way in ("d2h", "h2d"):
      engine, raw = r.get(f"link_{way}_GBps"), link.get(f"{way}_gbps")
      r[f"link_{way}_vs_probe"] = engine / raw if engine and raw else None


def _fmt(v, spec="{:.2f}"):
  return "-" if v is None else spec.format(v)


def table(doc: dict) -> str:
  head = (
    "shape",
    "policy",
    "step ms",
    "x sel",
    "TFLOP/s",
    "temp GB",
    "stage GB",
    "host GB",
    "disk MB/step w/r",
    "stall ms",
    "w/r vs probe",
    "link GB/s d2h/h2d (x probe)",
    "wait ms",
    "check",
  )
  lines = []
  for r in doc["rows"]:
    shape = f"{r.get('H')},{r.get('S')},{r.get('B')},{r.get('L')}"
    if not _ok(r):
      lines.append((shape, r.get("policy", "?"), f"ERROR: {r.get('error', '?')}"))
      continue
    host = (
      (r.get("host_tier_GB_peak") or 0) + (r.get("host_cache_GB_peak") or 0)
      if "engine" in r
      else r.get("host_temp_GB")
    )
    disk = (
      f"{r['disk_MB_written_per_step']:.0f}/{r['disk_MB_read_per_step']:.0f}"
      if "engine" in r
      else "-"
    )
    vs = f"{_fmt(r.get('write_vs_probe'))}/{_fmt(r.get('read_vs_probe'))}" if "engine" in r else "-"
    check = "-"
    if "check_error" in r:
      check = "FAIL (error)"
    elif "check_ok" in r:
      check = (
        f"{'ok' if r['check_ok'] else 'FAIL'} "
        f"{'same' if r['check_identical_repeats'] else 'DIFF'} "
        f"{r['check_max_rel_diff_vs_selective']:.1e}"
      )
    link = "-"
    if r.get("link_d2h_GB_per_step") or r.get("link_h2d_GB_per_step"):
      link = (
        f"{r['link_d2h_GBps']:.1f}/{r['link_h2d_GBps']:.1f} "
        f"({_fmt(r.get('link_d2h_vs_probe'))}/{_fmt(r.get('link_h2d_vs_probe'))})"
      )
    lines.append(
      (
        shape,
        r["policy"],
        f"{r['step_ms_median']:.1f}",
        _fmt(r.get("x_selective"), "{:.3f}"),
        f"{r['model_tflops']:.1f}",
        _fmt(r.get("temp_GB")),
        _fmt(r.get("staging_GB_peak")),
        _fmt(host),
        disk,
        _fmt(r.get("stall_ms_per_step"), "{:.1f}"),
        vs,
        link,
        _fmt(r.get("compute_wait_ms_per_step"), "{:.1f}"),
        check,
      )
    )
  widths = [
    max(len(str(x[i])) for x in [head] + [ln for ln in lines if len(ln) > i])
    for i in range(len(head))
  ]
  fmt = lambda ln: "  ".join(str(v).ljust(w) for v, w in zip(ln, widths)).rstrip()  # noqa: E731
  foot = []
  for src in doc.get("sources") or [doc]:
    if "sources" in doc:
      foot.append(f"{src['file']} ({src['date']}):")
    probe = src.get("probe") or {}
    foot.append(
      f"probe ({probe.get('dir')}): best O_DIRECT write {probe['write_GBps']:.2f} GB/s, "
      f"read {probe['read_GBps']:.2f} GB/s"
      if probe.get("write_GBps")
      else f"probe: {probe.get('note', 'not run')}"
    )
    link = src.get("link") or {}
    if link.get("d2h_gbps"):
      foot.append(
        f"link probe (pinned, {link['size'] / 2**30:.0f} GiB copies): D2H "
        f"{link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} alone; "
        f"{link['duplex_d2h_gbps']:.1f}/{link['duplex_h2d_gbps']:.1f} both at once"
      )
  return "\n".join([fmt(head)] + [fmt(ln) for ln in lines] + foot)


def plot(plt, doc: dict, path: Path) -> str | None:
  """Left: ROK (device GB vs model TFLOP/s); right: sweep overhead vs offloaded GB/step."""
  # a pair of panels per shape of each run (merged runs: see replot)
  shapes = sorted({(r.get("source", 0), *_key(r)[1:]) for r in doc["rows"] if _ok(r)})
  if not shapes:
    return "no plot: no successful rows"
  sources = doc.get("sources") or [doc]
  # the right-hand panel (the NVMe sweep) only where a run has sweep rows
  sweeps = any(r["policy"].startswith("ssd_nvme_sweep") for r in doc["rows"] if _ok(r))
  cols = 2 if sweeps else 1
  with common.figure(
    plt, path, len(shapes), cols, figsize=(7 * cols, 5.2 * len(shapes)), squeeze=False, dpi=110
  ) as (fig, axes):
    markers = {
      "keep": "o",
      "recompute": "s",
      "selective": "D",
      "jax_host": "^",
      "ssd_host": "v",
      "ssd_nvme_sweep": "P",
      "ssd_nvme": "*",
    }
    for (rok, *right), (source, *shape) in zip(axes, shapes):
      probe_w = (sources[source].get("probe") or {}).get("write_GBps")
      rows = {
        r["policy"]: r
        for r in doc["rows"]
        if _ok(r) and (r.get("source", 0), *_key(r)[1:]) == (source, *shape)
      }
      for name, r in rows.items():
        family = next(f for f in markers if name.startswith(f))
        rok.scatter(
          r["device_GB"], r["model_tflops"], marker=markers[family], s=70, label=name, zorder=3
        )
        rok.annotate(
          name,
          (r["device_GB"], r["model_tflops"]),
          fontsize=7,
          xytext=(4, 4),
          textcoords="offset points",
        )
      sweep = [
        rows[n] for n in ["selective"] + [f"ssd_nvme_sweep_{k}" for k in range(1, 5)] if n in rows
      ]
      rok.plot(
        [r["device_GB"] for r in sweep], [r["model_tflops"] for r in sweep], "k--", lw=0.8, zorder=2
      )
      rok.set(
        xlabel="device memory GB (XLA temp + engine staging peak)",
        ylabel="model TFLOP/s",
        title=f"ROK  H,S,B,L = {','.join(map(str, shape))}"
        + (f"  ({sources[source].get('date')})" if "sources" in doc else ""),
      )
      rok.grid(alpha=0.3)
      rok.legend(fontsize=7, loc="best")

      if not right:
        continue
      (ovh,) = right
      sel = rows.get("selective")
      pts = [r for r in sweep if r["policy"] != "selective"]
      if sel is None or not pts:
        ovh.text(
          0.5,
          0.5,
          "needs selective and ssd_nvme_sweep_* rows",
          ha="center",
          transform=ovh.transAxes,
        )
      else:
        gb = lambda r: r.get("offload_GB_per_step") or r["expected_offload_GB_per_step"]  # noqa: E731
        xs = [0.0] + [gb(r) for r in pts]
        ys = [0.0] + [r["step_ms_median"] - sel["step_ms_median"] for r in pts]
        ovh.plot(xs, ys, "o-", label="ssd_nvme_sweep (vs selective)")
        for r, x, y in zip(pts, xs[1:], ys[1:]):
          ovh.annotate(
            f"{r['policy'][-1]}: {'+'.join(r['offloaded'])}\n"
            f"disk {r.get('disk_MB_written_per_step', 0):.0f} MB w, "
            f"stall {r.get('stall_ms_per_step', 0):.0f} ms",
            (x, y),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
          )
        if probe_w:
          knee = probe_w * sel["step_ms_median"] / 1e3
          ovh.axvline(
            knee,
            color="r",
            ls=":",
            label=f"probe write {probe_w:.2f} GB/s x selective "
            f"{sel['step_ms_median']:.0f} ms = {knee:.2f} GB",
          )
        ovh.axhline(0, color="k", lw=0.6)
        ovh.legend(fontsize=7, loc="best")
      ovh.set(
        xlabel="offloaded GB per step",
        ylabel="step time - selective (ms)",
        title="NVMe sweep: overhead vs offloaded bytes",
      )
      ovh.grid(alpha=0.3)
    env = doc.get("env", {})
    fig.suptitle(f"{env.get('device_kind')}  jax {env.get('jax')}  {doc.get('date')}", fontsize=9)
  return None


def report(doc: dict, stem: Path) -> None:
  """STEM.json, .md, .png of a run (its derived columns computed first)."""
  derive(doc)
  common.write_results(stem, doc, table(doc), plot)
  print(f"wrote {stem}.json")


def replot(paths: list[Path], out: Path) -> int:
  """Table and plot of saved runs. One JSON is rewritten in place; several are merged into
  OUT/rok_<device>_<date of the first>.json: their rows in order, each with the index of its
  run in ``sources`` (that run's file, date, environment, arguments and probes)."""
  keys = ("date", "env", "args", "probe", "link")
  return common.replot(paths, out, "rok", report, keys=keys, field="rows", tag_source=True)


def _trace_label(r: dict) -> str:
  """A row's process name in the Chrome trace of timelines."""
  return f"{r['policy']} [{r['H']},{r['S']},{r['B']},{r['L']}] {r['step_ms_median']:.1f} ms"


def failures(doc: dict) -> list[str]:
  why = lambda r: r.get("error") or r.get("check_error") or "check failed"  # noqa: E731
  return [
    f"{r.get('policy')} {_key(r)[1:]}: {why(r)}"
    for r in doc["rows"]
    if not _ok(r) or r.get("check_ok") is False
  ]


CHILD_KEYS = (
  "steps",
  "warmup",
  "check_steps",
  "check_tol",
  "check_budget_s",
  "min_bytes",
  "sweep_host_cache",
  "timeline",
)


def run_policy(args, name: str, shape, store_dir: str, done: list[dict]) -> dict:
  """The timing child, then (if asked) the check child, whose program is made deterministic
  on GPU (``--check-xla-flags``) so that a repeat that differs means a race."""
  cfg = {
    "policy": name,
    "shape": shape,
    "store_dir": store_dir,
    "ssd_options": dict(args.ssd),
    "mode": "time",
  } | {k: getattr(args, k) for k in CHILD_KEYS}
  cmd = common.module_command("scripts.bench_rok", "--child")
  t0 = time.perf_counter()
  row = dict(zip(("policy", "H", "S", "B", "L"), (name, *shape)))
  row |= common.run_json_child(cmd + [json.dumps(cfg)], args.child_timeout)
  label = f"[{','.join(map(str, shape))}] {name}"
  if not _ok(row):
    print(f"{label}: ERROR {row['error']}\n{row.get('stderr_tail', '')}", flush=True)
    return row
  print(
    f"{label}: {row['step_ms_median']:.1f} ms, temp {row['temp_GB']:.2f} GB "
    f"({time.perf_counter() - t0:.0f} s)",
    flush=True,
  )

  if POLICIES[split_policy(name)[0]].ssd if args.check is None else args.check:
    sel = next((r for r in done if _key(r) == ("selective", *shape) and _ok(r)), row)
    cfg |= {
      "mode": "check",
      "step_ms": row["step_ms_median"],
      "selective_ms": sel["step_ms_median"],
    }
    env = dict(os.environ)
    if row["platform"] == "gpu" and args.check_xla_flags:
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.check_xla_flags}".strip()
      row["check_xla_flags"] = args.check_xla_flags
    t1 = time.perf_counter()
    check = common.run_json_child(cmd + [json.dumps(cfg)], args.child_timeout, env=env)
    if "error" in check:
      check = {
        "check_ok": False,
        "check_error": check["error"],
        "check_stderr_tail": check.get("stderr_tail"),
      }
    row |= {k: v for k, v in check.items() if k.startswith("check_")}
    row["check_wall_s"] = time.perf_counter() - t1
    print(
      f"{label}: check {'ok' if row['check_ok'] else 'FAILED'} "
      f"({row.get('check_steps', 0)} inputs, {row['check_wall_s']:.0f} s)",
      flush=True,
    )
  row["wall_s"] = time.perf_counter() - t0
  return row


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child:
    return child(json.loads(args.child))
  if args.replot:
    return replot(args.replot, args.out)

  made_dir = None
  store_dir = args.store_dir or os.environ.get("SSDTRAIN_DIR", "").split(":")[0] or None
  if store_dir is None:
    store_dir = made_dir = tempfile.mkdtemp(prefix="bench_rok-", dir="/tmp")
  os.makedirs(store_dir, exist_ok=True)
  try:
    probe = {"note": "--no-probe"}
    if not args.no_probe:
      print(f"storage probe: {store_dir}, {args.probe_gb:g} GB ...", flush=True)
      probe = common.run_storage_probe(store_dir, args.probe_gb, script=args.probe_script)
    link = None
    if args.link_probe:  # cudaHostAlloc'ed buffers, then registered ones as the engine's
      link = {}
      for host in ("alloc", "registered", "registered_hugepages"):
        r = common.run_json_child(
          [
            sys.executable,
            "-m",
            "jax_ssdtrain.probe",
            "--link",
            "--refresh",
            "--json",
            "--host-memory",
            host,
          ],
          args.child_timeout,
        )
        print(f"link probe ({host}): {r}", flush=True)
        link = link or r  # the reference: plain pinned copies
        link[f"{host}_d2h_gbps"] = r.get("d2h_gbps")
        link[f"{host}_h2d_gbps"] = r.get("h2d_gbps")
    rows = []
    for shape in args.shapes:
      for name in args.policies:
        rows.append(run_policy(args, name, shape, store_dir, rows))
  finally:
    if made_dir:
      shutil.rmtree(made_dir, ignore_errors=True)

  device = common.device_kind(rows)
  env = common.host_env() | {
    "device_kind": device,
    "platform": next((r["platform"] for r in rows if "platform" in r), None),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  if args.timeline:  # the JSON keeps a per-operation summary of the step, not every copy
    trace = args.out / f"rok_timeline_{common.slug(device)}_{common.today()}.json"
    common.write_timelines(trace, rows, _trace_label)
  doc = {
    "date": common.today(),
    "env": env,
    "probe": probe,
    "rows": rows,
    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
  }
  if link is not None:
    doc["link"] = link
  stem = args.out / f"rok_{common.slug(device)}_{doc['date']}"
  if args.merge and Path(f"{stem}.json").exists():
    old = json.loads(Path(f"{stem}.json").read_text())
    doc["rows"] = common.merge_rows(old.get("rows", []), rows, _key)
    if not probe.get("write_GBps") and (old.get("probe") or {}).get("write_GBps"):
      doc["probe"] = old["probe"]
    if link is None and old.get("link"):
      doc["link"] = old["link"]
  report(doc, stem)
  bad = failures(doc)
  for line in bad:
    print(f"FAIL {line}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
