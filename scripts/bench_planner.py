"""Is the planner's model honest? Predicted vs measured step time, and a device-memory cap.

For the GPT-like stack of the benchmarks (``scripts.bench_common``: bench_rok's layer and
weights) and the models' GPT presets: profile one layer (``jax_ssdtrain.profile``), plan (``auto``: every location;
``auto_nvme``: device / remat / nvme only), and measure side by side in one process:
``keep`` (no remat), ``selective`` (every tag saved on the device), ``auto``, ``auto_nvme``.
Reports predicted vs measured step ms, step over keep, and the share of the disk's allowance
(write GB/s x the all-on-device step) that ``auto_nvme`` offloads.

Memory cap (``--cap-gb``, one ``--cap-shape``): a policy x batch x tokens/s grid of JAX's
policies (keep, recompute, selective, JAX's pinned-host offload of the layer input and of the 4
names) and two of ours (host tier: layer input, 4 names), each compiled step's device memory
from XLA's memory analysis (arguments + outputs + temporaries - aliased, plus the engine's
staging arena for ours); then, under each cap, every policy's best fitting batch, and ``auto``
and ``auto_nvme`` from ``jax_ssdtrain.plan_for_budget`` measured beside them.

Writes ``planner_<device>_<date>.json``, a markdown table (``.md``) and plots (``.png``,
``_cap.png``) to ``--out``; ``--replot`` merges saved runs into one (their parts in order).

    python -m scripts.bench_planner --store-dir /var/tmp/plan          # everything (~8 min H100)
    python -m scripts.bench_planner --shape 4096,2048,4,8 --no-presets --no-cap
    python -m scripts.bench_planner --tiny --steps 2 --warmup 1 --out /tmp/p   # CPU smoke
    python -m scripts.bench_planner --replot a.json b.json --out DIR  # one table and plot
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as common
from scripts.bench_common import (
  HEAD_DIM,
  POLICIES,
  device_bytes,
  make_layer,
  model_flops,
  stack_params,
)

TINY_SHAPES = common.TINY_SHAPES


def split_step(layer, policies):
  """value_and_grad of the stack, called on ``(ssd.split_layers(params, split), x)``: layers
  [0, split) under policies[0], the rest under policies[1] (None: no remat), by
  ``ssd.split_scan``. Each segment's weights are arrays of their own, so their gradients are not
  concatenated into a second copy (the planner's ``split_grad_copy=False``)."""
  import jax
  import jax.numpy as jnp

  import jax_ssdtrain as ssd

  def loss(segs, x):
    y = ssd.split_scan(lambda p, h: layer(h, p), segs, x, split=None, policies=policies)
    return jnp.mean(y.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss))


def time_steps(fn, args, steps: int, warmup: int) -> list[float]:
  import jax

  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  out = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append(time.perf_counter() - t0)
  return out


def host_all_plan(prof, min_bytes: int):
  """Every tag (of at least ``min_bytes``) of every layer in the host tier (bench_rok's
  ssd_host_named), as the planner predicts it, with the staging arena it sizes for it
  (``Plan.staging_bytes``): of the plans that use the host tier alone, the one with the least
  device memory (the last of their Pareto front)."""
  import jax_ssdtrain as ssd

  return ssd.frontier(prof, allowed=("host",), min_bytes=min_bytes)[-1]


STACK_POLICIES = ("keep", "selective", "auto", "auto_nvme", "host_all")


def _stack_policies(text: str) -> list:
  names = [v.strip() for v in text.split(",") if v.strip()]
  unknown = [n for n in names if n not in STACK_POLICIES]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
      f"--stack-policies {text!r}: known are {', '.join(STACK_POLICIES)}"
    )
  return names


def stack_policies(plan, min_bytes: int) -> dict:
  """Measured policies of one shape: name -> ((first, rest) policies, split, predicted s,
  store options)."""
  import jax_ssdtrain as ssd

  all_device = ssd.location_policy(
    {n: "device" for n, _ in plan["auto"].locations}, min_bytes=min_bytes
  )
  out = {
    "keep": (
      (None, None),
      0,
      plan["auto"].profile.num_layers
      * (plan["auto"].profile.forward_s + plan["auto"].profile.backward_s),
      {},
    ),
    "selective": ((all_device, all_device), 0, plan["auto"].baseline_s, {}),
  }
  for name in ("auto", "auto_nvme", "host_all"):
    out[name] = (
      plan[name].policies(),
      plan[name].offload_layers,
      plan[name].step_s,
      plan[name].store_options(),
    )
  return out


