"""Train GPT / BERT / T5 with activations placed per tag (remat | device | host | nvme).

From the repository root:

    python -m scripts.train --model gpt --preset tiny --steps 30 --locations layer_in=nvme,qkv=nvme
    python -m scripts.train --model gpt --preset tiny --locations layer_in=host --workdir runs/a
    python -m scripts.train --model gpt --preset gpt-1.3b --policy auto --memory-budget 20GB

Tags and locations are documented in models/common.py.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import resource
import sys
import time

import jax

import models
from models import data as data_lib
from models import training


def _positive(kind):
  def parse(s):
    try:
      v = kind(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {s!r}") from None
    if v <= 0:
      raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v

  return parse


def _non_negative_int(s):
  try:
    v = int(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an int, got {s!r}") from None
  if v < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
  return v


def _locations(s):
  try:
    locations = models.parse_locations(s)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  if not locations:  # "" would train with nothing placed, silently
    raise argparse.ArgumentTypeError(
      f"expected TAG=LOCATION[,TAG=LOCATION...] (e.g. layer_in=nvme), got {s!r}; to train "
      "without placing any tag, leave --locations out (or use --remat-policy)"
    )
  return locations


def _mesh(s):
  from models import parallel

  try:
    return parallel.parse_mesh(s)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _size(what, minimum=1):
  def parse(s):
    import jax_ssdtrain as ssd

    try:
      v = ssd.parse_size(s, what=what)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
    if v < minimum:
      raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {s}")
    return v

  return parse


def _bandwidth(s):
  try:
    return training.parse_bandwidth(s)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
  p.add_argument("--model", choices=sorted(models.MODELS), default="gpt", help="model family")
  p.add_argument("--preset", choices=models.PRESETS, default="tiny", help="model size")
  p.add_argument(
    "--dtype",
    choices=("bfloat16", "float32"),
    default=None,
    help="compute dtype (default: the model config's, bfloat16)",
  )
  p.add_argument(
    "--attention",
    choices=("auto", "xla", "cudnn"),
    default="auto",
    help="attention implementation (auto: cudnn on GPU in bf16/fp16, else xla)",
  )
  p.add_argument(
    "--layers", type=_positive(int), default=None, help="layer count (default: the preset's)"
  )
  p.add_argument("--batch", type=_positive(int), default=8, help="sequences per step")
  p.add_argument("--seq-len", type=_positive(int), default=None, help="default: the preset's")
  p.add_argument("--steps", type=_positive(int), default=30, help="training steps")
  p.add_argument("--lr", type=_positive(float), default=3e-3, help="peak learning rate (AdamW)")
  p.add_argument("--warmup", type=_non_negative_int, default=None, help="default: steps/10")
  p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
  p.add_argument("--clip-norm", type=_positive(float), default=1.0, help="gradient norm clip")
  p.add_argument("--seed", type=int, default=0, help="parameter and data seed")
  p.add_argument(
    "--remat-policy",
    choices=sorted(models.REMAT_SHORTCUTS),
    default=None,
    help="keep: no remat; remat: recompute from layer input; offload: all tags to nvme",
  )
  p.add_argument(
    "--locations",
    type=_locations,
    default=None,
    help=f"TAG=LOC,... with TAG in {{{','.join(models.TAGS)}}}, "
    f"LOC in {{{','.join(models.LOCATIONS)}}}; overrides --remat-policy",
  )
  p.add_argument(
    "--policy",
    choices=("auto",),
    default=None,
    help="auto: profile one layer, plan locations and the offloaded layer count "
    "(jax_ssdtrain.plan); overrides --remat-policy/--locations",
  )
  p.add_argument(
    "--memory-budget",
    type=_size("--memory-budget"),
    default=None,
    help="with --policy auto: device memory cap (e.g. 20GB); picks the batch "
    "(powers of two up to --batch) and plan with the most tokens/s; with --optimizer-location "
    "auto: the cap the step must fit with the state on the device (default: the device's memory)",
  )
  p.add_argument(
    "--bandwidth",
    type=_bandwidth,
    default=None,
    help="store WRITE,READ GB/s for --policy auto (default: measured)",
  )
  p.add_argument(
    "--max-slowdown",
    type=float,
    default=0.02,
    help="--policy auto: allowed predicted step time over all-on-device",
  )
  p.add_argument(
    "--min-bytes",
    type=_size("--min-bytes", minimum=0),
    default=None,
    help="tensors smaller than this stay on device, e.g. 1MiB (default: 0 for tiny, 1 MiB else)",
  )
  p.add_argument(
    "--store-dir",
    default=None,
    help="directory of the activation store file (default: $SSDTRAIN_DIR or a private temp dir)",
  )
  p.add_argument(
    "--data", default="synthetic", help="'synthetic' or a glob of pre-tokenized .npy shards"
  )
  p.add_argument("--loader", choices=("memmap", "dali"), default="memmap")
  p.add_argument("--workdir", default=None, help="metrics.csv, TensorBoard events and checkpoints")
  p.add_argument(
    "--checkpoint-every",
    type=_non_negative_int,
    default=0,
    help="0: only at the end (with --workdir)",
  )
  p.add_argument(
    "--optimizer-location",
    choices=["host", "nvme", "host,nvme", "auto"],
    default=None,
    help="keep the optimizer state in the store (jax_ssdtrain.offload_optimizer) instead of on "
    "the device; auto: on the device when the step fits there with it (--memory-budget, else the "
    "device's memory), else the store's tier for its size",
  )
  p.add_argument(
    "--master-weights",
    action="store_true",
    help="bfloat16 parameters on the device, their float32 copy in the optimizer state "
    "(jax_ssdtrain.with_master_weights; in the store with --optimizer-location)",
  )
  p.add_argument(
    "--optimizer-in-place",
    action="store_true",
    help="the update writes each chunk of the state into the room of the one it read: one "
    "version in the store instead of two (offload_optimizer(in_place=True))",
  )
  p.add_argument(
    "--accum",
    type=_positive(int),
    default=1,
    help="micro-batches per optimizer step (jax_ssdtrain.accumulate_gradients; each training "
    "step is one micro-batch)",
  )
  p.add_argument(
    "--accum-dtype",
    choices=["float32", "bfloat16"],
    default="float32",
    help="dtype of the running mean of the gradients (--accum), on the device",
  )
  p.add_argument(
    "--restore", action="store_true", help="resume from the latest checkpoint in --workdir"
  )
  p.add_argument(
    "--mesh",
    type=_mesh,
    default=None,
    help="dp=N[,tp=M][,fsdp]: data parallel over N devices, tensor parallel MLP "
    "over M, parameters/optimizer state sharded over the data axis (fsdp)",
  )
  p.add_argument(
    "--devices",
    default=None,
    metavar="IDS",
    help="the devices of --mesh, by id (e.g. 0,1; default: the first dp*tp devices)",
  )
  p.add_argument(
    "--distributed",
    action="store_true",
    help="jax.distributed.initialize() first (SLURM/MPI/... auto-detection, or "
    "the three options below)",
  )
  p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (--distributed)")
  p.add_argument("--num-processes", type=_positive(int), default=None, help="(--distributed)")
  p.add_argument("--process-id", type=_non_negative_int, default=None, help="(--distributed)")
  p.add_argument("--log-every", type=_positive(int), default=1, help="steps between metric fetches")
  p.add_argument(
    "--summary-json",
    default=None,
    metavar="PATH",
    help="also write the run's summary (the numbers of the last line) as JSON to PATH",
  )
  return p


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """The module doc as written, and each option's default where its help does not say it."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "default" not in text and action.default not in (None, False, argparse.SUPPRESS):
      text += f" (default: {action.default})"
    return text


