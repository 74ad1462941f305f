"""Weak scaling of GPT training with offload over 1 and 2 GPUs of one host (DP and FSDP).

Per-GPU work is fixed (``--batch-per-gpu`` sequences of ``--seq`` tokens); each GPU stores its
own shards of the offloaded tag(s) in a store directory of its own (``<store-dir>/gpu{device}``).
For every policy the table gives tokens/s per GPU with 1 and with N GPUs and the weak-scaling
efficiency (tokens/s per GPU with N GPUs / with 1 GPU), plus the no-offload references:

* ``offload``:      ``--offload`` tags (default ``layer_in``) in the nvme store, the rest
  recomputed;
* ``offload_host``: the same tags in the engine's host tier (pinned host memory of
  ``--host-tier`` bytes per process);
* ``remat``:        the same tags saved on the device instead (full recompute from the layer
  input);
* ``keep``:         no rematerialization at all (DP only unless ``--fsdp-keep``: a reference,
  and the run must stay under 6 minutes with its compilations).

Each configuration's compiled program is also searched for collectives (all-gather, all-reduce,
reduce-scatter, collective-permute, all-to-all; an async ``-start``/``-done`` pair counted
once): the JSON has them by kind, and the table's "+coll. vs remat" column gives how many the
offload policies add to ``remat`` of the same layout with N GPUs (the offload adds none: 0).

One child process per GPU count runs its configurations one after the other, on the first 1 and
the first ``--gpus`` GPUs (``CUDA_VISIBLE_DEVICES``: of the machine's, or of those this process
is given); this process only orchestrates and writes ``multigpu_<device>_<date>.json``, a table
(``.md``) and a plot (``.png``) to ``--out``.

    python -m scripts.bench_multigpu                       # 2 H200: ~4-5 min with compiles
    python -m scripts.bench_multigpu --preset medium --batch-per-gpu 8 --steps 10
    python -m scripts.bench_multigpu --cpu-smoke           # 2 CPU devices, tiny preset
    python -m scripts.bench_multigpu --replot benchmarks/multigpu.json   # table and plot again
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as common

POLICIES = ("offload", "offload_host", "remat", "keep")
OFFLOAD_POLICIES = {"offload": "nvme", "offload_host": "host"}  # policy: location of the tags
LAYOUTS = ("dp", "fsdp")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
# An instruction "name = TYPE op(" of one of COLLECTIVES, or its async "-start" ("-done" is not
# counted; XLA's async-start wrappers hold the plain op in the computation they call).
_COLLECTIVE_RE = re.compile(r"=\s+(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.child:
    return child(json.loads(args.child))
  if args.replot:
    doc = json.loads(args.replot.read_text())
    write(doc, str(args.replot))
    return 0
  store_root = args.store_dir or tempfile.mkdtemp(prefix="ssd_multigpu-")
  try:
    return _orchestrate(args, store_root)
  finally:
    if not args.store_dir:
      shutil.rmtree(store_root, ignore_errors=True)


def _orchestrate(args, store_root: str) -> int:
  base = dict(
    preset=args.preset,
    seq=args.seq,
    batch_per_gpu=args.batch_per_gpu,
    steps=args.steps,
    warmup=args.warmup,
    offload=args.offload,
    policies=args.policies,
    layouts=args.layouts,
    cpu=args.cpu_smoke,
    fsdp_keep=args.fsdp_keep,
    attention=args.attention,
    host_cache=args.host_cache,
    host_tier=args.host_tier,
  )
  unknown = sorted(set(args.policies) - set(POLICIES))
  if unknown:
    raise SystemExit(f"unknown policies {unknown} (known: {', '.join(POLICIES)})")
  results, t_start = {}, time.perf_counter()
  for n in (1, args.gpus):
    cfg = dict(
      base,
      gpus=n,
      store=os.path.join(store_root, f"n{n}", "gpu{device}"),
      layouts=["dp"] if n == 1 else args.layouts,
    )  # on 1 GPU, FSDP is DP
    env = dict(os.environ)
    if args.cpu_smoke:
      env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}",
      )
    else:  # the first n GPUs of those this process may use (all of the machine's by default)
      visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
      env["CUDA_VISIBLE_DEVICES"] = ",".join((visible or [str(i) for i in range(n)])[:n])
    out = common.run_json_child(
      common.module_command("scripts.bench_multigpu", "--child", json.dumps(cfg)),
      timeout=args.child_timeout,
      env=env,
    )
    results[n] = out
    print(
      f"[{time.perf_counter() - t_start:.0f} s] {n} device(s): {out.get('error') or 'ok'}",
      flush=True,
    )
    if out.get("error"):
      print(out.get("stderr_tail", ""), file=sys.stderr)
  rows = scaling_rows(results, args.gpus)
  doc = {
    "date": common.today(),
    "env": common.host_env() | {"device_kind": results[1].get("device_kind")},
    "config": base | {"gpus": args.gpus, "store_dir": store_root},
    "runs": results,
    "rows": rows,
    "wall_s": time.perf_counter() - t_start,
  }
  os.makedirs(args.out, exist_ok=True)
  kind = common.slug(results[1].get("device_kind") or "unknown")
  write(doc, os.path.join(args.out, f"multigpu_{kind}_{doc['date']}.json"))
  print(f"wall {doc['wall_s']:.0f} s")
  return 1 if any(r.get("error") for r in results.values()) else 0


def write(doc: dict, path: str) -> None:
  """PATH (the JSON), PATH's .md (the table) and, with matplotlib, its .png."""
  gpus = doc["config"]["gpus"]
  stem = common.stem_of(Path(path))
  common.write_results(stem, doc, format_table(doc["rows"], gpus), plot)
  print(f"wrote {stem}.json (+ .md)")


