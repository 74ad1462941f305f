"""Train GPT / BERT / T5 with activations placed per tag (remat | device | host | nvme).

From the repository root:

    python -m scripts.train --model gpt --preset tiny --steps 30 --locations layer_in=nvme,qkv=nvme
    python -m scripts.train --model gpt --preset tiny --locations layer_in=host --workdir runs/a
    python -m scripts.train --model gpt --preset gpt-1.3b --policy auto --memory-budget 20GB
    python -m scripts.train --model gpt --preset gpt-13b --stream-layers host --accum 8 --batch 4

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
from typing import Any

import jax

import models
from scripts import data as data_lib
from scripts import training


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


def _flag(default=None, help: str | None = None, **add_argument):
  """A field of :class:`Config` and its command-line option (``--seq-len`` for ``seq_len``):
  ``add_argument``'s keywords, the default and the help live with the field."""
  return dataclasses.field(default=default, metadata=dict(help=help, **add_argument))


@dataclasses.dataclass(frozen=True)
class Config:
  """One run of the script, a field per command-line option: :func:`build_parser` makes the
  parser from the fields, :func:`parse_config` the Config from what it parses."""

  model: str = _flag("gpt", "model family", choices=sorted(models.MODELS))
  preset: str = _flag("tiny", "model size", choices=models.PRESETS)
  dtype: str | None = _flag(
    None,
    "compute dtype (default: the model config's, bfloat16)",
    choices=("bfloat16", "float32"),
  )
  attention: str = _flag(
    "auto",
    "attention implementation (auto: cudnn on GPU in bf16/fp16, else xla)",
    choices=("auto", "xla", "cudnn"),
  )
  layers: int | None = _flag(None, "layer count (default: the preset's)", type=_positive(int))
  batch: int = _flag(8, "sequences per step", type=_positive(int))
  seq_len: int | None = _flag(None, "default: the preset's", type=_positive(int))
  steps: int = _flag(30, "training steps", type=_positive(int))
  lr: float = _flag(3e-3, "peak learning rate (AdamW)", type=_positive(float))
  warmup: int | None = _flag(None, "default: steps/10", type=_non_negative_int)
  weight_decay: float = _flag(0.1, "AdamW weight decay", type=float)
  clip_norm: float = _flag(1.0, "gradient norm clip", type=_positive(float))
  seed: int = _flag(0, "parameter and data seed", type=int)
  remat_policy: str | None = _flag(
    None,
    "keep: no remat; remat: recompute from layer input; offload: all tags to nvme",
    choices=sorted(models.REMAT_SHORTCUTS),
  )
  locations: dict | None = _flag(
    None,
    f"TAG=LOC,... with TAG in {{{','.join(models.TAGS)}}}, "
    f"LOC in {{{','.join(models.LOCATIONS)}}}; overrides --remat-policy",
    type=_locations,
  )
  policy: str | None = _flag(
    None,
    "auto: profile one layer, plan locations and the offloaded layer count "
    "(jax_ssdtrain.plan); overrides --remat-policy/--locations",
    choices=("auto",),
  )
  memory_budget: int | None = _flag(
    None,
    "with --policy auto: device memory cap (e.g. 20GB); picks the batch "
    "(powers of two up to --batch) and plan with the most tokens/s; with --optimizer-location "
    "auto: the cap the step must fit with the state on the device (default: the device's "
    "memory); with --stream-layers auto: the cap the step must fit with the stack on the device",
    type=_size("--memory-budget"),
  )
  bandwidth: tuple | None = _flag(
    None, "store WRITE,READ GB/s for --policy auto (default: measured)", type=_bandwidth
  )
  max_slowdown: float = _flag(
    0.02, "--policy auto: allowed predicted step time over all-on-device", type=float
  )
  min_bytes: int | None = _flag(
    None,
    "tensors smaller than this stay on device, e.g. 1MiB (default: 0 for tiny, 1 MiB else)",
    type=_size("--min-bytes", minimum=0),
  )
  store_dir: str | None = _flag(
    None, "directory of the activation store file (default: $SSDTRAIN_DIR or a private temp dir)"
  )
  data: str = _flag("synthetic", "'synthetic' or a glob of pre-tokenized .npy shards")
  loader: str = _flag("memmap", choices=("memmap", "dali"))
  workdir: str | None = _flag(None, "metrics.csv, TensorBoard events and checkpoints")
  checkpoint_every: int = _flag(0, "0: only at the end (with --workdir)", type=_non_negative_int)
  optimizer_location: str | None = _flag(
    None,
    "keep the optimizer state in the store (jax_ssdtrain.offload_optimizer) instead of on "
    "the device; auto: on the device when the step fits there with it (--memory-budget, else the "
    "device's memory), else the store's tier for its size",
    choices=["host", "nvme", "host,nvme", "auto"],
  )
  master_weights: bool = _flag(
    False,
    "bfloat16 parameters on the device, their float32 copy in the optimizer state "
    "(jax_ssdtrain.with_master_weights; in the store with --optimizer-location)",
    action="store_true",
  )
  optimizer_in_place: bool = _flag(
    False,
    "the update writes each chunk of the state into the room of the one it read: one "
    "version in the store instead of two (offload_optimizer(in_place=True))",
    action="store_true",
  )
  accum: int = _flag(
    1,
    "micro-batches per optimizer step (jax_ssdtrain.accumulate_gradients; each training "
    "step is one micro-batch)",
    type=_positive(int),
  )
  accum_dtype: str = _flag(
    "float32",
    "dtype of the running mean of the gradients (--accum), on the device",
    choices=["float32", "bfloat16"],
  )
  stream_layers: str | None = _flag(
    None,
    "GPT only: the layer stack's bfloat16 parameters, their gradients' running sum (in "
    "--accum-dtype), the float32 master copy and AdamW's state live here, streamed layer by "
    "layer (jax_ssdtrain's layer stream; docs/layer_stream.md); the embedding and head stay on "
    "the device; device: the same programs with everything on the device (the reference); "
    "auto: each class (the parameters, the sum, the state with the master copy, the saved "
    "layer inputs) on the device as far as the step fits there (--memory-budget, default the "
    "device's memory), the rest in the fastest tiers of the store that hold it "
    "(ssd.choose_placement; the choice is printed)",
    choices=["host", "nvme", "host,nvme", "device", "auto"],
  )
  stream_sum: str | None = _flag(
    None,
    "--stream-layers: where the gradients' running sum lives instead (default: with the "
    "parameters)",
    choices=["host", "nvme", "host,nvme", "device"],
  )
  stream_state: str | None = _flag(
    None,
    "--stream-layers: where the float32 master copy and AdamW's state live instead (default: "
    "with the parameters)",
    choices=["host", "nvme", "host,nvme", "device"],
  )
  restore: bool = _flag(
    False, "resume from the latest checkpoint in --workdir", action="store_true"
  )
  mesh: Any = _flag(
    None,
    "dp=N[,tp=M][,fsdp]: data parallel over N devices, tensor parallel MLP "
    "over M, parameters/optimizer state sharded over the data axis (fsdp)",
    type=_mesh,
  )
  devices: str | None = _flag(
    None,
    "the devices of --mesh, by id (e.g. 0,1; default: the first dp*tp devices)",
    metavar="IDS",
  )
  distributed: bool = _flag(
    False,
    "jax.distributed.initialize() first (SLURM/MPI/... auto-detection, or the three options below)",
    action="store_true",
  )
  coordinator: str | None = _flag(None, "HOST:PORT of process 0 (--distributed)")
  num_processes: int | None = _flag(None, "(--distributed)", type=_positive(int))
  process_id: int | None = _flag(None, "(--distributed)", type=_non_negative_int)
  log_every: int = _flag(1, "steps between metric fetches", type=_positive(int))
  summary_json: str | None = _flag(
    None,
    "also write the run's summary (the numbers of the last line) as JSON to PATH",
    metavar="PATH",
  )

  def run_config(self) -> training.RunConfig:
    """The run's :class:`scripts.training.RunConfig`: the fields of the same name, the model's
    overrides (--attention, --layers) and --min-bytes' default for the preset."""
    ours = {f.name for f in dataclasses.fields(self)}
    same = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(training.RunConfig)
      if f.name in ours
    }
    return training.RunConfig(
      **same
      | dict(
        model_overrides={"attention": self.attention}
        | ({"num_layers": self.layers} if self.layers else {}),
        min_bytes=self.min_bytes
        if self.min_bytes is not None
        else (0 if self.preset == "tiny" else 1 << 20),
      )
    )


