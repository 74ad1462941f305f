"""Weak scaling of GPT training with offload over 1, 2, 4... GPUs of one host (DP and FSDP).

Per-GPU work is fixed (``--batch-per-gpu`` sequences of ``--seq`` tokens); each GPU stores its
own shards of the offloaded tag(s) in a store directory of its own (``<store-dir>/gpu{device}``).
``--gpus`` names the GPU counts: ``--gpus 4`` is 1 vs 4, ``--gpus 1,2,4`` runs each (1 is
always run: it is the reference). For every policy and count N the table gives tokens/s per GPU
with 1 and with N GPUs and the weak-scaling efficiency (tokens/s per GPU with N GPUs / with 1
GPU), and for the offload policies how many points of efficiency they lose against ``remat``,
the same layout without offload ("points vs no offload"):

* ``offload``:      ``--offload`` tags (default ``layer_in``) in the nvme store, the rest
  recomputed;
* ``offload_host``: the same tags in the engine's host tier (pinned host memory of
  ``--host-tier`` bytes per process);
* ``remat``:        the same tags saved on the device instead (full recompute from the layer
  input), the optimizer state on the device: the no-offload reference;
* ``keep``:         no rematerialization at all (DP only unless ``--fsdp-keep``: a reference,
  and the run must stay under 6 minutes with its compilations).

The offload policies also keep AdamW's state (scripts.training.make_optimizer: clipping and
AdamW) in the store, at ``--optimizer-location`` (default ``host``: the host tier; ``device``
keeps it on the device), through ``RunConfig.optimizer_location`` as ``scripts/train.py
--optimizer-location`` does (``jax_ssdtrain.offload_optimizer``; under FSDP each GPU streams its
shard of the state, under DP its whole replica).

Each configuration's compiled program is also searched for collectives (all-gather, all-reduce,
reduce-scatter, collective-permute, all-to-all; an async ``-start``/``-done`` pair counted
once): the JSON has them by kind, and the table's "+coll. vs remat" column gives how many the
offload policies add to ``remat`` of the same layout with N GPUs (the offload adds none: 0).

The collectives' arithmetic (a second table, ``arithmetic`` in the JSON): from the model's
parameter count and dtype, the bytes each GPU sends per step in ring collectives (DP: the
gradients' all-reduce, 2(N-1)/N x gradient bytes; FSDP: the parameters gathered twice, forward
and backward, and the gradients reduce-scattered, (N-1)/N x (2 x parameter bytes + gradient
bytes)), their time at ``--nvlink-gbps`` per direction, and the efficiency that leaves if none
of it overlaps compute; for the offload policies also the optimizer state streamed each way per
GPU at min(``--link-gbps``, ``--host-gbps`` / N) (each GPU's link, the host's summed rate; see
docs/parallel.md): what says why a layout scales below 95%, if it does.

One child process per GPU count runs its configurations one after the other, on the first N
GPUs (``CUDA_VISIBLE_DEVICES``: of the machine's, or of those this process is given), 1 first,
then the largest count, then the others (``--budget-s`` skips the counts that no longer fit,
and a child that times out keeps the configurations it finished); this process only
orchestrates and writes ``multigpu_<device>_<date>.json``, a table (``.md``) and a plot
(``.png``) to ``--out``.

    python -m scripts.bench_multigpu                       # 2 H200: ~4-5 min with compiles
    python -m scripts.bench_multigpu --preset medium --batch-per-gpu 8 --steps 10
    python -m scripts.bench_multigpu --gpus 1,2,4 --preset gpt-1.3b --policies offload_host,remat \
      --batch-per-gpu 16 --host-tier 128GiB             # bash scripts/gpu.sh multigpu124
    python -m scripts.bench_multigpu --cpu-smoke           # 2 CPU devices, tiny preset
    python -m scripts.bench_multigpu --cpu-smoke --gpus 1,2,4 --policies offload_host,remat
    python -m scripts.bench_multigpu --replot benchmarks/multigpu.json   # table and plot again
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
# --cpu-smoke's model: the tiny preset widened so that every leaf of the optimizer state is at
# least offload_optimizer's min_bytes (4 KiB here: RunConfig's floor) and stored. A smaller leaf
# stays on the device, sharded like its parameter as remat's state (it was replicated, and XLA
# gathered it every step: tiny's 16 small all-gathers; tests/_sharded_optimizer_worker.py).
CPU_WIDTH = {"hidden": 512, "mlp_dim": 2048}
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


def gpu_counts(text: str) -> list[int]:
  """``--gpus``: "N" is 1 and N, "1,2,4" each of them; 1 (the reference) always included."""
  try:
    counts = {int(t) for t in text.split(",") if t.strip()}
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected N or a list N1,N2,...: {text!r}") from None
  if not counts or min(counts) < 1:
    raise argparse.ArgumentTypeError(f"GPU counts must be positive: {text!r}")
  return sorted(counts | {1})


def run_order(counts: list[int]) -> list[int]:
  """1 (every row's reference), then the largest count (the one the result is about), then the
  others in ascending order: what a short ``--budget-s`` leaves out is the counts between."""
  top = max(counts)
  return [1] + ([top] if top > 1 else []) + [n for n in counts if n not in (1, top)]


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
    optimizer_location=args.optimizer_location,
  )
  unknown = sorted(set(args.policies) - set(POLICIES))
  if unknown:
    raise SystemExit(f"unknown policies {unknown} (known: {', '.join(POLICIES)})")
  counts = args.gpus
  results, t_start = {}, time.perf_counter()
  for n in run_order(counts):
    left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t_start)
    if left is not None and left < 30:
      results[n] = {"error": f"not run: --budget-s {args.budget_s:.0f} spent", "rows": []}
      print(f"{n} device(s): not run (budget spent)", flush=True)
      continue
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
      timeout=args.child_timeout if left is None else min(args.child_timeout, left),
      env=env,
      partial=True,
    )
    results[n] = out
    print(
      f"[{time.perf_counter() - t_start:.0f} s] {n} device(s): {out.get('error') or 'ok'}",
      flush=True,
    )
    if out.get("error"):
      print(out.get("stderr_tail", ""), file=sys.stderr)
  results = {n: results[n] for n in counts}
  rows = scaling_rows(results, counts)
  config = base | {
    "gpus": counts,
    "store_dir": store_root,
    "nvlink_gbps": args.nvlink_gbps,
    "link_gbps": args.link_gbps,
    "host_gbps": args.host_gbps,
  }
  doc = {
    "date": common.today(),
    "env": common.host_env() | {"device_kind": results[1].get("device_kind")},
    "config": config,
    "runs": results,
    "rows": rows,
    "arithmetic": arithmetic_rows(results, counts, config),
    "wall_s": time.perf_counter() - t_start,
  }
  doc["summary"] = summary(doc)
  os.makedirs(args.out, exist_ok=True)
  kind = common.slug(common.device_kind([results[1]]))
  write(doc, os.path.join(args.out, f"multigpu_{kind}_{doc['date']}.json"))
  for line in doc["summary"]["lines"]:
    print(line)
  print(f"wall {doc['wall_s']:.0f} s")
  return 1 if any(r.get("error") for r in results.values()) else 0


def _counts(doc: dict) -> list[int]:
  """The GPU counts of a JSON: a list, or (older files) the one scaled count besides 1."""
  gpus = doc["config"]["gpus"]
  return gpus if isinstance(gpus, list) else [1, gpus]


def write(doc: dict, path: str) -> None:
  """PATH (the JSON), PATH's .md (the tables) and, with matplotlib, its .png."""
  stem = common.stem_of(Path(path))
  text = format_table(doc["rows"], _counts(doc))
  if doc.get("arithmetic"):
    text += "\n\n" + format_arithmetic(doc["arithmetic"], doc["config"])
  common.write_results(stem, doc, text, plot)
  print(f"wrote {stem}.json (+ .md)")


def plot(plt, doc: dict, path: Path) -> str | None:
  """Weak-scaling efficiency against the GPU count, a line per layout and policy (1 GPU: 100%),
  each point labelled with its step time."""
  rows = [r for r in doc["rows"] if r.get("efficiency")]
  if not rows:
    return "no plot: no scaling row"
  cfg, counts = doc["config"], _counts(doc)
  lines = collections.defaultdict(list)
  for r in rows:
    lines[(r["layout"], r["policy"])].append(r)
  with common.figure(plt, path, figsize=(7, 4), dpi=110) as (_, ax):
    for (layout, policy), rs in sorted(lines.items()):
      rs = sorted(rs, key=lambda r: r["gpus"])
      xs = [1] + [r["gpus"] for r in rs]
      ys = [100.0] + [100 * r["efficiency"] for r in rs]
      style = "-" if policy in OFFLOAD_POLICIES else "--"
      ax.plot(xs, ys, style, marker="o", label=f"{layout} {policy}")
      for r in rs:
        ax.annotate(
          f"{r['step_ms_n']:.0f} ms",
          (r["gpus"], 100 * r["efficiency"]),
          fontsize=7,
          textcoords="offset points",
          xytext=(3, 3),
        )
    ax.axhline(95, color="k", lw=0.6, ls=":")
    ax.set_xticks(counts)
    ax.set(
      xlabel="GPUs",
      ylabel="tokens/s per GPU vs 1 GPU (%)",
      title=f"weak scaling, GPT {'tiny (CPU smoke)' if cfg.get('cpu') else cfg['preset']}, "
      f"{cfg['batch_per_gpu']} x {cfg['seq']} tokens per GPU, {doc['env'].get('device_kind')}",
    )
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--gpus",
    type=gpu_counts,
    default=[1, 2],
    help="GPU counts: N (1 vs N) or a list such as 1,2,4 (1 is always run)",
  )
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
    "--optimizer-location",
    default="host",
    choices=("host", "nvme", "host,nvme", "device"),
    help="where the offload policies keep the optimizer state (RunConfig.optimizer_location, "
    "jax_ssdtrain.offload_optimizer); device: on the device, as remat and keep always do",
  )
  p.add_argument(
    "--attention",
    default="auto",
    choices=("auto", "cudnn", "xla"),
    help="dot_product_attention implementation (models' ModelConfig.attention)",
  )
  p.add_argument("--host-cache", default="4GiB", help="engine host cache per process")
  p.add_argument(
    "--host-tier",
    default="8GiB",
    help="engine host tier per process: offload_host's tags and the optimizer state in the "
    "host tier (under DP one replica per GPU, two versions during the update)",
  )
  p.add_argument("--store-dir", default=None, help="root of the per-GPU store directories")
  p.add_argument(
    "--nvlink-gbps",
    type=float,
    default=450.0,
    help="GPU-to-GPU rate per direction for the collectives' arithmetic, GB/s (450: H100 SXM's "
    "NVLink 4, 900 GB/s both directions; NCCL reaches about 80-90%% of it)",
  )
  p.add_argument(
    "--link-gbps",
    type=float,
    default=50.7,
    help="one GPU's host link, each way with both at once, GB/s (the optimizer stream's "
    "arithmetic; measured on the 4-GPU node, docs/parallel.md)",
  )
  p.add_argument(
    "--host-gbps",
    type=float,
    default=88.0,
    help="the host's summed rate each way with every GPU copying, GB/s (docs/parallel.md)",
  )
  common.add_out_option(p)
  p.add_argument("--child-timeout", type=float, default=330)
  p.add_argument(
    "--budget-s",
    type=float,
    default=None,
    help="wall-clock budget of the whole run: counts that would start with under 30 s left "
    "are not run, a child's timeout is cut to what is left",
  )
  p.add_argument(
    "--cpu-smoke",
    action="store_true",
    help="CPU devices and the tiny preset, widened to hidden 512 (tests the script, not the speed)",
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


def scaling_rows(results: dict, counts: list[int]) -> list[dict]:
  """A row per layout, policy and count N > 1: the step and tokens/s per GPU at 1 and N, the
  efficiency, its points against remat of the same layout and N, the collectives added."""
  ok = lambda r: "error" not in r  # noqa: E731
  one = {r["policy"]: r for r in results.get(1, {}).get("rows", []) if ok(r)}
  rows = []
  for n in counts:
    if n == 1:
      continue
    mine = results.get(n, {}).get("rows", [])
    remat = {r["layout"]: r for r in mine if r["policy"] == "remat" and ok(r)}
    for r in mine:
      row = {"layout": r["layout"], "policy": r["policy"], "gpus": n}
      if not ok(r):
        rows.append(row | {"error": r["error"], "step_ms_1": None, "step_ms_n": None})
        continue
      base = one.get(r["policy"])
      added, same = added_collectives(r, remat.get(r["layout"]))
      row |= {
        "optimizer_location": r.get("optimizer_location"),
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
  # points of efficiency against the same layout and count without offload (remat)
  ref = {(r["layout"], r["gpus"]): r.get("efficiency") for r in rows if r["policy"] == "remat"}
  for row in rows:
    theirs = ref.get((row["layout"], row["gpus"]))
    mine = row.get("efficiency")
    offloads = row["policy"] in OFFLOAD_POLICIES
    row["points_vs_no_offload"] = (
      100 * (mine - theirs) if offloads and mine is not None and theirs is not None else None
    )
  return rows


def format_table(rows: list[dict], counts: list[int]) -> str:
  head = (
    "| layout | policy | GPUs (N) | step ms (1 GPU) | step ms (N) | tok/s/GPU (1) | "
    "tok/s/GPU (N) | weak-scaling eff. | points vs no offload | GB stored/GPU/step | "
    "collectives (N) | +coll. vs remat |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
  )
  fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
  lines = [head]
  for r in rows:
    if r.get("error"):
      why = str(r["error"]).splitlines()[0][:80]
      lines.append(f"| {r['layout']} | {r['policy']} | {r['gpus']} | failed: {why} |")
      continue
    eff = r.get("efficiency")
    lines.append(
      f"| {r['layout']} | {r['policy']} | {r.get('gpus', max(counts))} | "
      f"{fmt(r['step_ms_1'], '.1f')} | {fmt(r['step_ms_n'], '.1f')} | "
      f"{fmt(r['tok_s_per_gpu_1'], ',.0f')} | {fmt(r['tok_s_per_gpu_n'], ',.0f')} | "
      f"{fmt(eff and 100 * eff, '.1f')}% | {fmt(r.get('points_vs_no_offload'), '+.1f')} | "
      f"{fmt(r['GB_stored_per_gpu_step'], '.3f')} | {fmt(r.get('collectives_n'), 'd')} | "
      f"{_added(r)} |"
    )
  return "\n".join(lines)


def _added(row: dict) -> str:
  """The "+coll. vs remat" cell: the count, flagged when the collectives differ all the same."""
  added = row.get("collectives_added_vs_remat")
  if added is None:
    return "-"
  return f"{added:+d}" if row.get("collectives_same_as_remat") else f"{added:+d} (differ)"


# ---------------------------------------------------------------------------------------------
# The collectives' arithmetic


def collective_bytes(layout: str, n: int, param_bytes: float, grad_bytes: float) -> float:
  """Bytes each of ``n`` GPUs sends (and receives) per step in ring collectives: DP all-reduces
  the gradients, 2 (n-1)/n of their bytes; FSDP gathers the parameters twice (forward, and
  backward with its recomputation) and reduce-scatters the gradients, (n-1)/n of each."""
  f = (n - 1) / n
  if layout == "dp":
    return 2 * f * grad_bytes
  if layout == "fsdp":
    return f * (2 * param_bytes + grad_bytes)
  raise ValueError(f"unknown layout {layout!r}")


def optimizer_stream_bytes(layout: str, n: int, opt_bytes: float) -> float:
  """Optimizer state each GPU reads from (and writes to) the store per step: its replica under
  DP, its shard (1/n) under FSDP."""
  return opt_bytes / n if layout == "fsdp" else opt_bytes


def stream_gbps(n: int, link_gbps: float, host_gbps: float) -> float:
  """Each GPU's rate to the host with ``n`` copying at once: min(its link, the host's / n)."""
  return min(link_gbps, host_gbps / n)


def arithmetic_rows(results: dict, counts: list[int], config: dict) -> list[dict]:
  """Per layout and count N > 1: the collectives' bytes and time per GPU and step at
  ``nvlink_gbps``, the optimizer stream's at min(``link_gbps``, ``host_gbps`` / N), and the
  efficiency each leaves if nothing overlaps (from the measured 1-GPU steps)."""
  model = next((r["model"] for r in results.values() if r.get("model")), None)
  if model is None:
    return []
  one = {r["policy"]: r for r in results.get(1, {}).get("rows", []) if "error" not in r}
  link, host, nvlink = config["link_gbps"], config["host_gbps"], config["nvlink_gbps"]
  opt = model["opt_state_bytes"]
  t_opt_1 = 1e3 * opt / (link * 1e9)  # ms, one GPU streaming its whole state
  rows = []
  for n in counts:
    if n == 1:
      continue
    for layout in config["layouts"]:
      coll = collective_bytes(layout, n, model["param_bytes"], model["grad_bytes"])
      t_coll = 1e3 * coll / (nvlink * 1e9)
      stream = optimizer_stream_bytes(layout, n, opt)
      rate = stream_gbps(n, link, host)
      t_opt = 1e3 * stream / (rate * 1e9)
      row = {
        "layout": layout,
        "gpus": n,
        "collective_GB_per_gpu_step": coll / 1e9,
        "collective_ms": t_coll,
        "optimizer_GB_per_gpu_step": stream / 1e9,
        "optimizer_stream_gbps": rate,
        "optimizer_ms_1": t_opt_1,
        "optimizer_ms_n": t_opt,
      }
      remat = one.get("remat")
      row["remat_efficiency_no_overlap"] = remat and remat["step_ms_median"] / (
        remat["step_ms_median"] + t_coll
      )
      offload = next((one[p] for p in OFFLOAD_POLICIES if p in one), None)
      if offload and offload.get("optimizer_location") not in (None, "device"):
        s1 = offload["step_ms_median"]
        row["offload_policy"] = offload["policy"]
        row["offload_efficiency_no_overlap"] = s1 / (s1 + t_coll + t_opt - t_opt_1)
      rows.append(row)
  return rows


def format_arithmetic(rows: list[dict], config: dict) -> str:
  nv, link, host = config["nvlink_gbps"], config["link_gbps"], config["host_gbps"]
  head = (
    f"Collectives' arithmetic (ring; {nv:g} GB/s per direction between GPUs) and the optimizer "
    f"stream (per GPU at min({link:g}, {host:g}/N) GB/s each way): the efficiency each leaves "
    "if nothing overlaps the step\n\n"
    "| layout | GPUs (N) | collectives GB/GPU/step | ms | remat eff. if not overlapped | "
    "optimizer stream GB/GPU/step (each way) | GB/s per GPU | ms (1 GPU -> N) | "
    "offload eff. if not overlapped |\n"
    "|---|---|---|---|---|---|---|---|---|"
  )
  fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
  pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
  lines = [head] + [
    f"| {r['layout']} | {r['gpus']} | {r['collective_GB_per_gpu_step']:.2f} | "
    f"{r['collective_ms']:.1f} | {pct(r.get('remat_efficiency_no_overlap'))} | "
    f"{r['optimizer_GB_per_gpu_step']:.2f} | {r['optimizer_stream_gbps']:.1f} | "
    f"{fmt(r['optimizer_ms_1'], '.0f')} -> {fmt(r['optimizer_ms_n'], '.0f')} | "
    f"{pct(r.get('offload_efficiency_no_overlap'))} |"
    for r in rows
  ]
  return "\n".join(lines)


def summary(doc: dict) -> dict:
  """The issue's check at the largest count: each offload row's efficiency (>= 95%), its points
  against remat (within 1), its added collectives (0); ``lines`` say it in words."""
  top = max(_counts(doc))
  rows = [r for r in doc["rows"] if r["gpus"] == top and r["policy"] in OFFLOAD_POLICIES]
  checks, lines = [], []
  for r in rows:
    if r.get("error"):
      checks.append({"layout": r["layout"], "policy": r["policy"], "error": r["error"]})
      lines.append(f"{r['layout']} {r['policy']} at {top}: failed")
      continue
    eff, pts, added = r["efficiency"], r["points_vs_no_offload"], r["collectives_added_vs_remat"]
    c = {
      "layout": r["layout"],
      "policy": r["policy"],
      "efficiency_ge_95": eff is not None and eff >= 0.95,
      "within_1_point": pts is not None and pts >= -1.0,
      "no_added_collective": added == 0 and r["collectives_same_as_remat"] is True,
    }
    checks.append(c)
    lines.append(
      f"{r['layout']} {r['policy']} at {top} GPUs: "
      + ("-" if eff is None else f"{100 * eff:.1f}%")
      + (f", {pts:+.1f} points vs remat" if pts is not None else "")
      + f", {added if added is not None else '?'} collective(s) added: "
      + ("meets" if all(v for k, v in c.items() if k not in ("layout", "policy")) else "short")
    )
  return {"gpus": top, "checks": checks, "lines": lines}


# ---------------------------------------------------------------------------------------------
# Child: one GPU count, every configuration


def _tree_bytes(tree) -> int:
  import jax

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _model_arithmetic(run, params) -> dict:
  """The parameter count and bytes (gradients: the parameters' dtype) and the bytes of the
  optimizer state as it is on the device (``make_optimizer`` without a store location)."""
  import jax

  from scripts import training

  tx, _ = training.make_optimizer(dataclasses.replace(run, optimizer_location=None))
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  opt = jax.eval_shape(tx.init, shapes)
  return {
    "param_count": sum(p.size for p in jax.tree.leaves(params)),
    "param_bytes": _tree_bytes(shapes),
    "grad_bytes": _tree_bytes(shapes),
    "opt_state_bytes": _tree_bytes(opt),
  }


def child(cfg: dict) -> int:
  import jax

  import jax_ssdtrain as ssd

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
  out = {"device_kind": devices[0].device_kind, "rows": [], "partial": True}
  failed = False
  for layout in cfg["layouts"]:
    policies = [
      p for p in cfg["policies"] if not (layout == "fsdp" and p == "keep" and not cfg["fsdp_keep"])
    ]
    for policy in policies:
      try:
        row, model = _measure(cfg, devices, layout, policy)
      except Exception as e:  # noqa: BLE001 -- the row says why; the other configurations run
        failed = True
        row = {"layout": layout, "policy": policy, "gpus": n, "error": f"{type(e).__name__}: {e}"}
        print(f"{layout} {policy}: {row['error']}", file=sys.stderr, flush=True)
        model = None
      out["rows"].append(row)
      if model and "model" not in out:
        out["model"] = model
      ssd.collect()  # the configuration's stored state, released
      print(json.dumps(out), flush=True)  # what a timeout leaves: the configurations so far
  out["partial"] = False
  out["store_directories"] = list(ssd.store_directories())
  print(json.dumps(out))
  return 1 if failed else 0


def _measure(cfg: dict, devices, layout: str, policy: str) -> tuple[dict, dict]:
  """One configuration: (its row, the model's arithmetic)."""
  import jax
  import numpy as np

  import jax_ssdtrain as ssd
  from models import parallel
  from scripts import training

  n = len(devices)
  tags = [t for t in cfg["offload"].split(",") if t]
  preset = "tiny" if cfg["cpu"] else cfg["preset"]
  seq = 16 if cfg["cpu"] else cfg["seq"]
  batch = cfg["batch_per_gpu"] if not cfg["cpu"] else 2
  par = parallel.Parallelism(data=n, fsdp=(layout == "fsdp"))
  mesh = par.mesh(devices)
  opt_location = None
  if policy in OFFLOAD_POLICIES:
    locations = {t: OFFLOAD_POLICIES[policy] for t in tags}
    where = cfg.get("optimizer_location", "device")
    opt_location = None if where == "device" else where
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
    optimizer_location=opt_location,
    model_overrides={"attention": cfg["attention"]} | (CPU_WIDTH if cfg["cpu"] else {}),
  )
  t0 = time.perf_counter()
  state, _, _ = training.create_train_state(run)
  model = _model_arithmetic(run, state.params)
  state, shardings = training.shard_train_state(state, par, mesh)
  setup_s = time.perf_counter() - t0
  step_fn = training.jit_train_step(shardings)
  rng = jax.random.key(0)
  data = np.random.RandomState(0).randint(0, 256, (4, batch * n, seq + 1)).astype(np.int32)
  batches = [training.shard_batch(b, par, mesh) for b in data]

  def step(state, i):
    state, metrics = step_fn(state, batches[i % 4], rng)
    jax.block_until_ready(metrics)
    if opt_location:  # the state's version before this step's, as scripts/train.py does
      ssd.collect()
    return state, metrics

  t0 = time.perf_counter()
  # jit's cache keeps this executable: the first call below runs it, no second compilation
  hlo = step_fn.lower(state, batches[0], rng).compile().as_text()
  compile_s = time.perf_counter() - t0
  collectives = count_collectives(hlo)
  del hlo
  t0 = time.perf_counter()
  state, metrics = step(state, 0)
  first_step_s = time.perf_counter() - t0
  for i in range(1, cfg["warmup"]):
    state, metrics = step(state, i)
  ssd.flush()
  ssd.reset_stats()
  times = []
  for i in range(cfg["steps"]):
    t0 = time.perf_counter()
    state, metrics = step(state, i)
    times.append(time.perf_counter() - t0)
  ssd.flush()
  dstats = ssd.device_stats()
  med = statistics.median(times)
  cache_size = getattr(step_fn, "_cache_size", None)  # jit's compilations (a private method)
  row = {
    "layout": layout,
    "policy": policy,
    "gpus": n,
    "batch_per_gpu": batch,
    "seq": seq,
    "preset": preset,
    "locations": locations,
    "optimizer_location": opt_location or "device",
    "setup_s": setup_s,
    "compile_s": compile_s,
    "compilations": cache_size() if cache_size else None,
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
  print(
    f"{layout} {policy}: {1e3 * med:.1f} ms/step (setup {setup_s:.0f} s, compile "
    f"{compile_s:.0f} s, first step {first_step_s:.1f} s, {collectives['total']} collectives, "
    f"{row['compilations']} compilation(s))",
    file=sys.stderr,
    flush=True,
  )
  return row, model  # the state and batches go with this frame


if __name__ == "__main__":
  sys.exit(main())