def plot(plt, doc: dict, path: Path) -> str | None:
  """Weak-scaling efficiency per layout and policy, each bar labelled with its step times."""
  rows = [r for r in doc["rows"] if r.get("efficiency")]
  if not rows:
    return "no plot: no scaling row"
  n, cfg = doc["config"]["gpus"], doc["config"]
  with common.figure(plt, path, figsize=(7, 4), dpi=110) as (_, ax):
    labels = [f"{r['layout']} {r['policy']}" for r in rows]
    bars = ax.bar(labels, [100 * r["efficiency"] for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows):
      ax.annotate(
        f"{100 * r['efficiency']:.1f}%\n{r['step_ms_1']:.0f} -> {r['step_ms_n']:.0f} ms",
        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
        ha="center",
        va="bottom",
        fontsize=8,
      )
    ax.axhline(100, color="k", lw=0.6)
    ax.set(
      ylim=(0, 125),
      ylabel=f"tokens/s per GPU, {n} GPUs / 1 GPU (%)",
      title=f"weak scaling, GPT {cfg['preset']}, {cfg['batch_per_gpu']} x {cfg['seq']} tokens "
      f"per GPU, {doc['env'].get('device_kind')}",
    )
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, axis="y")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--gpus", type=int, default=2, help="devices of the scaled run (vs 1)")
  p.add_argument("--preset", default="medium")
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--batch-per-gpu", type=int, default=16)
  p.add_argument("--steps", type=int, default=10, help="measured steps (median)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument(
    "--offload",
    default="layer_in",
    help="comma-separated tags offloaded (offload: nvme, offload_host: host tier)",
  )
  p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
  p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS))
  p.add_argument("--fsdp-keep", action="store_true", help="also the keep policy under FSDP")
  p.add_argument(
    "--attention",
    default="auto",
    choices=("auto", "cudnn", "xla"),
    help="dot_product_attention implementation (models' ModelConfig.attention)",
  )
  p.add_argument("--host-cache", default="4GiB", help="engine host cache per process")
  p.add_argument(
    "--host-tier", default="8GiB", help="engine host tier per process (offload_host's tags)"
  )
  p.add_argument("--store-dir", default=None, help="root of the per-GPU store directories")
  common.add_out_option(p)
  p.add_argument("--child-timeout", type=float, default=330)
  p.add_argument(
    "--cpu-smoke",
    action="store_true",
    help="CPU devices and the tiny preset (tests the script, not the speed)",
  )
  p.add_argument("--replot", type=Path, metavar="JSON", help="table and plot of a saved JSON again")
  p.add_argument("--child", help=argparse.SUPPRESS)
  return p