def build_parser() -> argparse.ArgumentParser:
  """The command line: an option per field of :class:`Config`."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
  for f in dataclasses.fields(Config):
    p.add_argument("--" + f.name.replace("_", "-"), default=f.default, **f.metadata)
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


def auto_plan(run: training.RunConfig, cfg: Config) -> training.RunConfig:
  """--policy auto: profile one block, plan (and pick the batch under --memory-budget, with a
  profile of the layers at each candidate batch)."""
  import jax_ssdtrain as ssd

  bandwidth = cfg.bandwidth
  store = ssd.current_config() or ssd.default_config()
  directory = None if bandwidth else ssd.store_directories()[0]
  print("profiling the layer (compiles a few small programs) ...", file=sys.stderr, flush=True)
  prof = training.profile_run(
    run, directory=directory, bandwidth=bandwidth, host_cache_bytes=store.host_cache_bytes
  )
  if cfg.memory_budget is None:
    plan = ssd.plan(prof, max_slowdown=cfg.max_slowdown, min_bytes=run.min_bytes)
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
      cfg.memory_budget, batches, profile_at, memory, min_bytes=run.min_bytes
    )
  print(plan.table(), flush=True)
  if plan.store_options() and jax.default_backend() == "gpu":
    # the arena the plan was predicted with, not the configured upper bound
    ssd.configure(**plan.store_options())
  return training.apply_plan(run, plan)


def place_optimizer(run: training.RunConfig, cfg: Config) -> training.RunConfig:
  """--optimizer-location auto: the state on the device or in the store, as
  ``jax_ssdtrain.choose_placement`` decides from the compiled step's device memory
  with the state on the device (with --policy auto: the planner's plan for the activations at
  the run's batch) against --memory-budget, else the device's memory."""
  import jax_ssdtrain as ssd

  planned = cfg.policy == "auto"
  on_device = dataclasses.replace(run, optimizer_location=None, optimizer_in_place=False)

  def step_bytes(locations) -> int:  # compiled only where there is a budget to weigh it against
    nonlocal on_device
    try:
      if planned:
        on_device = auto_plan(on_device, cfg)
      need = training.step_memory_bytes(on_device)
    except ValueError:  # no plan fits the budget with the state on the device
      raise ValueError("no plan fits with it on the device") from None
    if on_device.batch < run.batch:  # the planner gave up batch for it
      raise ValueError(f"with it on the device the plan fits batch {on_device.batch} only")
    return need

  where = ssd.choose_placement(step_bytes, cfg.memory_budget)  # in the store: its tier "auto"
  print(where, flush=True)
  if where.on_device:
    return on_device
  return auto_plan(run, cfg) if planned else run


def parse_config(argv=None, parser: argparse.ArgumentParser | None = None) -> Config:
  """The Config of a command line; ``parser.error`` (exit status 2, one line) on options that
  do not go together. Checks only the options: nothing touches the store or a device."""
  parser = parser or build_parser()
  cfg = Config(**vars(parser.parse_args(argv)))
  if cfg.restore and not cfg.workdir:
    parser.error("--restore needs --workdir")
  if cfg.checkpoint_every and not cfg.workdir:
    parser.error("--checkpoint-every needs --workdir")
  if cfg.accum_dtype != "float32" and cfg.accum == 1 and not cfg.stream_layers:
    parser.error("--accum-dtype needs --accum K > 1 (or --stream-layers: the sum's dtype)")
  apart = [
    f for f, v in (("--stream-sum", cfg.stream_sum), ("--stream-state", cfg.stream_state)) if v
  ]
  if apart and cfg.stream_layers in (None, "auto"):
    parser.error(
      f"{' and '.join(apart)} place a class of --stream-layers' stack: they need --stream-layers "
      "host, nvme, host,nvme or device (auto chooses every class)"
    )
  if cfg.stream_layers:
    if cfg.model != "gpt":
      parser.error(f"--stream-layers: streams the GPT's layer stack, not --model {cfg.model}")
    apart = {  # what the layer stream does its own way, or not yet
      "--mesh": cfg.mesh,
      "--policy": cfg.policy,
      "--locations": cfg.locations,
      "--remat-policy": cfg.remat_policy,
      "--optimizer-location": cfg.optimizer_location,
      "--master-weights": cfg.master_weights,
      "--distributed": cfg.distributed,
    }
    given = [name for name, v in apart.items() if v]
    if given:
      parser.error(
        f"--stream-layers does not go with {', '.join(given)}: the streamed stack keeps its "
        "float32 master copy and optimizer state where it lives, recomputes each layer in the "
        "backward pass, and runs on one device"
      )
  if (
    cfg.data != "synthetic"
    and not any(c in cfg.data for c in "*?[")
    and not os.path.exists(cfg.data)
  ):
    parser.error(f"--data: no such file {cfg.data!r}")
  run = cfg.run_config()
  try:  # the optimizer's settings (in place needs a location, ...): make_optimizer checks them
    if not cfg.stream_layers:  # (the layer stream's: its own, in place or not)
      training.make_optimizer(run)
  except ValueError as e:
    parser.error(str(e))
  model = run.model_config()
  if model.positions == "learned" and (cfg.seq_len or 0) > model.max_len:
    parser.error(f"--seq-len {cfg.seq_len} exceeds the preset's max_len {model.max_len}")
  if cfg.memory_budget and "auto" not in (cfg.policy, cfg.optimizer_location, cfg.stream_layers):
    parser.error(
      "--memory-budget needs --policy auto, --optimizer-location auto or --stream-layers auto"
    )
  if cfg.max_slowdown < 0:
    parser.error(f"--max-slowdown must be >= 0, got {cfg.max_slowdown}")
  missing = sorted(t for t in (cfg.locations or {}) if t not in models.MODEL_TAGS[cfg.model])
  if missing:
    parser.error(
      f"--locations: model {cfg.model!r} has no tag {', '.join(map(repr, missing))} "
      f"(its tags: {', '.join(models.MODEL_TAGS[cfg.model])})"
    )
  return cfg


def main(argv=None) -> dict:
  """One run of the command line: the options checked, the store opened, the run built (its
  state made or restored), trained by :func:`train_loop` and summed up; returns the summary."""
  parser = build_parser()
  args = parse_config(argv, parser)  # the run's Config
  run = args.run_config()
  devices = open_store(args, run, parser)  # the mesh's (None: no --mesh)
  try:
    if run.optimizer_location == "auto":
      run = place_optimizer(run, args)
    elif args.policy == "auto":
      run = auto_plan(run, args)
  except ValueError as e:
    parser.error(str(e))
  job = (build_streamed if args.stream_layers else build_dense)(args, run, parser, devices)
  reporter = Reporter(args, job)
  try:
    state, done = train_loop(job, reporter)
  finally:
    reporter.close()
    job.close()
  summary = reporter.summary(job, state, done)
  reporter.write_summary(summary, argv)
  return summary


def _error_exit(parser, e: Exception):
  parser.exit(2, f"{parser.prog}: error: {_error_text(e)}\n")


def open_store(args: Config, run: training.RunConfig, parser) -> list | None:
  """The store's settings (SSDTRAIN_* variables) checked before any model work, the processes
  joined (--distributed), the store opened and announced. Returns the devices of --mesh (None:
  no mesh)."""
  try:
    import jax_ssdtrain as ssd  # checks the variables' values

    ssd.default_config()
  except (ValueError, OSError) as e:
    _error_exit(parser, e)
  if args.distributed or args.coordinator:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  devices = None
  if args.devices is not None and not args.mesh:
    parser.error("--devices needs --mesh (the devices of the mesh)")
  if args.mesh:
    from models import parallel

    try:
      if args.devices is None:
        devices = parallel.default_devices(args.mesh.size)
      else:
        devices = parallel.select_devices(args.devices)
    except ValueError as e:
      parser.error(f"--{'mesh' if args.devices is None else 'devices'}: {e}")
    if len(devices) != args.mesh.size:
      parser.error(f"--devices {args.devices}: --mesh needs {args.mesh.size} devices")
    if run.batch % args.mesh.data:
      parser.error(f"--batch {run.batch} is not divisible by dp={args.mesh.data}")
  try:
    if args.store_dir:  # may hold {process} / {device} (see jax_ssdtrain.configure)
      ssd.configure(directory=args.store_dir)
    elif ssd.current_config() is None:
      ssd.configure()
  except (ValueError, OSError) as e:
    _error_exit(parser, e)
  print(
    f"activation store: {', '.join(ssd.store_directories())}"
    + ("" if ssd.current_config().directories else " (private, removed at exit)"),
    flush=True,
  )
  return devices


@dataclasses.dataclass
class Job:
  """A built run, whichever way it trains: what :func:`train_loop` and :class:`Reporter`
  need."""

  state: Any  # the training state (made, or restored at ``start``)
  start: int  # the first step to run
  steps: int  # the step to stop at
  step: Any  # state -> (state, metrics {"loss", "grad_norm"}): it fetches its batches
  schedule: Any  # step index -> learning rate
  save: Any  # (step, state) -> None: a checkpoint (None: no --workdir)
  latest_saved: Any  # () -> the latest checkpoint's step (0: none)
  close: Any  # () -> None: closes the data source
  n_params: int
  tokens_per_step: int
  devices: list  # the devices that train (their memory reported)
  extra: Any  # state -> the summary's fields of this way of training
  collect_at_log: bool = False  # ssd.collect() at each logged step
  step_lines: bool = False  # print a line per logged step (besides the progress bar)


def _batches(args: Config, run: training.RunConfig, length: int, parser, start_step: int = 0):
  cfg = run.model_config()
  try:
    return data_lib.make_batches(
      args.data, args.loader, run.batch, length, cfg.vocab_size, run.seed, start_step=start_step
    )
  except data_lib.DataError as e:
    parser.error(str(e))


def _next(batches, parser):
  try:
    return next(batches)
  except data_lib.DataError as e:
    parser.error(str(e))


def _manager(args: Config):
  if not args.workdir:
    return None
  return training.checkpoint_manager(os.path.join(args.workdir, "checkpoints"))


def _closer(source: list):
  """Closes the data source ``source[0]`` (whichever one a restore left there)."""
  return lambda: source[0].close() if hasattr(source[0], "close") else None


def build_dense(args: Config, run: training.RunConfig, parser, devices) -> Job:
  """The model's whole train state on the device (its activations, optimizer state and master
  weights placed as the options say; sharded under --mesh), restored with --restore."""
  cfg = run.model_config()
  locations = run.resolved_locations()
  offloading = bool(locations) and any(v in ("host", "nvme") for v in locations.values())
  length = run.example_length(cfg)
  batches = _batches(args, run, length, parser)
  mesh = args.mesh.mesh(devices) if args.mesh else None
  # under a mesh the state is made sharded: no device holds the whole model
  state, _, schedule = training.create_train_state(run, parallelism=args.mesh, mesh=mesh)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  manager = _manager(args)
  if args.restore:
    state = training.restore_checkpoint(manager, state)
    if hasattr(batches, "close"):  # deterministic sources resume at the restored step
      batches.close()
    batches = _batches(args, run, length, parser, start_step=int(state.step))
  print(
    f"{args.model}/{args.preset}: {n_params / 1e6:.2f}M params, dtype {cfg.dtype}, "
    f"batch {run.batch}x{length}, locations {locations or 'keep'}"
    + (f", first {run.offload_layers} layers offload" if run.offload_layers is not None else ""),
    flush=True,
  )
  shardings = jax.tree.map(lambda x: x.sharding, state) if mesh is not None else None
  step_fn, rng = training.jit_train_step(shardings), jax.random.key(run.seed + 1)

  def step(state):
    tokens = _next(batches, parser)
    if mesh is not None:
      tokens = training.shard_batch(tokens, args.mesh, mesh)
    return step_fn(state, tokens, rng)

  return Job(
    state=state,
    start=int(state.step),
    steps=run.steps,
    step=step,
    schedule=schedule,
    save=manager and (lambda _, state: training.save_checkpoint(manager, state)),
    latest_saved=lambda: (manager.latest_step() or 0) if manager else 0,
    close=_closer([batches]),
    n_params=n_params,
    tokens_per_step=run.batch * (run.seq_len or cfg.max_len),  # model input positions
    devices=mesh.local_devices if mesh is not None else jax.local_devices(),
    extra=lambda state: dict(
      offload=offloading, optimizer_location=training.optimizer_location(state.opt_state)
    ),
    collect_at_log=bool(run.optimizer_location),  # the state's version before this step's
  )


def streamed_trainer(args: Config, run: training.RunConfig):
  """--stream-layers: ``jax_ssdtrain.StreamedTrainer`` of the GPT cut by
  ``models.layer_stream.gpt_pieces``: AdamW with the schedule and weight-decay mask of
  ``training.make_optimizer``, global-norm clipping at --clip-norm. Returns (trainer,
  schedule)."""
  import optax

  import jax_ssdtrain as ssd
  from models.layer_stream import gpt_pieces

  extra = {"dtype": args.dtype} if args.dtype else {}
  pieces = gpt_pieces(args.preset, args.layers, attention=args.attention, **extra)
  schedule = training.make_optimizer(dataclasses.replace(run, optimizer_in_place=False))[1]
  mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731 (as make_optimizer)
  tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=mask)
  trainer = ssd.StreamedTrainer(
    pieces.embed,
    pieces.block,
    pieces.head,
    tx,
    init_layer=pieces.init_layer,
    num_layers=pieces.cfg.num_layers,
    init_side=pieces.init_side,
    location="device" if args.stream_layers == "auto" else args.stream_layers,
    sum_location=args.stream_sum,
    state_location=args.stream_state,
    micro_batches=args.accum,
    sum_dtype=args.accum_dtype,
    in_place=args.optimizer_in_place,
    clip_global_norm=args.clip_norm,
  )
  return trainer, schedule


def place_stream(trainer, args: Config, run: training.RunConfig, parser):
  """The store sized for the streamed stack before anything is stored: with --stream-layers
  auto each class placed (``StreamedTrainer.choose_placement``, printed); the read-ahead sized
  from the layer; a placement in the store checked against its room (refused with the
  arithmetic). Returns the placed trainer and ``args`` with the classes' locations."""
  import jax_ssdtrain as ssd

  seq = run.example_length(run.model_config())
  try:
    if args.stream_layers == "auto":  # each class on the device where the step fits, else stored
      batch = jax.ShapeDtypeStruct((run.batch, seq), jax.numpy.int32)
      where = trainer.choose_placement(batch, args.memory_budget, name=args.preset)
      print(where, flush=True)
      trainer = trainer.placed(where)
      args = dataclasses.replace(
        args,
        stream_layers=where.locations["params"],
        stream_sum=where.locations["grad_sum"],
        stream_state=where.locations["optimizer_state"],
      )
    variables = trainer.read_ahead_variables()
    sizes = trainer.configure_read_ahead()  # nothing is stored yet
    if sizes:
      print(
        "layer stream: read-ahead "
        + ", ".join(f"{o} {v / (1 << 30):.2f} GiB" for o, v in sizes.items())
        + f" (whole layers ahead; {', '.join(variables[o] for o in sizes)} to override)",
        flush=True,
      )
    if any(
      v not in (None, "device") for v in (args.stream_layers, args.stream_sum, args.stream_state)
    ):
      room = trainer.check_room(args.preset)  # refused before anything is stored
      where = ", ".join(f"{c} {loc}" for c, loc in room["locations"].items())
      print(
        f"layer stream: {trainer.num_layers} layers ({where}), "
        f"{room['peak_bytes'] / 1e9:.2f} GB of the store at most "
        f"({room['room_bytes'] / 1e9:.2f} GB of room)",
        flush=True,
      )
  except ssd.StreamedRoomError as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  return trainer, args