def _error_text(e: Exception) -> str:
  return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _tb_writer(workdir):
  for mod in ("tensorboardX", "torch.utils.tensorboard"):
    try:
      return __import__(mod, fromlist=["SummaryWriter"]).SummaryWriter(workdir)
    except Exception:
      continue
  print(
    f"TensorBoard events: not written (no tensorboardX or torch.utils.tensorboard; "
    f"pip install tensorboardX); metrics go to {os.path.join(workdir, 'metrics.csv')}",
    file=sys.stderr,
    flush=True,
  )
  return None


def auto_plan(run: training.RunConfig, args) -> training.RunConfig:
  """--policy auto: profile one block, plan (and pick the batch under --memory-budget, with a
  profile of the layers at each candidate batch)."""
  import jax_ssdtrain as ssd

  bandwidth = args.bandwidth
  store = ssd.current_config() or ssd.default_config()
  directory = None if bandwidth else ssd.store_directories()[0]
  print("profiling the layer (compiles a few small programs) ...", file=sys.stderr, flush=True)
  prof = training.profile_run(
    run, directory=directory, bandwidth=bandwidth, host_cache_bytes=store.host_cache_bytes
  )
  if args.memory_budget is None:
    plan = ssd.plan(prof, max_slowdown=args.max_slowdown, min_bytes=run.min_bytes)
  else:
    batches = sorted({min(1 << i, run.batch) for i in range(run.batch.bit_length() + 1)})
    on_gpu = jax.default_backend() == "gpu"

    def memory(batch, plan):  # XLA's, plus the staging arena the plan needs (GPU only)
      cand = training.apply_plan(dataclasses.replace(run, batch=batch), plan)
      return training.step_memory_bytes(cand) + (plan.staging_bytes if on_gpu else 0)

    profiles = {run.batch: prof}

    def profile_at(batch):  # small batches run below the GPU's peak: profile each batch
      if batch not in profiles:
        layer = training.profile_run(
          dataclasses.replace(run, batch=batch),
          directory=directory,
          bandwidth=bandwidth,
          outside_layers=False,
          host_cache_bytes=store.host_cache_bytes,
        )
        profiles[batch] = dataclasses.replace(
          layer, other_s=prof.other_s * batch / run.batch, update_s=prof.update_s
        )
      return profiles[batch]

    plan = ssd.plan_for_budget(
      args.memory_budget, batches, profile_at, memory, min_bytes=run.min_bytes
    )
  print(plan.table(), flush=True)
  if plan.store_options() and jax.default_backend() == "gpu":
    # the arena the plan was predicted with, not the configured upper bound
    ssd.configure(**plan.store_options())
  return training.apply_plan(run, plan)