def count_collectives(hlo: str) -> dict:
  """The collectives of a compiled program's HLO text: ``{"by_kind": {kind: count}, "total":
  count, "ops": sorted "kind result-type" strings}`` (an async start/done pair counted once)."""
  ops = sorted(f"{m[1]} {m[0]}" for m in _COLLECTIVE_RE.findall(hlo))
  kinds = collections.Counter(op.split(" ", 1)[0] for op in ops)
  return {"by_kind": {k: kinds[k] for k in COLLECTIVES}, "total": len(ops), "ops": ops}


def added_collectives(row: dict, remat: dict | None) -> tuple[int | None, bool | None]:
  """(collectives ``row`` has beyond ``remat``'s, whether both have the same ones with the same
  result types); (None, None) for a policy that does not offload or without a remat row."""
  if row["policy"] not in OFFLOAD_POLICIES or not remat:
    return None, None
  mine, theirs = row.get("collectives"), remat.get("collectives")
  if not mine or not theirs:
    return None, None
  return mine["total"] - theirs["total"], mine["ops"] == theirs["ops"]


def scaling_rows(results: dict, n: int) -> list[dict]:
  one = {(r["policy"]): r for r in results.get(1, {}).get("rows", [])}
  mine = results.get(n, {}).get("rows", [])
  remat = {r["layout"]: r for r in mine if r["policy"] == "remat"}
  rows = []
  for r in mine:
    base = one.get(r["policy"])
    added, same = added_collectives(r, remat.get(r["layout"]))
    row = {
      "layout": r["layout"],
      "policy": r["policy"],
      "gpus": n,
      "step_ms_1": base and base["step_ms_median"],
      "step_ms_n": r["step_ms_median"],
      "tok_s_per_gpu_1": base and base["tok_s_per_gpu"],
      "tok_s_per_gpu_n": r["tok_s_per_gpu"],
      "GB_stored_per_gpu_step": r.get("GB_stored_per_gpu_step"),
      "collectives_n": (r.get("collectives") or {}).get("total"),
      "collectives_added_vs_remat": added,
      "collectives_same_as_remat": same,
    }
    row["efficiency"] = (r["tok_s_per_gpu"] / base["tok_s_per_gpu"]) if base else None
    rows.append(row)
  return rows


def format_table(rows: list[dict], n: int) -> str:
  head = (
    f"| layout | policy | step ms (1 GPU) | step ms ({n} GPUs) | tok/s/GPU (1) | "
    f"tok/s/GPU ({n}) | weak-scaling eff. | GB stored/GPU/step | collectives ({n}) | "
    "+coll. vs remat |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
  )
  fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
  lines = [head] + [
    f"| {r['layout']} | {r['policy']} | {fmt(r['step_ms_1'], '.1f')} | "
    f"{fmt(r['step_ms_n'], '.1f')} | {fmt(r['tok_s_per_gpu_1'], ',.0f')} | "
    f"{fmt(r['tok_s_per_gpu_n'], ',.0f')} | "
    f"{fmt(r['efficiency'] and 100 * r['efficiency'], '.1f')}% | "
    f"{fmt(r['GB_stored_per_gpu_step'], '.3f')} | {fmt(r.get('collectives_n'), 'd')} | "
    f"{_added(r)} |"
    for r in rows
  ]
  return "\n".join(lines)


def _added(row: dict) -> str:
  """The "+coll. vs remat" cell: the count, flagged when the collectives differ all the same."""
  added = row.get("collectives_added_vs_remat")
  if added is None:
    return "-"
  return f"{added:+d}" if row.get("collectives_same_as_remat") else f"{added:+d} (differ)"


# ---------------------------------------------------------------------------------------------
# Child: one GPU count, every configuration