def build_streamed(args: Config, run: training.RunConfig, parser, devices=None) -> Job:
  """--stream-layers: ``args.steps`` optimizer steps of ``args.accum`` micro-batches of the
  GPT's stack streamed layer by layer (:func:`streamed_trainer`, :func:`place_stream`); its
  checkpoints streamed layer by layer too (``StreamedTrainer.save`` / ``restore``)."""
  import numpy as np

  import jax_ssdtrain as ssd

  trainer, schedule = streamed_trainer(args, run)
  trainer, args = place_stream(trainer, args, run, parser)
  seq = run.example_length(run.model_config())
  source = [_batches(args, run, seq, parser)]  # replaced where a restore resumes it

  def micro_batches():
    return [
      jax.numpy.asarray(np.asarray(_next(source[0], parser)), jax.numpy.int32)
      for _ in range(args.accum)
    ]

  first = [micro_batches()]  # init_side's shapes; the first step's batches
  state, start = trainer.init(jax.random.key(run.seed), first[0][0]), 0
  manager = _manager(args)
  if args.restore:
    try:
      state, start = trainer.restore(manager, state)
    except FileNotFoundError:
      parser.error(f"--restore: no checkpoint in {os.path.join(args.workdir, 'checkpoints')}")
    ssd.collect()  # the fresh init's entries (nothing holds them now)
    if hasattr(source[0], "close"):  # deterministic sources resume at the restored step
      source[0].close()
    source[0] = _batches(args, run, seq, parser, start_step=start * args.accum)
    first = [micro_batches()]

  def step(state):
    batches = first.pop() if first else micro_batches()
    return trainer.step(state, batches)

  n_params = sum(x.size for x in jax.tree.leaves(state.side)) + trainer.num_params()
  tokens_per_step = run.batch * args.accum * (seq - 1)
  print(
    f"gpt/{args.preset}: {n_params / 1e6:.2f}M params, {trainer.num_layers} layers streamed "
    f"from {args.stream_layers}, {args.accum} x {run.batch}x{seq - 1} tokens a step",
    flush=True,
  )

  return Job(
    state=state,
    start=start,
    steps=args.steps,
    step=step,
    schedule=schedule,
    save=manager and (lambda step, state: trainer.save(manager, step, state)),
    latest_saved=lambda: (manager.latest_step() or 0) if manager else 0,
    close=_closer(source),
    n_params=int(n_params),
    tokens_per_step=tokens_per_step,
    devices=jax.local_devices(),
    extra=lambda _: dict(
      stream_layers=args.stream_layers,
      stream_sum=args.stream_sum or args.stream_layers,
      stream_state=args.stream_state or args.stream_layers,
    ),
    step_lines=True,
  )