def choose_optimizer_location(run: training.RunConfig, args) -> training.RunConfig:
  """--optimizer-location auto: the state stays on the device when the step fits there with it
  (XLA's memory analysis of the compiled step, with --policy auto the planner's plan for the
  activations at the run's batch, against --memory-budget or else the device's memory), where
  the update reads no link; else it goes to the store, whose tier offload_optimizer(
  location="auto") chooses from the state's size. Without a budget (a CPU reports no memory
  limit) it goes to the store."""
  budget = args.memory_budget
  if budget is None:
    budget = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  planned = args.policy == "auto"
  if budget is None:
    print("optimizer state: in the store (no device memory limit to weigh it against)", flush=True)
    return auto_plan(run, args) if planned else run
  on_device = dataclasses.replace(run, optimizer_location=None, optimizer_in_place=False)
  try:
    if planned:
      on_device = auto_plan(on_device, args)
    need = training.step_memory_bytes(on_device)
    why = f"the step takes {need / 1e9:.2f} GB with it on the device"
  except ValueError:  # no plan fits the budget with the state on the device
    need, why = None, "no plan fits with it on the device"
  if need is not None and on_device.batch < run.batch:  # the planner gave up batch for it
    need, why = None, f"with it on the device the plan fits batch {on_device.batch} only"
  if need is not None and need <= budget:
    print(
      f"optimizer state: on the device (the step takes {need / 1e9:.2f} GB of "
      f"{budget / 1e9:.2f} GB)",
      flush=True,
    )
    return on_device
  print(f"optimizer state: in the store ({why}, budget {budget / 1e9:.2f} GB)", flush=True)
  return auto_plan(run, args) if planned else run