def child(cfg: dict) -> int:
  import jax
  import numpy as np

  import jax_ssdtrain as ssd
  from models import parallel, training

  n = cfg["gpus"]
  devices = jax.devices()[:n]
  if len(devices) != n:
    print(json.dumps({"error": f"needs {n} devices, found {jax.devices()}"}))
    return 1
  ssd.configure(
    directory=cfg["store"],
    host_cache_bytes=cfg["host_cache"],
    host_tier_bytes=cfg.get("host_tier", "8GiB"),
  )
  tags = [t for t in cfg["offload"].split(",") if t]
  preset = "tiny" if cfg["cpu"] else cfg["preset"]
  seq = 16 if cfg["cpu"] else cfg["seq"]
  batch = cfg["batch_per_gpu"] if not cfg["cpu"] else 2
  rows = []
  for layout in cfg["layouts"]:
    par = parallel.Parallelism(data=n, fsdp=(layout == "fsdp"))
    mesh = par.mesh(devices)
    policies = [
      p for p in cfg["policies"] if not (layout == "fsdp" and p == "keep" and not cfg["fsdp_keep"])
    ]
    for policy in policies:
      if policy in OFFLOAD_POLICIES:
        locations = {t: OFFLOAD_POLICIES[policy] for t in tags}
      else:
        locations = {"remat": {t: "device" for t in tags}, "keep": None}[policy]
      run = training.RunConfig(
        preset=preset,
        batch=batch * n,
        seq_len=seq,
        steps=cfg["warmup"] + cfg["steps"],
        locations=locations,
        remat_policy="keep" if locations is None else None,
        min_bytes=0,
        model_overrides={"attention": cfg["attention"]},
      )
      state, _, _ = training.create_train_state(run)
      state, shardings = training.shard_train_state(state, par, mesh)
      step_fn = training.jit_train_step(shardings)
      rng = jax.random.key(0)
      data = np.random.RandomState(0).randint(0, 256, (4, batch * n, seq + 1)).astype(np.int32)
      batches = [training.shard_batch(b, par, mesh) for b in data]
      t0 = time.perf_counter()
      # jit's cache keeps this executable: the first call below runs it, no second compilation
      hlo = step_fn.lower(state, batches[0], rng).compile().as_text()
      compile_s = time.perf_counter() - t0
      collectives = count_collectives(hlo)
      del hlo
      t0 = time.perf_counter()
      state, metrics = step_fn(state, batches[0], rng)
      jax.block_until_ready(metrics)
      first_step_s = time.perf_counter() - t0
      for i in range(1, cfg["warmup"]):
        state, metrics = step_fn(state, batches[i % 4], rng)
      jax.block_until_ready(metrics)
      ssd.flush()
      ssd.reset_stats()
      times = []
      for i in range(cfg["steps"]):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batches[i % 4], rng)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
      ssd.flush()
      dstats = ssd.device_stats()
      med = statistics.median(times)
      rows.append(
        {
          "layout": layout,
          "policy": policy,
          "gpus": n,
          "batch_per_gpu": batch,
          "seq": seq,
          "preset": preset,
          "locations": locations,
          "compile_s": compile_s,
          "first_step_s": first_step_s,
          "collectives": collectives,
          "step_ms_all": [1e3 * t for t in times],
          "step_ms_median": 1e3 * med,
          "tok_s_per_gpu": batch * seq / med,
          "loss": float(metrics["loss"]),
          "GB_stored_per_gpu_step": (
            max((s["bytes_written"] for s in dstats.values()), default=0) / 1e9 / cfg["steps"]
          ),
          "device_stats": {str(k): v for k, v in dstats.items()},
          "engine": {
            k: v
            for k, v in ssd.stats().items()
            if k
            in (
              "disk_bytes_written",
              "disk_bytes_read",
              "stall_seconds",
              "forwarded_bytes",
              "write_skipped_bytes",
              "host_tier_bytes_peak",
            )
          },
        }
      )
      print(
        f"{layout} {policy}: {1e3 * med:.1f} ms/step (compile {compile_s:.0f} s, first step "
        f"{first_step_s:.1f} s, {collectives['total']} collectives)",
        file=sys.stderr,
        flush=True,
      )
      del state, batches
  print(
    json.dumps(
      {
        "device_kind": devices[0].device_kind,
        "rows": rows,
        "store_directories": list(ssd.store_directories()),
      }
    )
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