def train_loop(job: Job, reporter: Reporter) -> tuple[Any, int]:
  """The one training loop: ``job.step`` from ``job.start`` to ``job.steps``, the metrics
  fetched every --log-every steps (and at the last), a checkpoint every --checkpoint-every
  steps and at the end. Returns the final state and its step."""
  import jax_ssdtrain as ssd

  ssd.reset_stats()
  print(
    "compiling the training step (the first step takes longer) ...", file=sys.stderr, flush=True
  )
  state, args = job.state, reporter.args
  job.state = None  # the loop's: each step donates it
  reporter.start(job.start)
  for step in range(job.start, job.steps):
    state, metrics = job.step(state)
    reporter.stepped(step, metrics)
    if (step + 1) % args.log_every == 0 or step + 1 == job.steps:
      reporter.log(step, metrics)
      if job.collect_at_log:  # old versions of the state in the store (docs/optimizer.md)
        ssd.collect()
    if job.save and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
      job.save(step + 1, state)
  jax.block_until_ready(state)
  reporter.finish()
  done = max(job.start, job.steps)
  if job.save and job.latest_saved() < done:
    job.save(done, state)
  return state, done


class Reporter:
  """The run's progress and results: the progress bar (and, for the layer stream, a line per
  logged step), metrics.csv and TensorBoard events under --workdir, the throughput (compilation
  excluded; the second half of the run apart: its steady state), the last line and the
  summary."""

  COLUMNS = ["loss", "grad_norm", "lr", "tokens_per_s", "gb_written", "gb_read"]

  def __init__(self, args: Config, job: Job):
    self.args, self.job = args, job
    self.writer = self.csv_file = self.tb = None
    if args.workdir:
      os.makedirs(args.workdir, exist_ok=True)
      csv_path = os.path.join(args.workdir, "metrics.csv")
      self.csv_file = open(csv_path, "a" if args.restore else "w", newline="")
      self.writer = csv.writer(self.csv_file)
      if not args.restore or os.path.getsize(csv_path) == 0:
        self.writer.writerow(["step", *self.COLUMNS])
      self.tb = _tb_writer(args.workdir)
      print(
        f"metrics: {csv_path}; checkpoints: {os.path.join(args.workdir, 'checkpoints')}",
        flush=True,
      )

  def start(self, start: int) -> None:
    from tqdm import tqdm

    steps = self.job.steps
    # Advanced by hand after each step: a bar iterating the range would count in a local
    # variable and show a stale count whenever the postfix (loss, tokens/s) refreshes it.
    self.bar = tqdm(initial=start, total=steps, dynamic_ncols=True)
    self.tokens_done, self.t0, self.loss, self.losses, self.times = 0, None, float("nan"), [], []
    self.mid_step, self.t_mid, self.tokens_mid = start + max(1, (steps - start) // 2), None, 0
    self.t_log, self.last_logged = time.perf_counter(), start

  def stepped(self, step: int, metrics: dict) -> None:
    if self.t0 is None:  # compilation excluded from throughput
      jax.block_until_ready(metrics)
      self.t0 = time.perf_counter()
    else:
      self.tokens_done += self.job.tokens_per_step
    if step + 1 == self.mid_step and step + 1 < self.job.steps:
      jax.block_until_ready(metrics)
      self.t_mid, self.tokens_mid = time.perf_counter(), self.tokens_done
    self.bar.update(1)

  def log(self, step: int, metrics: dict) -> None:
    import jax_ssdtrain as ssd

    self.loss = float(metrics["loss"])  # waits for the step
    now = time.perf_counter()
    self.times.append((now - self.t_log) / (step + 1 - self.last_logged))  # per step
    self.losses.append(self.loss)
    self.t_log, self.last_logged = now, step + 1
    dt = now - self.t0
    tps = self.tokens_done / dt if dt > 0 and self.tokens_done else 0.0
    st = ssd.stats()
    gw, gr = st.get("bytes_written", 0) / 1e9, st.get("bytes_read", 0) / 1e9
    self.bar.set_postfix(loss=f"{self.loss:.4f}", tok_s=f"{tps:,.0f}", GB_off=f"{gw:.3f}")
    lr, norm = float(self.job.schedule(step)), float(metrics["grad_norm"])
    if self.job.step_lines:
      self.bar.write(
        f"step {step + 1}: loss {self.loss:.4f}  grad_norm {norm:.4f}  lr {lr:.2e}  "
        f"{self.times[-1]:.2f} s",
        file=sys.stdout,
      )
    row = [step + 1, self.loss, norm, lr, tps, gw, gr]
    if self.writer:
      self.writer.writerow(row)
    if self.tb:
      for k, v in zip(self.COLUMNS, row[1:]):
        self.tb.add_scalar(k, v, step + 1)

  def finish(self) -> None:
    self.bar.close()
    now = time.perf_counter()
    self.dt = now - self.t0 if self.t0 is not None else 0.0
    self.late = now - self.t_mid if self.t_mid is not None else 0.0

  def close(self) -> None:
    for f in (self.csv_file, self.tb):
      if f:
        f.close()
    self.csv_file = self.tb = None

  def summary(self, job: Job, state: Any, done: int) -> dict:
    """The run's numbers (the last line's and the summary JSON's), and its last line printed."""
    import numpy as np

    import jax_ssdtrain as ssd

    st = ssd.stats()
    mem = job.devices[0].memory_stats() or {}  # None on CPU
    tokens = self.tokens_done
    summary = (
      dict(
        final_loss=self.loss,
        losses=self.losses,  # each logged step's
        tokens_per_s=tokens / self.dt if self.dt > 0 and tokens else 0.0,
        tokens_per_s_second_half=(tokens - self.tokens_mid) / self.late if self.late > 0 else 0.0,
        step_s_median=float(np.median(self.times[1:] or self.times or [0.0])),
        gb_written=st.get("bytes_written", 0) / 1e9,
        gb_read=st.get("bytes_read", 0) / 1e9,
        peak_device_gb=mem.get("peak_bytes_in_use", 0) / 1e9,
        # the process's peak resident memory: the store's host tier and cache once touched
        peak_host_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        n_params=job.n_params,
        tokens_per_step=job.tokens_per_step,
        steps=done,
      )
      | job.extra(state)
    )
    print(
      f"done: steps {done}  final loss {self.loss:.4f}  tokens/s {summary['tokens_per_s']:,.0f} "
      f"(second half {summary['tokens_per_s_second_half']:,.0f})  "
      f"store written {summary['gb_written']:.4f} GB  read {summary['gb_read']:.4f} GB"
      + (f"  peak device memory {summary['peak_device_gb']:.2f} GB" if mem else ""),
      flush=True,
    )
    return summary

  def write_summary(self, summary: dict, argv) -> None:
    if not self.args.summary_json:
      return
    record = {
      "argv": sys.argv[1:] if argv is None else list(argv),
      "device_kind": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "store_env": {k: v for k, v in os.environ.items() if k.startswith("SSDTRAIN_")},
    }
    with open(self.args.summary_json, "w") as f:
      json.dump(summary | record, f, indent=1)


if __name__ == "__main__":
  main()
