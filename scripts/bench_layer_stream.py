"""A GPT larger than the GPU, its parameters and gradients streamed layer by layer.

    python -m scripts.bench_layer_stream [--preset gpt-13b] [--layers L] [--micro-batches 4]
        [--batch 4] [--seq 2048] [--location host|nvme|host,nvme|device] [--sum-location L]
        [--state-location L] [--sum-dtype float32|bfloat16] [--in-place]
        [--save-inputs device|host|nvme] [--clip 1.0] [--steps 10] [--warmup 1]
        [--ideal-layers 2,4 | --no-ideal] [--ideal-gpu N] [--ssd SSDTRAIN_HOST_TIER=300GiB]
        [--out DIR]
    python -m scripts.bench_layer_stream --cpu-smoke          (the tiny preset on the CPU)

This script owns the layer-stream benchmark: it trains the repository's GPT (``models``: its
``Block``, ``Embedding`` and ``LMHead``, an untied head) through ``jax_ssdtrain``'s layer stream
and compares it with the ideal.

* **streamed**: the stack's parameters (bfloat16) initialised layer by layer straight into the
  store (``init_streamed``; refused first by ``check_streamed_room`` where the model does not fit
  the store), ``--micro-batches`` micro-steps of ``value_and_grad_streamed`` (each layer loaded
  twice, recomputed in the backward pass, its gradient added into the running sum in the store,
  ``--sum-dtype``), then ``apply_gradients`` with AdamW for the stack (the float32 master copy
  and the moments in the store, ``init_streamed_optimizer``) and for the embedding and head
  (float32 on the device, their sums too).
* **ideal**: the same width with ``--ideal-layers`` layers (few enough that everything stays on
  the device): ``jax.value_and_grad`` of the same model, each layer under ``jax.checkpoint``
  (recomputed from its input, as the streamed backward pass does), the same accumulation in
  ``--sum-dtype`` and the same update (``apply_gradients`` of ``with_master_weights(adamw)``
  for the stack, of AdamW for the embedding and head). Its step times are extended to the full
  depth by ``bench_fit.extend_to_depth`` (a least squares line: bench_fit's ``--ideal``).

Each run is a process of its own (device memory starts empty, peaks are its own); with
``--ideal-gpu N`` the ideal's runs take GPU ``N`` while the streamed one runs (a GPU of the
same kind; they move next to nothing over the link: the machine's time halves). Reported:
the median step (``--micro-batches`` micro-steps and the update) of ``--steps`` steps after
``--warmup`` (the issue asks for 10 or more: fewer are said so in ``steps_note``), tokens/s,
MFU (6 x parameters x tokens/s over the GPU's bf16 peak, attention's FLOPs left out), the peak
device memory (``memory_stats()["peak_bytes_in_use"]``), the store's host tier and file peaks,
the process's peak resident memory, the store's arithmetic (``check_streamed_room``) and
``x_ideal`` = the ideal's step time over the streamed one.

Writes OUT/layerstream_<device>_<date>.json, .md and (with matplotlib) .png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from scripts import bench_common as bc
from scripts import bench_fit

LR, WEIGHT_DECAY = 1e-4, 0.1


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--preset", default="gpt-13b", help="a GPT preset of models/ (default gpt-13b)")
  p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
  p.add_argument("--micro-batches", type=int, default=4, help="per optimizer step (default 4)")
  p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch (default 4)")
  p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
  p.add_argument(
    "--location",
    default="host",
    choices=["host", "nvme", "host,nvme", "device"],
    help="the stack's parameters (and, by default, its sum and state); device: on the device",
  )
  for cls, what in (
    ("sum", "the gradients' running sum"),
    ("state", "AdamW's state and master copy"),
  ):
    p.add_argument(
      f"--{cls}-location",
      default=None,
      choices=["host", "nvme", "host,nvme", "device"],
      help=f"where {what} lives (default: --location)",
    )
  p.add_argument("--sum-dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument(
    "--save-inputs",
    default="device",
    choices=["device", "host", "nvme", "host,nvme"],
    help="where each layer's input waits for the backward pass (default: device)",
  )
  p.add_argument(
    "--in-place",
    action="store_true",
    help="one version of the sum, state and master copy in the store (in_place=True)",
  )
  p.add_argument(
    "--no-collect",
    action="store_true",
    help="no ssd.collect() after each micro-step and update (old versions then wait for the "
    "background sweeper: the store holds more than check_streamed_room's arithmetic)",
  )
  p.add_argument("--clip", type=float, default=0.0, help="global-norm clipping (0: none)")
  p.add_argument("--steps", type=int, default=10, help="measured optimizer steps (default 10)")
  p.add_argument("--warmup", type=int, default=1, help="steps before them (default 1)")
  p.add_argument(
    "--ideal-layers",
    type=bench_fit._layer_counts,
    default=(2, 4),
    help="layer counts of the ideal's runs (default 2,4)",
  )
  p.add_argument("--no-ideal", action="store_true", help="the streamed run alone")
  p.add_argument(
    "--ideal-gpu",
    default=None,
    help="run the ideal's runs on this GPU (CUDA_VISIBLE_DEVICES) while the streamed run runs: "
    "a GPU of the same kind beside it (default: after it, on the same GPU)",
  )
  p.add_argument("--peak-tflops", type=float, default=None, help="default: by device kind")
  p.add_argument("--timeout", type=float, default=1800, help="seconds per run (process)")
  p.add_argument("--store-dir", default=None, help="store directory (default: a private temp)")
  p.add_argument(
    "--ssd",
    action="append",
    default=[],
    metavar="VAR=VALUE",
    help="SSDTRAIN_* variable for the runs (e.g. SSDTRAIN_HOST_TIER=300GiB)",
  )
  p.add_argument(
    "--cpu-smoke",
    action="store_true",
    help="tiny preset, 4 layers (the ideal's runs: 2 and 4), 2 x 2 sequences of 32, 2 steps "
    "(a CPU run of under a minute)",
  )
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run's spec (JSON)
  bc.add_out_option(p)
  return p


# ---------------------------------------------------------------------------------------------
# One run, in a process of its own (imports JAX)


def _size(tree) -> int:
  import jax

  return sum(int(x.size) for x in jax.tree.leaves(tree))


def _run_child(spec: dict) -> dict:
  import resource

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import jax_ssdtrain as ssd
  from models.layer_stream import gpt_pieces

  pieces = gpt_pieces(spec["preset"], spec["layers"])
  cfg, init_layer, block, embed, head = (
    pieces.cfg,
    pieces.init_layer,
    pieces.block,
    pieces.embed,
    pieces.head,
  )
  L, k, streamed = spec["layers"], spec["micro_batches"], spec["way"] == "streamed"
  sum_dtype = jnp.dtype(spec["sum_dtype"])
  clip = spec["clip"] or None
  tx = optax.adamw(LR, b1=0.9, b2=0.95, weight_decay=WEIGHT_DECAY)
  key = jax.random.key(0)
  batches = [
    jax.random.randint(jax.random.key(100 + m), (spec["batch"], spec["seq"] + 1), 0, cfg.vocab_size)
    for m in range(k)
  ]
  out: dict = dict(way=spec["way"], layers=L, device_kind=jax.devices()[0].device_kind)
  layer_struct = jax.eval_shape(init_layer, key)
  side = jax.jit(pieces.init_side)(jax.random.key(1), batches[0])
  out["n_params"] = L * _size(layer_struct) + _size(side)
  t0 = time.perf_counter()
  if streamed:
    training = ssd.StreamedTrainer(
      embed,
      block,
      head,
      tx,
      init_layer=init_layer,
      num_layers=L,
      init_side=pieces.init_side,
      location=spec["location"],
      sum_location=spec.get("sum_location"),
      state_location=spec.get("state_location"),
      micro_batches=k,
      sum_dtype=spec["sum_dtype"],
      in_place=spec["in_place"],
      save_inputs=spec["save_inputs"],
      clip_global_norm=clip,
      collect=spec["collect"],
    )
    # refused here, before anything is stored, where the model does not fit
    out["store_room"] = training.check_room(spec["preset"])
    # the read-ahead and staging sized from the layer where --ssd / the environment do not
    training.configure_read_ahead()
    cfg_now = ssd.current_config()
    out["store_sizes"] = {o: getattr(cfg_now, o) for o in ("prefetch_bytes", "staging_bytes")}
    del side
    state = training.init(key, batches[0], side_key=jax.random.key(1))
    jax.block_until_ready(state)

    def step(state):
      state, metrics = training.step(state, batches)
      return metrics["loss"], state

  else:
    layers = jax.jit(jax.vmap(init_layer))(jax.random.split(key, L))
    mtx = ssd.with_master_weights(tx)  # the stack's float32 master copy, on the device
    state = (layers, side, mtx.init(layers), tx.init(side))
    jax.block_until_ready(state)
    body = jax.checkpoint(lambda x, p: (block(p, x), None), prevent_cse=False)

    def loss_fn(params, batch):
      layers, (ep, hp) = params
      x, _ = jax.lax.scan(body, embed(ep, batch), layers)
      return head(hp, x, batch)

    def micro_fn(params, batch, sums):
      loss, g = jax.value_and_grad(loss_fn)(params, batch)
      g = jax.tree.map(lambda x: x.astype(sum_dtype), g)
      return loss, g if sums is None else jax.tree.map(jnp.add, sums, g)

    micro = jax.jit(micro_fn, donate_argnums=2)

    def update(layers, side, mstate, side_state, sums):
      scale = 1.0 / k
      norm = None
      if clip:
        sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32) * scale)) for x in jax.tree.leaves(sums))
        norm = jnp.sqrt(sq)
      layers, mstate = ssd.apply_gradients(
        mtx, sums[0], mstate, layers, scale=scale, clip_global_norm=clip, global_norm=norm
      )
      side, side_state = ssd.apply_gradients(
        tx, sums[1], side_state, side, scale=scale, clip_global_norm=clip, global_norm=norm
      )
      return layers, side, mstate, side_state

    update = jax.jit(update, donate_argnums=(0, 1, 2, 3, 4))

    def step(state):
      layers, side, mstate, side_state = state
      sums = None
      for m in range(k):
        loss, sums = micro((layers, side), batches[m], sums)
      return loss, update(layers, side, mstate, side_state, sums)

  out["init_s"] = time.perf_counter() - t0
  times, losses = [], []
  ssd.reset_stats()
  for i in range(spec["warmup"] + spec["steps"]):
    if i == spec["warmup"]:
      ssd.reset_stats()
    t = time.perf_counter()
    loss, state = step(state)
    jax.block_until_ready(state)
    losses.append(float(loss))
    times.append(time.perf_counter() - t)
  measured = times[spec["warmup"] :]
  tokens = spec["batch"] * spec["seq"] * k
  out |= dict(
    step_s_all=times,
    step_s=float(np.median(measured)),
    first_step_s=times[0],
    tokens_per_step=tokens,
    tokens_per_s=tokens / float(np.median(measured)),
    losses=losses,
  )
  mem = jax.devices()[0].memory_stats() or {}
  out["peak_device_gb"] = mem["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in mem else None
  out["device_limit_gb"] = mem["bytes_limit"] / 1e9 if "bytes_limit" in mem else None
  out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
  if streamed:
    out["engine"] = bc.engine_row(ssd.stats(), spec["steps"])
  return out


def child_main(spec_json: str) -> int:
  spec = json.loads(spec_json)
  try:
    row = _run_child(spec)
  except Exception as e:  # noqa: BLE001 - reported in the row (the parent's table says why)
    row = dict(way=spec["way"], layers=spec["layers"], error=f"{type(e).__name__}: {e}")
    print(json.dumps(row), flush=True)
    return 1
  print(json.dumps(row, default=float), flush=True)
  return 0


# ---------------------------------------------------------------------------------------------
# The parent: the runs, the ideal, the report (imports no JAX)


def _spec(args, way: str, layers: int) -> dict:
  return dict(
    way=way,
    preset=args.preset,
    layers=layers,
    micro_batches=args.micro_batches,
    batch=args.batch,
    seq=args.seq,
    location=args.location,
    sum_location=args.sum_location,
    state_location=args.state_location,
    sum_dtype=args.sum_dtype,
    save_inputs=args.save_inputs,
    in_place=args.in_place,
    clip=args.clip,
    steps=args.steps,
    warmup=args.warmup,
    collect=not args.no_collect,
  )


def _child(args, spec: dict, env: dict) -> dict:
  cmd = bc.module_command("scripts.bench_layer_stream", "--child", json.dumps(spec))
  row = bc.run_json_child(cmd, args.timeout, env)
  if "error" in row:
    text = row.get("stderr_tail", "") + row["error"]
    row["oom"] = "RESOURCE_EXHAUSTED" in text and "ssdtrain" not in row["error"]
  return row


def run(args) -> dict:
  import models  # no JAX: the preset's shape

  full = models.get_config("gpt", args.preset)
  layers = args.layers or full.num_layers
  args.seq = args.seq or full.max_len
  env = dict(os.environ)
  for item in args.ssd:
    key, sep, value = item.partition("=")
    if not sep or not key.startswith("SSDTRAIN_"):
      raise SystemExit(f"--ssd {item!r}: expected SSDTRAIN_VAR=VALUE")
    env[key] = value
  if args.store_dir:
    env["SSDTRAIN_DIR"] = args.store_dir
  ideal_runs, ideal = [], None

  def run_ideal(ideal_env):
    for n in args.ideal_layers:
      r = _child(args, _spec(args, "ideal", n), ideal_env)
      print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
      ideal_runs.append(r)

  beside = None
  if not args.no_ideal and args.ideal_gpu is not None:
    beside = threading.Thread(
      target=run_ideal, args=(env | {"CUDA_VISIBLE_DEVICES": args.ideal_gpu},)
    )
    beside.start()
  ours = _child(args, _spec(args, "streamed", layers), env)
  print(json.dumps({k: v for k, v in ours.items() if k not in ("engine", "stderr_tail")}))
  if beside is not None:
    beside.join()
  elif not args.no_ideal:
    run_ideal(env)
  if not args.no_ideal:
    if all("step_s" in r for r in ideal_runs):
      times = [r["step_s"] for r in ideal_runs]
      ideal = bench_fit.extend_to_depth(args.ideal_layers, times, layers)
      ideal["tokens_per_s"] = ideal_runs[0]["tokens_per_step"] / ideal["step_s"]
  kind = bc.device_kind([ours, *ideal_runs])
  peak = bench_fit.peak_tflops(kind, args.peak_tflops)
  if "n_params" in ours:
    n = ours["n_params"]
    if peak:
      ours["mfu"] = 6 * n * ours["tokens_per_s"] / (peak * 1e12)
      if ideal:
        ideal["mfu"] = 6 * n * ideal["tokens_per_s"] / (peak * 1e12)
    if ideal:
      ours["x_ideal"] = ideal["step_s"] / ours["step_s"]
    same = [r for r in ideal_runs if r.get("layers") == layers and "losses" in r]
    if same:  # the same model on the device: its losses step by step (XLA's reassociation)
      ours["max_loss_diff_vs_ideal_run"] = max(
        abs(a - b) for a, b in zip(ours["losses"], same[0]["losses"])
      )
  note = None
  if args.steps < 10:
    note = f"median of {args.steps} steps (--steps {args.steps}), fewer than the 10 asked for"
  return bc.bench_doc(
    "layerstream",
    args,
    device_kind=kind,
    peak_tflops=peak,
    preset=args.preset,
    layers=layers,
    seq=args.seq,
    batch=args.batch,
    micro_batches=args.micro_batches,
    location=args.location,
    sum_location=args.sum_location or args.location,
    state_location=args.state_location or args.location,
    sum_dtype=args.sum_dtype,
    in_place=args.in_place,
    save_inputs=args.save_inputs,
    steps=args.steps,
    warmup=args.warmup,
    steps_note=note,
    ideal_gpu=args.ideal_gpu,
    ssd=list(args.ssd),
    streamed=ours,
    ideal=ideal,
    ideal_runs=ideal_runs,
  )


def _gb(v) -> str:
  return "-" if v is None else f"{v:.1f}"


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def table(doc: dict) -> str:
  s, ideal = doc["streamed"], doc["ideal"]
  head = (
    f"{doc['device_kind']}: {doc['preset']} ({doc['layers']} layers), "
    f"{doc['batch']} x {doc['seq']} tokens x {doc['micro_batches']} micro-batches per step, "
    + (
      f"location {doc['location']}"
      if doc.get("sum_location", doc["location"])
      == doc.get("state_location", doc["location"])
      == doc["location"]
      else f"parameters {doc['location']}, sum {doc['sum_location']}, state {doc['state_location']}"
    )
    + f", {doc['sum_dtype']} sum"
    + (", in place" if doc["in_place"] else "")
    + f"; median of {doc['steps']} steps"
    + (" (fewer than the 10 asked for)" if doc.get("steps_note") else "")
  )
  lines = [
    head,
    "",
    "| run | parameters | step s | tokens/s | MFU | x ideal | device GB | host tier GB | "
    "files GB | RSS GB |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  if "error" in s:
    lines.append(f"| streamed | refused or failed: {s['error'][:400]} | | | | | | | | |")
  else:
    e = s.get("engine", {})
    mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") else "-"
    xi = f"{s['x_ideal']:.2f}" if s.get("x_ideal") else "-"
    lines.append(
      f"| streamed | {_count(s['n_params'])} | {s['step_s']:.2f} | {s['tokens_per_s']:,.0f} | "
      f"{mfu} | {xi} | {_gb(s.get('peak_device_gb'))} | {_gb(e.get('host_tier_GB_peak'))} | "
      f"{_gb(e.get('file_GB_peak'))} | {_gb(s.get('peak_rss_gb'))} |"
    )
  if ideal:
    mfu = f"{100 * ideal['mfu']:.1f}%" if ideal.get("mfu") else "-"
    lines.append(
      f"| ideal (extended from {', '.join(str(r['layers']) for r in doc['ideal_runs'])} layers) "
      f"| | {ideal['step_s']:.2f} | {ideal['tokens_per_s']:,.0f} | {mfu} | 1.00 | | | | |"
    )
  for r in doc["ideal_runs"]:
    if "error" in r:
      lines.append(f"| ideal, {r['layers']} layers | failed: {r['error'][:300]} | | | | | | | | |")
      continue
    lines.append(
      f"| ideal, {r['layers']} layers | {_count(r['n_params'])} | {r['step_s']:.2f} | "
      f"{r['tokens_per_s']:,.0f} | | | {_gb(r.get('peak_device_gb'))} | | | "
      f"{_gb(r.get('peak_rss_gb'))} |"
    )
  room = s.get("store_room")
  if room:
    b = room["bytes_per_parameter"]
    lines += [
      "",
      f"Store, per parameter of the stack: parameters {b['params']:g} B, master {b['master']:g} B, "
      f"optimizer state {b['optimizer_state']:g} B, gradient sum {b['grad_sum']:g} B; peak "
      f"{room['peak_bytes'] / 1e9:.1f} GB of {(room['room_bytes'] or 0) / 1e9:.1f} GB.",
    ]
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> str | None:
  runs = [r for r in doc["ideal_runs"] if "step_s" in r]
  s = doc["streamed"]
  if not runs and "step_s" not in s:
    return "no plot: no run finished"
  with bc.figure(plt, path, figsize=(6, 3)) as (_, ax):
    if runs:
      ax.plot([r["layers"] for r in runs], [r["step_s"] for r in runs], "o", label="ideal runs")
    ideal = doc["ideal"]
    if ideal:
      xs = [0, doc["layers"]]
      ax.plot(
        xs, [ideal["fixed_s"] + x * ideal["per_layer_s"] for x in xs], "--", label="ideal, extended"
      )
    if "step_s" in s:
      ax.plot([doc["layers"]], [s["step_s"]], "s", label=f"streamed ({doc['location']})")
    ax.set_xlabel("layers")
    ax.set_ylabel("step s")
    ax.set_title(f"{doc['preset']}, {doc['device_kind']}")
    ax.legend()


def main(argv=None) -> dict | int:
  args = build_parser().parse_args(argv)
  if args.child is not None:
    return child_main(args.child)
  if args.cpu_smoke:
    args.preset, args.layers, args.batch, args.seq = "tiny", 4, 2, 32
    # the ideal's 4-layer run is the streamed model on the device: their losses agree
    args.micro_batches, args.steps, args.warmup, args.ideal_layers = 2, 2, 1, (2, 4)
    args.ssd = ["SSDTRAIN_HOST_TIER=64MiB", "SSDTRAIN_CAPACITY=256MiB", *args.ssd]
  doc = run(args)
  bc.write_bench(args.out, f"layerstream_{bc.slug(doc['device_kind'])}", doc, table(doc), plot)
  return doc


if __name__ == "__main__":
  result = main()
  sys.exit(result if isinstance(result, int) else 0)