def main(argv=None) -> dict:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.restore and not args.workdir:
    parser.error("--restore needs --workdir")
  if args.checkpoint_every and not args.workdir:
    parser.error("--checkpoint-every needs --workdir")
  if args.accum_dtype != "float32" and args.accum == 1:
    parser.error("--accum-dtype needs --accum K > 1")
  if (
    args.data != "synthetic"
    and not any(c in args.data for c in "*?[")
    and not os.path.exists(args.data)
  ):
    parser.error(f"--data: no such file {args.data!r}")
  run = training.RunConfig(
    model=args.model,
    preset=args.preset,
    batch=args.batch,
    seq_len=args.seq_len,
    steps=args.steps,
    lr=args.lr,
    warmup=args.warmup,
    weight_decay=args.weight_decay,
    clip_norm=args.clip_norm,
    seed=args.seed,
    remat_policy=args.remat_policy,
    locations=args.locations,
    optimizer_location=args.optimizer_location,
    master_weights=args.master_weights,
    optimizer_in_place=args.optimizer_in_place,
    accum=args.accum,
    accum_dtype=args.accum_dtype,
    dtype=args.dtype,
    model_overrides={"attention": args.attention}
    | ({"num_layers": args.layers} if args.layers else {}),
    min_bytes=args.min_bytes
    if args.min_bytes is not None
    else (0 if args.preset == "tiny" else 1 << 20),
  )
  try:  # the optimizer's settings (in place needs a location, ...): make_optimizer checks them
    training.make_optimizer(run)
  except ValueError as e:
    parser.error(str(e))
  cfg = run.model_config()
  if cfg.positions == "learned" and (args.seq_len or 0) > cfg.max_len:
    parser.error(f"--seq-len {args.seq_len} exceeds the preset's max_len {cfg.max_len}")
  if args.memory_budget and args.policy != "auto" and args.optimizer_location != "auto":
    parser.error("--memory-budget needs --policy auto or --optimizer-location auto")
  if args.max_slowdown < 0:
    parser.error(f"--max-slowdown must be >= 0, got {args.max_slowdown}")
  missing = sorted(t for t in (args.locations or {}) if t not in models.MODEL_TAGS[args.model])
  if missing:
    parser.error(
      f"--locations: model {args.model!r} has no tag {', '.join(map(repr, missing))} "
      f"(its tags: {', '.join(models.MODEL_TAGS[args.model])})"
    )
  try:  # the store's settings (SSDTRAIN_* variables) are checked before any model work
    import jax_ssdtrain as ssd  # checks the variables' values

    ssd.default_config()
  except (ValueError, OSError) as e:
    parser.exit(2, f"{parser.prog}: error: {_error_text(e)}\n")

  if args.distributed or args.coordinator:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  mesh_devices = None
  if args.devices is not None and not args.mesh:
    parser.error("--devices needs --mesh (the devices of the mesh)")
  if args.mesh:
    from models import parallel

    try:
      if args.devices is None:
        mesh_devices = parallel.default_devices(args.mesh.size)
      else:
        mesh_devices = parallel.select_devices(args.devices)
    except ValueError as e:
      parser.error(f"--{'mesh' if args.devices is None else 'devices'}: {e}")
    if len(mesh_devices) != args.mesh.size:
      parser.error(f"--devices {args.devices}: --mesh needs {args.mesh.size} devices")
  if args.mesh and run.batch % args.mesh.data:
    parser.error(f"--batch {run.batch} is not divisible by dp={args.mesh.data}")
  try:
    if args.store_dir:  # may hold {process} / {device} (see jax_ssdtrain.configure)
      ssd.configure(directory=args.store_dir)
    elif ssd.current_config() is None:
      ssd.configure()
  except (ValueError, OSError) as e:
    parser.exit(2, f"{parser.prog}: error: {_error_text(e)}\n")
  print(
    f"activation store: {', '.join(ssd.store_directories())}"
    + ("" if ssd.current_config().directories else " (private, removed at exit)"),
    flush=True,
  )
  try:
    if run.optimizer_location == "auto":
      run = choose_optimizer_location(run, args)
    elif args.policy == "auto":
      run = auto_plan(run, args)
  except ValueError as e:
    parser.error(str(e))
  locations = run.resolved_locations()
  offloading = bool(locations) and any(v in ("host", "nvme") for v in locations.values())
  try:
    batches = data_lib.make_batches(
      args.data, args.loader, run.batch, run.example_length(cfg), cfg.vocab_size, run.seed
    )
  except data_lib.DataError as e:
    parser.error(str(e))

  state, _, schedule = training.create_train_state(run)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  manager = (
    training.checkpoint_manager(os.path.join(args.workdir, "checkpoints")) if args.workdir else None
  )
  if args.restore:
    state = training.restore_checkpoint(manager, state)
    # deterministic sources resume at the restored step
    if hasattr(batches, "close"):
      batches.close()
    batches = data_lib.make_batches(
      args.data,
      args.loader,
      run.batch,
      run.example_length(cfg),
      cfg.vocab_size,
      run.seed,
      start_step=int(state.step),
    )
  print(
    f"{args.model}/{args.preset}: {n_params / 1e6:.2f}M params, dtype {cfg.dtype}, "
    f"batch {run.batch}x{run.example_length(cfg)}, locations {locations or 'keep'}"
    + (f", first {run.offload_layers} layers offload" if run.offload_layers is not None else ""),
    flush=True,
  )

  mesh = None
  if args.mesh:
    mesh = args.mesh.mesh(mesh_devices)
    state, shardings = training.shard_train_state(state, args.mesh, mesh)
    step_fn = training.jit_train_step(shardings)
  else:
    step_fn = training.jit_train_step()
  rng = jax.random.key(run.seed + 1)
  writer = csv_file = tb = None
  if args.workdir:
    os.makedirs(args.workdir, exist_ok=True)
    csv_path = os.path.join(args.workdir, "metrics.csv")
    csv_file = open(csv_path, "a" if args.restore else "w", newline="")
    writer = csv.writer(csv_file)
    if not args.restore or os.path.getsize(csv_path) == 0:
      writer.writerow(["step", "loss", "grad_norm", "lr", "tokens_per_s", "gb_written", "gb_read"])
    tb = _tb_writer(args.workdir)

  if args.workdir:
    print(
      f"metrics: {os.path.join(args.workdir, 'metrics.csv')}; checkpoints: "
      f"{os.path.join(args.workdir, 'checkpoints')}",
      flush=True,
    )
  from tqdm import tqdm

  ssd.reset_stats()
  print(
    "compiling the training step (the first step takes longer) ...", file=sys.stderr, flush=True
  )
  start = int(state.step)
  # Advanced by hand after each step: a bar iterating the range would count in a local variable
  # and show a stale count whenever the postfix (loss, tokens/s) refreshes it.
  bar = tqdm(initial=start, total=run.steps, dynamic_ncols=True)
  tokens_per_step = run.batch * (run.seq_len or cfg.max_len)  # model input positions
  tokens_done, t0, loss = 0, None, float("nan")
  # the second half of the run (its steady state: allocations and first-use costs behind it)
  mid_step, t_mid, tokens_mid = start + max(1, (run.steps - start) // 2), None, 0
  for step in range(start, run.steps):
    try:
      tokens = next(batches)
    except data_lib.DataError as e:
      parser.error(str(e))
    if mesh is not None:
      tokens = training.shard_batch(tokens, args.mesh, mesh)
    state, metrics = step_fn(state, tokens, rng)
    if t0 is None:  # exclude compilation from throughput
      jax.block_until_ready(metrics)
      t0 = time.perf_counter()
    else:
      tokens_done += tokens_per_step
    if step + 1 == mid_step and step + 1 < run.steps:
      jax.block_until_ready(metrics)
      t_mid, tokens_mid = time.perf_counter(), tokens_done
    bar.update(1)
    if (step + 1) % args.log_every == 0 or step + 1 == run.steps:
      loss = float(metrics["loss"])
      dt = time.perf_counter() - t0
      tps = tokens_done / dt if dt > 0 and tokens_done else 0.0
      st = ssd.stats()
      gw, gr = st.get("bytes_written", 0) / 1e9, st.get("bytes_read", 0) / 1e9
      bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", GB_off=f"{gw:.3f}")
      row = [step + 1, loss, float(metrics["grad_norm"]), float(schedule(step)), tps, gw, gr]
      if writer:
        writer.writerow(row)
      if tb:
        for k, v in zip(
          ["loss", "grad_norm", "lr", "tokens_per_s", "gb_written", "gb_read"], row[1:]
        ):
          tb.add_scalar(k, v, step + 1)
      if run.optimizer_location:  # the state's version before this step's (docs/optimizer.md)
        ssd.collect()
    if manager and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
      training.save_checkpoint(manager, state)
  bar.close()
  jax.block_until_ready(state)
  dt = time.perf_counter() - t0 if t0 is not None else 0.0
  late = time.perf_counter() - t_mid if t_mid is not None else 0.0
  if manager and (not manager.latest_step() or manager.latest_step() < int(state.step)):
    training.save_checkpoint(manager, state)
  for f in (csv_file, tb):
    if f:
      f.close()
  if hasattr(batches, "close"):
    batches.close()
  st = ssd.stats()
  # the first device that trained (a mesh's may not be the first of the machine); None on CPU
  mem = (mesh.local_devices if mesh is not None else jax.local_devices())[0].memory_stats() or {}
  summary = dict(
    final_loss=loss,
    tokens_per_s=tokens_done / dt if dt > 0 else 0.0,
    tokens_per_s_second_half=(tokens_done - tokens_mid) / late if late > 0 else 0.0,
    gb_written=st.get("bytes_written", 0) / 1e9,
    gb_read=st.get("bytes_read", 0) / 1e9,
    peak_device_gb=mem.get("peak_bytes_in_use", 0) / 1e9,
    # the process's peak resident memory: the store's host tier and cache once touched
    peak_host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    n_params=n_params,
    tokens_per_step=tokens_per_step,
    steps=int(state.step),
    offload=offloading,
    optimizer_location=training.optimizer_location(state.opt_state),
  )
  print(
    f"done: steps {summary['steps']}  final loss {loss:.4f}  tokens/s {summary['tokens_per_s']:,.0f} "
    f"(second half {summary['tokens_per_s_second_half']:,.0f})  "
    f"store written {summary['gb_written']:.4f} GB  read {summary['gb_read']:.4f} GB"
    + (f"  peak device memory {summary['peak_device_gb']:.2f} GB" if mem else ""),
    flush=True,
  )
  if args.summary_json:
    record = {
      "argv": sys.argv[1:] if argv is None else list(argv),
      "device_kind": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "store_env": {k: v for k, v in os.environ.items() if k.startswith("SSDTRAIN_")},
    }
    with open(args.summary_json, "w") as f:
      json.dump(summary | record, f, indent=1)
  return summary


if __name__ == "__main__":
  main()
