"""MaxText's own trainer: its remat presets, its pinned-host offload and ours, side by side.

    python -m scripts.bench_maxtext [--out DIR] [--set minimal|qkv|all | --variants V,V,...]
        [--steps 10] [--warmup 3] [--budget-s S] [--store-dir DIR] [--ssd KEY=VALUE ...]
        [--fsdp N] [--tiny] [MaxText key=value ...]

A variant is ``PRESET`` (MaxText as shipped, ``remat_policy=PRESET``) or ``PRESET@host`` /
``PRESET@nvme`` (the same preset with ``jax_ssdtrain.maxtext`` installed: the tags MaxText would
offload to pinned host memory go to our store instead), optionally followed by store options of
that variant alone, ``:KEY=VALUE`` each (``minimal_offloaded@host:staging_bytes=2GiB``; they
override ``--ssd``). Each variant runs MaxText's
``train.main`` in its own process, so that device memory starts empty. ``--set`` picks a list:
``minimal`` (the default: MaxText's ``full``, ``minimal``, its pinned-host ``minimal_offloaded``,
and ours for the same tags on host and nvme; five processes, which fit one 10-minute device
call with the build), ``qkv`` (the same for the query/key/value projections, against
``save_qkv_proj``) or ``all`` (both: two calls' worth). ``--budget-s`` stops starting variants
that would not finish in time, so that a run with a hard limit still writes its files.

``--fsdp N`` runs every variant on N devices (the first N of ``CUDA_VISIBLE_DEVICES``, or N
CPU devices under ``JAX_PLATFORMS=cpu``) with MaxText's FSDP over them
(``ici_fsdp_parallelism=N``: parameters, gradients and optimizer state sharded, each device
``per_device_batch_size`` sequences); our store then has one directory per device
(``store/gpu{device}``). The default, 1, is one device, whatever the machine has.

Reported per variant: median of MaxText's own ``perf/step_time_seconds`` over the steps after
``--warmup``, tokens/s (all devices), peak device memory (XLA's ``peak_bytes_in_use`` plus our
staging arena, which XLA's allocator does not see; with several devices, the device that peaked
highest, each one's in ``peak_xla_bytes_per_device``), bytes through our store per step (all
devices; each device's in ``store_bytes_per_step_per_device``), the last loss and the seconds
its process took (imports, compile and steps). Default model: a ~1B llama2-style decoder (16
layers, d=2048, MLP 5632, vocab 32000), sequence 2048, batch 4 per device, dot-product attention,
synthetic data.

Writes OUT/maxtext_<date>[_<set>][_fsdp<N>][_tiny].json, .md and, with matplotlib, .png (no set
suffix for the default set, nor with --variants).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common

# Each set: its variants (most wanted first: a run cut short by --budget-s keeps those) and the
# variant whose step time the others are compared with (MaxText saving the same tags on device).
VARIANT_SETS = {
  "minimal": (
    "minimal,minimal_offloaded,minimal_offloaded@host,minimal_offloaded@nvme,full",
    "minimal",
  ),
  "qkv": (
    "save_qkv_proj,qkv_proj_offloaded,qkv_proj_offloaded@host,qkv_proj_offloaded@nvme,full",
    "save_qkv_proj",
  ),
  "all": (
    "minimal,minimal_offloaded,minimal_offloaded@host,minimal_offloaded@nvme,full,"
    "save_qkv_proj,qkv_proj_offloaded,qkv_proj_offloaded@host,qkv_proj_offloaded@nvme",
    "minimal",
  ),
}

MODEL_1B = (
  "decoder_block=llama2",
  "base_emb_dim=2048",
  "base_num_query_heads=16",
  "base_num_kv_heads=16",
  "head_dim=128",
  "base_mlp_dim=5632",
  "base_num_decoder_layers=16",
  "vocab_size=32000",
  "max_target_length=2048",
  "per_device_batch_size=4",
  "attention=dot_product",
)
MODEL_TINY = (
  "decoder_block=llama2",
  "base_emb_dim=64",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "head_dim=16",
  "base_mlp_dim=128",
  "base_num_decoder_layers=2",
  "vocab_size=256",
  "max_target_length=32",
  "per_device_batch_size=1",
  "attention=dot_product",
)
LOCATIONS = ("host", "nvme")


def parse_variant(text: str) -> tuple[str, str | None, dict[str, str]]:
  """``"minimal_offloaded@host:staging_bytes=2GiB"`` -> ``("minimal_offloaded", "host",
  {"staging_bytes": "2GiB"})``."""
  head, *option_texts = text.split(":")
  preset, sep, location = head.partition("@")
  if not preset or (sep and location not in LOCATIONS):
    raise argparse.ArgumentTypeError(
      f"variant {text!r}: expected PRESET or PRESET@host / PRESET@nvme"
    )
  options = {}
  for item in option_texts:
    key, eq, value = item.partition("=")
    if not eq or not key:
      raise argparse.ArgumentTypeError(f"variant {text!r}: store option {item!r} is not KEY=VALUE")
    options[key] = value
  if options and not location:
    raise argparse.ArgumentTypeError(
      f"variant {text!r}: store options apply to PRESET@host / PRESET@nvme only"
    )
  return preset, location or None, options


# ---------------------------------------------------------------------------------------------
# Child: one variant, one process


def run_child(variant: str, config: dict) -> dict:
  preset, location, variant_options = parse_variant(variant)
  import jax
  import maxtext
  from maxtext.trainers.pre_train import train

  import jax_ssdtrain as ssd
  import jax_ssdtrain.maxtext as ssd_maxtext

  fsdp = config.get("fsdp", 1)
  if jax.device_count() != fsdp:
    raise RuntimeError(f"--fsdp {fsdp} needs {fsdp} devices, this process has {jax.devices()}")
  out = Path(config["workdir"]) / bench_common.slug(variant)
  out.mkdir(parents=True, exist_ok=True)
  if location:
    # several devices: each its own directory (docs/parallel.md)
    store_dir = out / ("store/gpu{device}" if fsdp > 1 else "store")
    ssd_maxtext.install(
      location,
      min_bytes=0,
      store={"directory": str(store_dir), **config["ssd"], **variant_options},
    )
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  metrics = out / "metrics.jsonl"
  argv = [
    "",
    base,
    f"run_name={bench_common.slug(variant)}",
    f"base_output_directory={out}",
    "dataset_type=synthetic",
    f"steps={config['steps']}",
    "enable_checkpointing=false",
    "enable_goodput_recording=false",
    "skip_jax_distributed_system=true",
    "log_period=1",
    f"metrics_file={metrics}",
    f"remat_policy={preset}",
    f"hardware={'gpu' if jax.default_backend() == 'gpu' else 'cpu'}",
    *([f"ici_fsdp_parallelism={fsdp}"] if fsdp > 1 else []),
    *config["maxtext"],
  ]
  ssd.reset_stats()
  t0 = time.perf_counter()
  train.main(argv)
  wall = time.perf_counter() - t0
  ssd.flush()
  stats = ssd.stats()
  rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
  times = [r["perf/step_time_seconds"] for r in rows][config["warmup"] :]
  if not times:
    raise RuntimeError(f"{len(rows)} steps logged, none after --warmup {config['warmup']}")
  step_s = statistics.median(times)
  tokens = rows[-1]["perf/per_device_tokens"] * jax.device_count()
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peak = None if None in peaks else max(peaks)
  # Our GPU staging arena (one per device) is cudaMalloc'ed outside XLA's allocator, whole, on
  # first use: it is device memory of ours that peak_bytes_in_use does not see.
  store_config = ssd.current_config() if location else None
  staging = (
    stats["staging_bytes"]  # the arena in force (staging_bytes="auto" chose it)
    if location and peak is not None and stats.get("bytes_written")
    else 0
  )
  steps = len(rows)
  return {
    "variant": variant,
    "preset": preset,
    "location": location or "maxtext",
    "devices": jax.device_count(),
    "config_staging_bytes": store_config and store_config.staging_bytes,
    "config_host_tier_bytes": store_config and store_config.host_tier_bytes,
    "steps": steps,
    "timed_steps": len(times),
    "step_s_median": step_s,
    "step_s_min": min(times),
    "step_s_max": max(times),
    "tokens_per_s": tokens / step_s,
    "peak_xla_bytes": peak,
    "peak_xla_bytes_per_device": peaks,
    "staging_arena_bytes": staging,
    "peak_device_bytes": None if peak is None else peak + staging,
    "staging_bytes_peak": stats.get("staging_bytes_peak"),
    "store_bytes_per_step": stats["bytes_written"] / steps if location else None,
    "store_read_bytes_per_step": stats["bytes_read"] / steps if location else None,
    "store_bytes_per_step_per_device": (
      {str(k): v["bytes_written"] / steps for k, v in ssd.device_stats().items()}
      if location
      else None
    ),
    "disk_bytes_written": stats.get("disk_bytes_written"),
    "host_tier_bytes_peak": stats.get("host_tier_bytes_peak"),
    "live_entries_after": stats.get("live_entries"),
    "link_d2h_GBps": stats.get("link_d2h_GBps"),
    "link_h2d_GBps": stats.get("link_h2d_GBps"),
    "compute_wait_s_per_step": stats.get("gpu_compute_wait_seconds", 0) / steps,
    "d2h_elided_bytes_per_step": stats.get("d2h_elided_bytes", 0) / steps,
    "last_loss": rows[-1]["learning/loss"],
    "wall_s": wall,
    "device": str(jax.devices()[0].device_kind),
  }


# ---------------------------------------------------------------------------------------------
# Parent: every variant in its own process, then JSON, table and plot


def _bytes(value) -> str:
  if value is None:
    return "–"
  for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
    if value >= scale:
      return f"{value / scale:.2f} {unit}"
  return f"{value:.0f} B"


def table(rows: list[dict], reference: str | None) -> str:
  ref = next((r for r in rows if r["variant"] == reference and "error" not in r), None)
  lines = [
    "| variant | step (median) | vs " + (reference or "–") + " | tokens/s | "
    "peak device memory (XLA + our staging) | through our store per step | last loss |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if "error" in r:
      what = r["error"] if r["error"].startswith("skipped") else f"failed: {r['error']}"
      lines.append(f"| {r['variant']} | {what} | | | | | |")
      continue
    ratio = f"{r['step_s_median'] / ref['step_s_median']:.3f}×" if ref else "–"
    lines.append(
      f"| {r['variant']} | {r['step_s_median'] * 1e3:.1f} ms | {ratio} | "
      f"{r['tokens_per_s']:,.0f} | {_bytes(r['peak_device_bytes'])}"
      f"{' (' + _bytes(r['peak_xla_bytes']) + ' + ' + _bytes(r['staging_arena_bytes']) + ')' if r.get('staging_arena_bytes') else ''} | "
      f"{_bytes(r['store_bytes_per_step'])} | {r['last_loss']:.4f} |"
    )
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> str | None:
  ok = [r for r in doc["rows"] if "error" not in r and r["peak_device_bytes"]]
  if not ok:
    return "no plot: no variant ran"
  with bench_common.figure(plt, path, figsize=(7, 4.5), dpi=120) as (_, ax):
    for r in ok:
      xy = (r["peak_device_bytes"] / 1e9, r["step_s_median"] * 1e3)
      ax.scatter(*xy, marker="o" if r["location"] == "maxtext" else "s")
      ax.annotate(r["variant"], xy, fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel("peak device memory (GB)")
    ax.set_ylabel("step time, median (ms)")
    ax.set_title("MaxText train.main: presets (o) and ours (□)")
    ax.grid(alpha=0.3)


def device_env(n: int) -> dict:
  """The environment of a variant's process: N devices, the first N GPUs of this process's
  CUDA_VISIBLE_DEVICES (all of them: 0..N-1), or N CPU devices where JAX runs on the CPU."""
  env = dict(os.environ)
  visible = env.get("CUDA_VISIBLE_DEVICES")
  gpus = [g for g in visible.split(",") if g.strip()] if visible else [str(i) for i in range(n)]
  env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:n])
  # Also keeps MaxText from setting its own (HLO dump) flags, as gpu.sh's XLA_FLAGS does.
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
  return env


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument(
    "--set",
    default="minimal",
    choices=sorted(VARIANT_SETS),
    help="a list of variants: " + "; ".join(f"{k}: {v[0]}" for k, v in VARIANT_SETS.items()),
  )
  p.add_argument(
    "--variants",
    default=None,
    help="comma-separated PRESET or PRESET@host|nvme[:KEY=VALUE...]; None: those of --set",
  )
  p.add_argument(
    "--reference",
    default=None,
    help="variant the step-time ratios are taken against; None: the set's "
    "device-saving preset, else the first variant",
  )
  p.add_argument("--steps", type=int, default=10, help="MaxText steps per variant")
  p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
  p.add_argument(
    "--budget-s",
    type=float,
    default=0,
    help="seconds for all variants (0: no limit): a variant is started only while "
    "the time left exceeds the longest variant so far, and its child is "
    "stopped when the budget runs out",
  )
  p.add_argument(
    "--store-dir",
    default=None,
    help="parent of the stores and MaxText outputs; None: a private temp dir",
  )
  p.add_argument(
    "--ssd",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="jax_ssdtrain.configure option for the @host/@nvme variants",
  )
  p.add_argument(
    "--fsdp",
    type=int,
    default=1,
    metavar="N",
    help="devices per variant, MaxText's FSDP over them (ici_fsdp_parallelism=N)",
  )
  p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke runs)")
  p.add_argument("--timeout", type=float, default=1800, help="per variant, seconds")
  bench_common.add_out_option(p)
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--config", default=None, help=argparse.SUPPRESS)
  args, maxtext_args = p.parse_known_args(argv)
  bad = [a for a in maxtext_args if "=" not in a or a.startswith("-")]
  if bad:
    p.error(f"unrecognized arguments {bad}: MaxText settings are key=value")

  if args.child:
    print(json.dumps(run_child(args.child, json.loads(args.config)), default=str))
    return 0

  variant_text, set_reference = VARIANT_SETS[args.set]
  if args.variants:
    variant_text, set_reference = args.variants, None
  variants = [v.strip() for v in variant_text.split(",") if v.strip()]
  if not variants:
    p.error("no variants")
  reference = args.reference or (set_reference if set_reference in variants else variants[0])
  for v in variants:
    try:
      parse_variant(v)
    except argparse.ArgumentTypeError as e:
      p.error(str(e))
  if args.fsdp < 1:
    p.error(f"--fsdp {args.fsdp}: expected a device count >= 1")
  if args.warmup >= args.steps:
    p.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
  ssd_options = {}
  for item in args.ssd:
    key, sep, value = item.partition("=")
    if not sep or not key:
      p.error(f"--ssd {item!r}: expected KEY=VALUE")
    ssd_options[key] = value
  workdir = args.store_dir or tempfile.mkdtemp(prefix="bench_maxtext_")
  config = {
    "workdir": workdir,
    "steps": args.steps,
    "warmup": args.warmup,
    "ssd": ssd_options,
    "fsdp": args.fsdp,
    "maxtext": [*(MODEL_TINY if args.tiny else MODEL_1B), *maxtext_args],
  }
  args.out.mkdir(parents=True, exist_ok=True)
  set_suffix = "" if args.variants or args.set == "minimal" else f"_{args.set}"
  fsdp_suffix = f"_fsdp{args.fsdp}" if args.fsdp > 1 else ""
  stem = args.out / (
    f"maxtext_{bench_common.today()}{set_suffix}{fsdp_suffix}{'_tiny' if args.tiny else ''}"
  )
  result = {
    "date": bench_common.today(),
    "env": bench_common.host_env(),
    "config": config,
    "reference": reference,
    "rows": [],
  }
  t_start = time.monotonic()
  longest = 0.0
  for v in variants:
    timeout = args.timeout
    if args.budget_s:
      left = args.budget_s - (time.monotonic() - t_start)
      if left < max(longest, 10.0):
        print(
          f"== {v}: skipped, {left:.0f} s of --budget-s {args.budget_s:.0f} left "
          f"(longest variant so far {longest:.0f} s)",
          flush=True,
        )
        result["rows"].append(
          {"variant": v, "error": f"skipped: {left:.0f} s of the time budget left"}
        )
        continue
      timeout = min(timeout, left)
    print(
      f"== {v}: MaxText train.main, {args.steps} steps"
      + (f", FSDP over {args.fsdp} devices" if args.fsdp > 1 else ""),
      flush=True,
    )
    t0 = time.monotonic()
    row = bench_common.run_json_child(
      bench_common.module_command(
        "scripts.bench_maxtext", "--child", v, "--config", json.dumps(config)
      ),
      timeout=timeout,
      env=device_env(args.fsdp),
    )
    row.setdefault("variant", v)
    row["process_s"] = time.monotonic() - t0
    longest = max(longest, row["process_s"])
    result["rows"].append(row)
    print(
      "   "
      + (
        f"failed: {row['error']}\n{row.get('stderr_tail', '')[-1500:]}"
        if "error" in row
        else f"{row['step_s_median'] * 1e3:.1f} ms/step, "
        f"peak {_bytes(row['peak_device_bytes'])}, "
        f"process {row['process_s']:.0f} s (train.main {row['wall_s']:.0f} s)"
      ),
      flush=True,
    )
    # Written after every variant: a run cut short keeps what it measured.
    bench_common.write_results(stem, result, table(result["rows"], reference), quiet=True)
  bench_common.write_results(stem, result, table(result["rows"], reference), plot)
  return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
  sys.exit(main())