def run_stack(args, shape, bandwidth) -> dict:
  """Profile, plan and measure one bench_rok shape."""
  import jax

  import jax_ssdtrain as ssd

  H, S, B, L = shape
  impl = "cudnn" if jax.default_backend() == "gpu" else None
  layer = make_layer(H // HEAD_DIM, impl)
  params, x = stack_params(*shape)
  one = jax.tree.map(lambda a: a[0], params)
  t0 = time.perf_counter()
  prof = ssd.profile(
    lambda p, v: layer(v, p),
    one,
    x,
    num_layers=L,
    bandwidth=bandwidth,
    host_cache_bytes=ssd.current_config().host_cache_bytes,
    batch=B,
    repeats=args.steps,
    warmup=args.warmup,
  )
  prof = dataclasses.replace(prof, split_grad_copy=False)  # split_step: separate segments
  plans = {
    "auto": ssd.plan(prof, max_slowdown=args.max_slowdown, min_bytes=args.min_bytes),
    "auto_nvme": ssd.plan(
      prof,
      max_slowdown=args.max_slowdown,
      min_bytes=args.min_bytes,
      allowed=("device", "remat", "nvme"),
    ),
    "host_all": host_all_plan(prof, args.min_bytes),
  }
  doc = {
    "kind": "stack",
    "shape": list(shape),
    "profile": dataclasses.asdict(prof),
    "profile_s": time.perf_counter() - t0,
    "plans": {k: plan_doc(p) for k, p in plans.items()},
    "rows": [],
  }
  configured = ssd.current_config()
  for name, (pols, split, predicted, options) in stack_policies(plans, args.min_bytes).items():
    if name not in args.stack_policies:
      continue
    args_ = (ssd.split_layers(params, split), x)
    compiled = split_step(layer, pols).lower(*args_).compile()
    # entries an earlier program left (forwarded ones are never evicted) would shrink the
    # host cache of this one: each measured program starts with an empty store, with the
    # staging arena its plan sized
    ssd.configure(**{"staging_bytes": configured.staging_bytes, **options})
    ssd.reset_stats()
    times = time_steps(compiled, args_, args.steps, args.warmup)
    st = ssd.stats()
    ms = statistics.median(times) * 1e3
    doc["rows"].append(
      {
        "policy": name,
        "split": split,
        "predicted_ms": predicted * 1e3,
        "step_ms": ms,
        "step_ms_all": [t * 1e3 for t in times],
        "device_GB": device_bytes(compiled) / 1e9,
        "model_tflops": model_flops(*shape) / ms / 1e9,
        "offload_GB_per_step": st.get("bytes_written", 0) / 1e9 / (args.steps + args.warmup),
        "disk_MB_written_per_step": st.get("disk_bytes_written", 0)
        / 1e6
        / (args.steps + args.warmup),
        "stall_ms_per_step": st.get("stall_seconds", 0) * 1e3 / (args.steps + args.warmup),
        "staging_GB": ssd.stats()["staging_bytes"] / 1e9 if options else 0.0,
        "link_d2h_GBps": st.get("link_d2h_GBps"),
        "link_h2d_GBps": st.get("link_h2d_GBps"),
      }
    )
    del compiled
    print(
      f"[{','.join(map(str, shape))}] {name}: predicted {predicted * 1e3:.1f} ms, "
      f"measured {ms:.1f} ms"
      + (f" (staging {options['staging_bytes'] / 1e9:.2f} GB)" if options else ""),
      flush=True,
    )
  ssd.configure(staging_bytes=configured.staging_bytes)
  return doc


def plan_doc(plan) -> dict:
  return {
    "offload_layers": plan.offload_layers,
    "locations": {n: loc.value for n, loc in plan.locations},
    "predicted_ms": plan.step_s * 1e3,
    "stall_ms": plan.stall_s * 1e3,
    "residual_GB": plan.device_bytes / 1e9,
    "nvme_GB": plan.nvme_bytes / 1e9,
    "host_GB": plan.host_bytes / 1e9,
    "allowed_nvme_GB": plan.allowed_nvme_bytes / 1e9,
    "staging_GB": plan.staging_bytes / 1e9,
    "host_gbps": plan.profile.host_gbps,
    "nvme_fraction_of_allowed": (
      plan.nvme_bytes / plan.allowed_nvme_bytes if plan.allowed_nvme_bytes else None
    ),
    "table": plan.table(),
  }


def run_preset(args, preset: str, bandwidth) -> dict:
  """A models/ GPT preset through scripts.training: keep vs auto, predicted vs measured.
  Time outside the layers (embedding, head, optimizer) comes from a 1-layer model's step."""
  import jax

  import jax_ssdtrain as ssd
  from scripts import data as data_lib
  from scripts import training

  run = training.RunConfig(
    model="gpt",
    preset=preset,
    batch=args.preset_batch,
    seq_len=args.preset_seq,
    min_bytes=args.min_bytes,
  )
  cfg = run.model_config()
  tokens = next(
    data_lib.make_batches(
      "synthetic", "memmap", run.batch, run.example_length(cfg), cfg.vocab_size, 0
    )
  )
  rng = jax.random.key(1)

  def measure(r):
    state, _, _ = training.create_train_state(r)
    step = training.jit_train_step().lower(state, tokens, rng).compile()
    mem = device_bytes(step)
    ssd.release_all()  # as in run_stack
    times = []
    for _ in range(args.warmup + args.steps):
      t0 = time.perf_counter()
      state, metrics = step(state, tokens, rng)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    return statistics.median(times[args.warmup :]), mem

  # other_s (embedding, head, loss) and update_s (optimizer of all layers) measured by
  # profile_run from the one-layer step (scripts.training.outside_layers_seconds)
  prof = training.profile_run(
    run,
    bandwidth=bandwidth,
    repeats=args.steps,
    host_cache_bytes=ssd.current_config().host_cache_bytes,
  )
  plan = ssd.plan(prof, max_slowdown=args.max_slowdown, min_bytes=args.min_bytes)
  host_all = host_all_plan(prof, args.min_bytes)
  doc = {
    "kind": "preset",
    "preset": preset,
    "batch": run.batch,
    "seq_len": run.seq_len,
    "profile": dataclasses.asdict(prof),
    "plans": {"auto": plan_doc(plan), "host_all": plan_doc(host_all)},
    "rows": [],
  }
  keep_pred = cfg.num_layers * (prof.forward_s + prof.backward_s) + prof.other_s + prof.update_s
  configured = ssd.current_config()
  for name, r, predicted, options in (
    ("keep", run, keep_pred, {}),
    ("auto", training.apply_plan(run, plan), plan.step_s, plan.store_options()),
    ("host_all", training.apply_plan(run, host_all), host_all.step_s, host_all.store_options()),
  ):
    ssd.configure(**{"staging_bytes": configured.staging_bytes, **options})
    s, mem = measure(r)
    doc["rows"].append(
      {
        "policy": name,
        "split": r.offload_layers,
        "predicted_ms": predicted * 1e3,
        "step_ms": s * 1e3,
        "device_GB": mem / 1e9,
        "staging_GB": options.get("staging_bytes", 0) / 1e9,
        "tokens_per_s": run.batch * run.seq_len / s,
      }
    )
    print(
      f"[{preset}] {name}: predicted {predicted * 1e3:.1f} ms, measured {s * 1e3:.1f} ms",
      flush=True,
    )
  ssd.configure(staging_bytes=configured.staging_bytes)
  return doc


CAP_JAX_POLICIES = ("keep", "recompute", "selective", "jax_host_layer_in", "jax_host_named")
CAP_SSD_POLICIES = ("ssd_host_layer_in", "ssd_host_named")


def run_cap(args, shape, bandwidth) -> dict:
  """Policy x batch x tokens/s, then the best of each under every cap in ``--cap-gb``.

  Grid: every fixed policy (JAX's and two of ours, ``bench_POLICIES``) at every batch of
  ``--cap-batches`` whose compiled step fits the largest cap of ``--cap-gb`` (device bytes
  from XLA's memory analysis, plus the engine's staging arena for ours). Under each cap: each
  policy's best fitting batch, and ``auto`` / ``auto_nvme`` from ``plan_for_budget`` with a
  profile taken at each batch (small batches run below the GPU's peak; a profile scaled from
  one batch would not see it). ``--cap-at P`` adds the caps where policy P just fits each batch."""
  import jax

  import jax_ssdtrain as ssd

  H, S, _, L = shape
  caps = sorted(args.cap_gb)
  ceiling = int(caps[-1] * 1e9)
  impl = "cudnn" if jax.default_backend() == "gpu" else None
  layer = make_layer(H // HEAD_DIM, impl)
  staging = ssd.stats()["staging_bytes"] if jax.default_backend() == "gpu" else 0
  batches = sorted(set(args.cap_batches))
  params, _ = stack_params(H, S, 1, L)
  xs = {
    b: jax.random.normal(jax.random.key(b), (b, S, H), jax.numpy.bfloat16) for b in batches
  }  # (b,S,H)
  compiled_memo, timed, segs = {}, {}, {}

  def compiled(key, pols, split, batch, offloads):
    """(step, its arguments, device bytes); memoized by key."""
    if key not in compiled_memo:
      if split not in segs:  # one copy of the weights per split
        segs[split] = ssd.split_layers(params, split)
      args_ = (segs[split], xs[batch])
      step = split_step(layer, pols).lower(*args_).compile()
      compiled_memo[key] = (step, args_, device_bytes(step) + (staging if offloads else 0))
    return compiled_memo[key]

  def step_ms(key, step, args_):
    if key not in timed:
      ssd.release_all()  # as in run_stack
      timed[key] = statistics.median(time_steps(step, args_, args.steps, args.warmup)) * 1e3
    return timed[key]

  grid = []
  for name in args.cap_policies:
    spec = POLICIES[name]
    pol = spec.policy(args.min_bytes)
    for b in batches:  # ascending: once a batch exceeds the largest cap, larger ones do too
      step, step_args, used = compiled((name, b), (pol, pol), 0, b, spec.ssd)
      row = {"policy": name, "jax": not spec.ssd, "batch": b, "device_GB": used / 1e9}
      if used > ceiling:
        grid.append(row | {"note": f"exceeds {caps[-1]:g} GB"})
        break
      try:
        ms = step_ms((name, b), step, step_args)
      except Exception as e:  # e.g. the host tier is full: reported, larger batches skipped
        grid.append(row | {"note": f"failed: {e!r}"[:300]})
        break
      grid.append(row | {"step_ms": ms, "tokens_per_s": b * S / ms * 1e3})
      print(
        f"[cap grid {H},{S},{L}] {name} batch {b}: {used / 1e9:.2f} GB, {ms:.1f} ms, "
        f"{b * S / ms * 1e3:,.0f} tokens/s",
        flush=True,
      )

  if args.cap_at:  # caps where that policy just fits each of its batches (10 MB steps)
    caps = sorted(
      set(caps)
      | {
        math.ceil(r["device_GB"] * 100) / 100
        for r in grid
        if r["policy"] == args.cap_at and "step_ms" in r
      }
    )
  one = jax.tree.map(lambda a: a[0], params)
  profiles = {}

  def profile_at(batch):
    if batch not in profiles:
      profiles[batch] = dataclasses.replace(
        ssd.profile(
          lambda p, v: layer(v, p),
          one,
          xs[batch],
          num_layers=L,
          bandwidth=bandwidth,
          batch=batch,
          repeats=args.steps,
          warmup=args.warmup,
          host_cache_bytes=ssd.current_config().host_cache_bytes,
        ),
        split_grad_copy=False,
      )  # split_step: separate segments
    return profiles[batch]

  def plan_step(batch, plan):
    return compiled(
      (batch, plan.offload_layers, plan.locations),
      plan.policies(),
      plan.offload_layers,
      batch,
      plan.offloaded_bytes > 0,
    )

  compiles = []  # what plan_for_budget measured, for each cap

  def memory(batch, plan):
    used = plan_step(batch, plan)[2]
    compiles.append(
      {
        "cap_GB": cap_gb,
        "batch": batch,
        "offload_layers": plan.offload_layers,
        "locations": {n: loc.value for n, loc in plan.locations},
        "predicted_ms": plan.step_s * 1e3,
        "residual_GB": plan.device_bytes / 1e9,
        "device_GB": used / 1e9,
      }
    )
    return used

  results = []
  for cap_gb in caps:
    cap = int(cap_gb * 1e9)
    best = {}
    for r in grid:
      if (
        "step_ms" in r
        and r["device_GB"] * 1e9 <= cap
        and r["tokens_per_s"] > best.get(r["policy"], {}).get("tokens_per_s", 0)
      ):
        best[r["policy"]] = r
    rows = [
      best.get(n, {"policy": n, "jax": not POLICIES[n].ssd, "batch": None, "note": "no batch fits"})
      for n in args.cap_policies
    ]
    for name, allowed in (
      ("auto", ("remat", "device", "host", "nvme")),
      ("auto_nvme", ("device", "remat", "nvme")),
    ):
      try:
        plan = ssd.plan_for_budget(
          cap, batches, profile_at, memory, allowed=allowed, min_bytes=args.min_bytes
        )
      except ValueError as e:
        rows.append({"policy": name, "jax": False, "batch": None, "note": str(e)})
        continue
      b = plan.profile.batch
      step, step_args, used = plan_step(b, plan)
      ms = step_ms((b, plan.offload_layers, plan.locations), step, step_args)
      rows.append(
        {
          "policy": name,
          "jax": False,
          "batch": b,
          "device_GB": used / 1e9,
          "step_ms": ms,
          "tokens_per_s": b * S / ms * 1e3,
          "predicted_ms": plan.step_s * 1e3,
          "plan": plan_doc(plan),
        }
      )
    best_jax = max((r["tokens_per_s"] for r in rows if r["jax"] and r.get("batch")), default=None)
    for r in rows:
      if r.get("batch") and best_jax:
        r["x_best_jax"] = r["tokens_per_s"] / best_jax
      if r.get("batch"):
        print(
          f"[cap {cap_gb:g} GB] {r['policy']}: batch {r['batch']}, "
          f"{r['device_GB']:.2f} GB, {r['tokens_per_s']:,.0f} tokens/s"
          + (f", {r['x_best_jax']:.3f}x best JAX" if best_jax else ""),
          flush=True,
        )
    results.append({"cap_GB": cap_gb, "rows": rows})
  return {
    "kind": "cap",
    "shape": [H, S, L],
    "staging_GB": staging / 1e9,
    "grid": grid,
    "caps": results,
    "compiles": compiles,
    "profiles": {b: dataclasses.asdict(p) for b, p in profiles.items()},
  }


# ---------------------------------------------------------------------------------------------
# Report


def table(doc: dict) -> str:
  out = [
    f"store bandwidth (GB/s): write {src['bandwidth'][0]:.2f}, read {src['bandwidth'][1]:.2f}"
    f" ({src['bandwidth_source']})"
    + (f", {src['date']}: {src.get('file')}" if "sources" in doc else "")
    for src in doc.get("sources", [doc])
  ]
  modelled = [part for part in doc["parts"] if part["kind"] != "cap" and "error" not in part]
  if modelled:
    out += [
      "",
      "| model | policy | split | predicted ms | measured ms | pred/meas | x keep | "
      "device GB | staging GB |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
  for part in modelled:
    label = part.get("preset") or ",".join(map(str, part["shape"]))
    keep = next((r["step_ms"] for r in part["rows"] if r["policy"] == "keep"), None)
    for r in part["rows"]:
      x_keep = f"{r['step_ms'] / keep:.3f}" if keep else "-"
      out.append(
        f"| {label} | {r['policy']} | {r['split']} | {r['predicted_ms']:.1f} | "
        f"{r['step_ms']:.1f} | {r['predicted_ms'] / r['step_ms']:.3f} | "
        f"{x_keep} | {r['device_GB']:.2f} | {r.get('staging_GB') or 0:.2f} |"
      )
  for part in doc["parts"]:
    if part["kind"] == "stack" and "error" not in part and "auto_nvme" in part["plans"]:
      p = part["plans"]["auto_nvme"]
      frac = p["nvme_fraction_of_allowed"]
      out.append(
        f"\n{','.join(map(str, part['shape']))} auto_nvme: {p['nvme_GB']:.3f} GB/step"
        f" to nvme of {p['allowed_nvme_GB']:.3f} GB allowed"
        + (f" ({frac:.0%})" if frac is not None else "")
      )
  for part in doc["parts"]:
    if part["kind"] == "cap" and "error" not in part:
      out += ["", cap_table(part)]
  for part in doc["parts"]:
    if "error" in part:
      out.append(f"\nERROR {part.get('what')}: {part['error']}")
  return "\n".join(out)


def cap_table(part: dict) -> str:
  shape = ",".join(map(str, part["shape"]))
  out = [
    f"policy x batch, H,S,L = {shape} (ours: XLA + {part['staging_GB']:.2f} GB staging):",
    "",
    "| policy | batch | device GB | step ms | tokens/s |",
    "|---|---|---|---|---|",
  ]
  for r in part["grid"]:
    if "step_ms" in r:
      out.append(
        f"| {r['policy']} | {r['batch']} | {r['device_GB']:.2f} | {r['step_ms']:.1f} | "
        f"{r['tokens_per_s']:,.0f} |"
      )
    else:
      out.append(f"| {r['policy']} | {r['batch']} | {r['device_GB']:.2f} | - | {r['note']} |")
  for c in part["caps"]:
    out += [
      "",
      f"cap {c['cap_GB']:g} GB, H,S,L = {shape}: each policy's best batch",
      "",
      "| policy | batch | device GB | step ms | predicted ms | tokens/s | x best JAX |",
      "|---|---|---|---|---|---|---|",
    ]
    for r in c["rows"]:
      if not r.get("batch"):
        out.append(f"| {r['policy']} | - | - | - | - | - | {r.get('note', '')} |")
        continue
      pred = f"{r['predicted_ms']:.1f}" if "predicted_ms" in r else "-"
      out.append(
        f"| {r['policy']} | {r['batch']} | {r['device_GB']:.2f} | {r['step_ms']:.1f} | "
        f"{pred} | {r['tokens_per_s']:,.0f} | {r.get('x_best_jax', 0):.3f} |"
      )
    for r in c["rows"]:
      if "plan" in r:
        out += ["", f"{r['policy']} plan at {c['cap_GB']:g} GB:", "```", r["plan"]["table"], "```"]
  return "\n".join(out)


def plot_cap(plt, part: dict, path: Path) -> None:
  """tokens/s against device memory: one line per fixed policy over the batches, the caps,
  and the planner's picks."""
  with common.figure(plt, path, figsize=(7.5, 5), dpi=110) as (_, ax):
    _draw_cap(ax, part)


def _draw_cap(ax, part: dict) -> None:
  for name in dict.fromkeys(r["policy"] for r in part["grid"]):
    pts = [
      (r["device_GB"], r["tokens_per_s"], r["batch"])
      for r in part["grid"]
      if r["policy"] == name and "step_ms" in r
    ]
    if pts:
      (line,) = ax.plot(
        [p[0] for p in pts],
        [p[1] for p in pts],
        "o-" if "ssd" not in name else "s--",
        ms=4,
        label=name,
      )
      for x, y, b in pts:
        ax.annotate(
          str(b),
          (x, y),
          fontsize=6,
          xytext=(2, 2),
          textcoords="offset points",
          color=line.get_color(),
        )
  for c in part["caps"]:
    ax.axvline(c["cap_GB"], color="grey", lw=0.7, ls=":")
    for r in c["rows"]:
      if r["policy"].startswith("auto") and r.get("batch"):
        ax.scatter(
          r["device_GB"],
          r["tokens_per_s"],
          marker="*",
          s=120,
          zorder=5,
          color="black" if r["policy"] == "auto" else "red",
          label=f"{r['policy']} @ {c['cap_GB']:g} GB ({r.get('x_best_jax', 0):.2f}x JAX)",
        )
  ax.set(
    xlabel="device memory GB (XLA + staging)",
    ylabel="tokens/s",
    title=f"H,S,L = {','.join(map(str, part['shape']))}: batch labels on the points",
  )
  ax.legend(fontsize=6, ncol=2)
  ax.grid(alpha=0.3)


def plot(plt, doc: dict, path: Path) -> str | None:
  for part in doc["parts"]:
    if part["kind"] == "cap" and "error" not in part:
      plot_cap(plt, part, path.with_name(path.stem + "_cap.png"))
  rows = [
    (part.get("preset") or ",".join(map(str, part["shape"])), r)
    for part in doc["parts"]
    if part["kind"] != "cap" and "error" not in part
    for r in part["rows"]
  ]
  if not rows:
    return "no plot of predicted against measured steps: no stack or preset rows"
  # predicted / measured per row, one bar each: readable whatever the step times' scale
  with common.figure(plt, path, figsize=(7.5, 0.9 + 0.3 * len(rows)), dpi=110) as (_, ax):
    _draw_errors(ax, doc, rows)
  return None


def _draw_errors(ax, doc: dict, rows: list) -> None:
  ys = list(range(len(rows)))[::-1]
  err = [100 * (r["predicted_ms"] / r["step_ms"] - 1) for _, r in rows]
  ax.barh(ys, err, color=["tab:red" if abs(e) > 10 else "tab:blue" for e in err])
  for y, e, (_, r) in zip(ys, err, rows):
    ax.annotate(
      f" {r['predicted_ms']:.1f} / {r['step_ms']:.1f} ms",
      (e, y),
      va="center",
      ha="left" if e >= 0 else "right",
      fontsize=7,
    )
  ax.set_yticks(ys, [f"{label} {r['policy']}" for label, r in rows], fontsize=7)
  for x in (-10, 10):
    ax.axvline(x, color="grey", ls=":", lw=0.8)
  ax.axvline(0, color="k", lw=0.7)
  lim = max(15.0, 1.4 * max(abs(e) for e in err))
  ax.set(
    xlim=(-lim, lim),
    xlabel="predicted / measured step - 1 (%); labels: predicted / measured",
    title=f"planner model, {doc['env'].get('device_kind')}",
  )
  ax.title.set_fontsize(9)
  ax.grid(alpha=0.3, axis="x")


def _bandwidth(text):
  from scripts import training

  try:
    return training.parse_bandwidth(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _numbers(kind):
  def parse(text):
    try:
      out = [kind(v) for v in text.split(",")]
    except ValueError:
      out = []
    if not out or min(out) <= 0:
      raise argparse.ArgumentTypeError(
        f"expected {kind.__name__}s > 0, comma-separated, got {text!r}"
      )
    return out

  return parse


def _cap_policies(text):
  out = [v for v in text.split(",") if v]
  unknown = [v for v in out if v not in POLICIES]
  if not out or unknown:
    raise argparse.ArgumentTypeError(
      f"unknown policies {unknown} in {text!r}; known: {sorted(POLICIES)}"
    )
  return out


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--shape",
    type=common.parse_shape,
    action="append",
    help="H,S,B,L of the bench_rok stack (default: 4096,2048,4,8 and 8192,2048,2,4)",
  )
  p.add_argument("--presets", default="gpt-1.3b", help="models' GPT presets, comma-separated")
  p.add_argument("--no-presets", action="store_true")
  p.add_argument("--no-stack", action="store_true", help="skip the bench_rok stack shapes")
  p.add_argument(
    "--stack-policies",
    type=_stack_policies,
    default=list(STACK_POLICIES),
    help="measured rows of each stack shape (keep does not fit long sequences)",
  )
  p.add_argument("--preset-batch", type=int, default=8)
  p.add_argument("--preset-seq", type=int, default=1024)
  p.add_argument(
    "--cap-gb",
    type=_numbers(float),
    default=[12.0],
    help="device memory caps (GB), comma-separated",
  )
  p.add_argument(
    "--cap-shape",
    type=common.parse_shape,
    default=(4096, 2048, 4, 8),
    help="H,S,_,L of the cap experiment (the batch comes from --cap-batches)",
  )
  p.add_argument("--cap-batches", type=_numbers(int), default=[1, 2, 4, 8])
  p.add_argument(
    "--cap-at",
    default=None,
    metavar="POLICY",
    help="also cap at the device memory of POLICY (one of --cap-policies) at each "
    "of its batches that fit --cap-gb: where it just fits that batch",
  )
  p.add_argument(
    "--cap-policies",
    type=_cap_policies,
    default=list(CAP_JAX_POLICIES + CAP_SSD_POLICIES),
    help="fixed policies of the cap grid (bench_rok names), comma-separated",
  )
  p.add_argument("--no-cap", action="store_true")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument(
    "--max-slowdown",
    type=float,
    default=0.01,
    help="planner's bound on the predicted slowdown vs all-on-device (default "
    "0.01: half of the 2%% target, a margin for run-to-run noise)",
  )
  p.add_argument(
    "--min-bytes",
    type=int,
    default=None,
    help="smaller tags stay on the device (default 1 MiB; --tiny: 0)",
  )
  p.add_argument(
    "--bandwidth",
    type=_bandwidth,
    default=None,
    help="store WRITE,READ GB/s (default: jax_ssdtrain.measured_bandwidth of --store-dir)",
  )
  p.add_argument("--store-dir", default=None, help="default: $SSDTRAIN_DIR or a temp dir")
  p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny shapes, preset tiny")
  p.add_argument(
    "--replot",
    type=Path,
    nargs="+",
    metavar="JSON",
    help="table and plots of saved JSON(s) again; several are merged into "
    "--out/planner_<device>_<date>.json",
  )
  common.add_out_option(p)
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 1:
    p.error("--steps and --warmup must be >= 1")
  if args.cap_at is not None and args.cap_at not in args.cap_policies:
    p.error(f"--cap-at {args.cap_at!r} is not one of --cap-policies {args.cap_policies}")
  args.shapes = args.shape or (TINY_SHAPES if args.tiny else common.DEFAULT_SHAPES)
  args.preset_list = [] if args.no_presets else [s for s in args.presets.split(",") if s]
  if args.min_bytes is None:
    args.min_bytes = 0 if args.tiny else 1 << 20
  if args.tiny:
    args.preset_list = [] if args.no_presets else ["tiny"]
    args.preset_batch, args.preset_seq = 2, 32
    args.cap_shape, args.cap_batches = (256, 128, 2, 2), [1, 2, 4]
  return args


def replot(paths: list[Path], out: Path) -> int:
  """Saved runs as one: their parts in order, each run's date, store bandwidth and arguments
  in ``sources``; written to OUT/planner_<device>_<date of the first>.json (.md, .png)."""
  keys = ("date", "env", "bandwidth", "bandwidth_source", "args")
  return common.replot(paths, out, "planner", write, keys=keys, field="parts")


def write(doc: dict, stem: Path) -> None:
  common.write_results(stem, doc, table(doc), plot)
  print(f"wrote {stem}.json (.md, .png)")


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.replot:
    return replot(args.replot, args.out)
  import jax

  import jax_ssdtrain as ssd

  store_dir = (
    args.store_dir
    or os.environ.get("SSDTRAIN_DIR", "").split(":")[0]
    or tempfile.mkdtemp(prefix="bench_planner-", dir="/tmp")
  )
  os.makedirs(store_dir, exist_ok=True)
  ssd.configure(directory=store_dir)
  bandwidth = args.bandwidth or ssd.measured_bandwidth(store_dir, nbytes=1 << 30)
  source = "--bandwidth" if args.bandwidth else f"measured_bandwidth({store_dir!r}, 1 GiB)"
  print(f"store bandwidth: write {bandwidth[0]:.2f} GB/s, read {bandwidth[1]:.2f} GB/s", flush=True)
  jobs = [
    (f"stack {s}", lambda s=s: run_stack(args, s, bandwidth))
    for s in ([] if args.no_stack else args.shapes)
  ]
  jobs += [(f"preset {p}", lambda p=p: run_preset(args, p, bandwidth)) for p in args.preset_list]
  if not args.no_cap:
    jobs.append(("cap", lambda: run_cap(args, args.cap_shape, bandwidth)))
  parts = []
  t0 = time.perf_counter()
  for what, job in jobs:
    try:
      parts.append(job() | {"wall_s": time.perf_counter() - t0})
    except Exception as e:  # a failed part is reported, the others still run
      import traceback

      traceback.print_exc()
      parts.append({"kind": what.split()[0], "what": what, "error": repr(e)})
  device = jax.devices()[0].device_kind
  doc = {
    "date": common.today(),
    "env": common.host_env() | {"device_kind": device, "jax": jax.__version__},
    "bandwidth": list(bandwidth),
    "bandwidth_source": source,
    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    "parts": parts,
    "wall_s": time.perf_counter() - t0,
  }
  write(doc, args.out / f"planner_{common.slug(device)}_{doc['date']}")
  return 1 if any("error" in p for p in parts) else 0


if __name__ == "__main__":
  sys.exit(main())
