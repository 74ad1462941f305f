"""The training step of the models in ``models/``: run config, optimizer, train state, the pure
``train_step``, sharding, profiling and orbax checkpointing (``scripts.train`` and the benchmarks
share it; ``models/`` holds the models alone)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state

from models import build_model, get_config, make_remat_policy, resolve_locations
from models.common import Block, ModelConfig, SplitPolicy


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything about a run that is not the model's shape."""

  model: str = "gpt"
  preset: str = "tiny"
  batch: int = 8
  seq_len: int | None = None  # model positions per example; default: the preset's max_len
  steps: int = 30
  lr: float = 3e-3
  warmup: int | None = None  # default: steps // 10
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  seed: int = 0
  remat_policy: str | None = None  # keep | remat | offload (shortcut, see models.common)
  locations: Mapping[str, str] | str | None = None  # {tag: remat|device|host|nvme} overrides
  min_bytes: int = 1 << 20
  # Where the optimizer state lives: None (the device), a store location (host | nvme |
  # host,nvme) through jax_ssdtrain.offload_optimizer, or "pinned_host": JAX's own host offload
  # (the state in pinned host memory, moved to the device for each update and back: MaxText's
  # optimizer_memory_host_offload), the comparison JAX alone offers.
  optimizer_location: str | None = None
  # bfloat16 parameters on the device, their float32 copy in the optimizer state
  # (jax_ssdtrain.with_master_weights; in the store with optimizer_location).
  master_weights: bool = False
  # offload_optimizer(in_place=True): one version of the state in the store (optimizer_location)
  optimizer_in_place: bool = False
  # micro-batches per optimizer step (jax_ssdtrain.accumulate_gradients); a step is one
  accum: int = 1
  accum_dtype: str = "float32"  # of the running mean of the gradients (on the device)
  # Split scan: the first offload_layers layers use ``locations``, the others the same with
  # host/nvme tags kept on the device (None: every layer uses ``locations``).
  offload_layers: int | None = None
  dtype: str | None = None  # override ModelConfig.dtype
  model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def model_config(self) -> ModelConfig:
    extra = dict(self.model_overrides)
    if self.dtype:
      extra["dtype"] = self.dtype
    return get_config(self.model, self.preset, **extra)

  def resolved_locations(self):
    return resolve_locations(self.remat_policy, self.locations)

  def remat_policy_object(self):
    """The jax.checkpoint policy of the run: one policy, or a SplitPolicy."""
    locations = self.resolved_locations()
    first = make_remat_policy(locations, self.min_bytes)
    if self.offload_layers is None:
      return first
    if locations is None:
      raise ValueError(f"offload_layers={self.offload_layers} needs locations to offload")
    kept = {t: "device" if loc in ("host", "nvme") else loc for t, loc in locations.items()}
    return SplitPolicy(first, make_remat_policy(kept, self.min_bytes), self.offload_layers)

  def example_length(self, cfg: ModelConfig) -> int:
    """Tokens per example drawn from the data (GPT needs one more for the shifted target)."""
    seq = self.seq_len or cfg.max_len
    return seq + 1 if self.model == "gpt" else seq


class TrainState(train_state.TrainState):
  # optimizer_location="pinned_host": the shardings of the state's leaves on the device, in the
  # order of jax.tree.leaves(opt_state) (between the steps they lie in pinned host memory)
  opt_state_on_device: Any = struct.field(pytree_node=False, default=None)

  def apply_gradients(self, *, grads, **kwargs):
    """Flax's, except that optimizer state in the store (``offload_optimizer``) updates the
    parameters inside its stream (``ssd.apply_gradients``: no whole array of updates), and state
    in pinned host memory is moved to the device for the update and its result back."""
    import jax_ssdtrain as ssd

    if self.opt_state_on_device is not None:
      device = self.opt_state_on_device
      moved = self.replace(
        opt_state=_placed_leaves(self.opt_state, device), opt_state_on_device=None
      )
      new = moved.apply_gradients(grads=grads, **kwargs)
      return new.replace(
        opt_state=_placed_leaves(new.opt_state, _in_pinned_host(device)), opt_state_on_device=device
      )

    streamed = getattr(self.tx.update, "apply_gradients", None)  # offload or accumulate
    if streamed is None:
      return super().apply_gradients(grads=grads, **kwargs)
    params, opt_state = ssd.apply_gradients(self.tx, grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


def make_optimizer(run: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW, linear warm-up then cosine decay to lr/10, global-norm gradient clipping; its state
  in the store where ``run.optimizer_location`` says so."""
  warmup = max(run.steps // 10 if run.warmup is None else run.warmup, 1)
  # optax needs at least one decay step after the warm-up (runs of 1 step included).
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, run.lr, warmup, max(run.steps, warmup + 1), end_value=run.lr / 10
  )
  mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms/biases
  tx = optax.chain(
    optax.clip_by_global_norm(run.clip_norm),
    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=run.weight_decay, mask=mask),
  )
  if run.master_weights:
    import jax_ssdtrain as ssd

    tx = ssd.with_master_weights(tx)
  if run.optimizer_location == "pinned_host":  # JAX's own: placed by create_train_state
    if run.optimizer_in_place:
      raise ValueError("optimizer_in_place is the store's (optimizer_location='pinned_host')")
  elif run.optimizer_location is not None:
    import jax_ssdtrain as ssd

    tx = ssd.offload_optimizer(
      tx,
      location=run.optimizer_location,
      min_bytes=max(run.min_bytes, 4096),
      in_place=run.optimizer_in_place,
    )
  elif run.optimizer_in_place:
    raise ValueError("optimizer_in_place needs optimizer_location (the state in the store)")
  if run.accum > 1:
    import jax_ssdtrain as ssd

    tx = ssd.accumulate_gradients(tx, run.accum, dtype=jnp.dtype(run.accum_dtype))
  return tx, schedule


def create_train_state(run: RunConfig, policy=None, *, parallelism=None, mesh=None):
  """Returns (state, model, schedule). ``policy`` defaults to the run's locations.

  With ``parallelism`` and ``mesh`` (see models.parallel) the state is made sharded on the
  mesh: the parameters by one program whose ``out_shardings`` place each device's slice (no
  device ever holds the whole model: what lets a model larger than one GPU start), the
  optimizer state from them (state in the store, ``offload_optimizer``, streamed per device).
  Its values are those of the state made on one device and placed by
  :func:`shard_train_state` (JAX's partitionable random bits); the shardings too."""
  if (parallelism is None) != (mesh is None):
    raise ValueError("create_train_state: pass parallelism and mesh together")
  cfg = run.model_config()
  if policy is None:
    policy = run.remat_policy_object()
  model = build_model(run.model, cfg, policy)
  tokens = jnp.zeros((run.batch, run.example_length(cfg)), jnp.int32)
  init_rng, loss_rng = jax.random.split(jax.random.key(run.seed))

  def init_params(r):
    return model.init(r, tokens, loss_rng, method="loss")["params"]

  if mesh is None:
    params = jax.jit(init_params)(init_rng)
  else:
    shardings = parallelism.shardings(jax.eval_shape(init_params, init_rng), mesh)
    params = jax.jit(init_params, out_shardings=shardings)(init_rng)
  tx, schedule = make_optimizer(run)
  state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  if run.master_weights:  # the copy was made from the float32 values; the model trains on bf16
    low = lambda p: p.astype(jnp.bfloat16) if jnp.issubdtype(p.dtype, jnp.floating) else p  # noqa: E731
    state = state.replace(params=jax.tree.map(low, state.params))
    del params
    state = state.replace(params=_moved_below(state.params))
  # Array step and committed arrays, like a restored state: one compilation for both.
  state = state.replace(step=jnp.zeros((), jnp.int32))
  if mesh is None:
    state = jax.device_put(state, jax.local_devices()[0])
  else:
    state = _placed_as(state, parallelism, mesh)
  if run.optimizer_location == "pinned_host":
    device = tuple(x.sharding for x in jax.tree.leaves(state.opt_state))
    state = state.replace(
      opt_state=_placed_leaves(state.opt_state, _in_pinned_host(device)), opt_state_on_device=device
    )
  return state, model, schedule


def _moved_below(params):
  """Fresh copies of ``params`` (the same values), made once the float32 parameters they were
  cast from are freed. The bfloat16 copies were allocated above the float32 ones, so their
  freed space stays a hole below them, and XLA's pool is left in two free blocks: at long
  context a step's temporary buffer, one allocation of most of the pool, then fails to fit
  (8B at 256K: 99 GiB asked of two blocks of 28 and 88 GiB in a 133 GiB pool). The copies
  fill the hole from below, and the free space above them is one block again."""
  copies = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))(params)
  return jax.block_until_ready(copies)


def _in_pinned_host(shardings: tuple) -> tuple:
  return tuple(s.with_memory_kind("pinned_host") for s in shardings)


def _placed_leaves(tree, shardings: tuple):
  """``tree`` with each leaf put on its sharding of ``shardings`` (in leaf order); under jit,
  a transfer between the memories of one device."""
  leaves, treedef = jax.tree.flatten(tree)
  if len(leaves) != len(shardings):
    raise ValueError(f"{len(shardings)} shardings for an optimizer state of {len(leaves)} leaves")
  return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in zip(leaves, shardings)])


def _placed_as(state: TrainState, parallelism, mesh) -> TrainState:
  """``state`` (parameters already on ``mesh``) with each leaf on the device as
  :func:`shard_train_state` places it: the step replicated, optimizer state on the device by
  ``parallelism``'s spec (optax's init made it like the parameters; a device copy where not)
  and kept leaves of state in the store as their parameters (``offload_optimizer``'s own)."""
  store_free = state.replace(
    opt_state=jax.tree.map(
      lambda x: () if _is_offloaded(x) else x, state.opt_state, is_leaf=_is_offloaded
    )
  )
  shardings = parallelism.shardings(store_free, mesh)
  placed = jax.tree.map(_moved_to, store_free, shardings)
  opt_state = jax.tree.map(
    lambda x, p: x if _is_offloaded(x) else p,
    state.opt_state,
    placed.opt_state,
    is_leaf=_is_offloaded,
  )
  return placed.replace(opt_state=opt_state)


def train_step(state: TrainState, tokens: jax.Array, rng: jax.Array):
  """One optimizer step on a (B, L) int32 batch; ``rng`` is folded with the step (for masking)."""
  rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params):
    return state.apply_fn({"params": params}, tokens, rng, method="loss")

  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = dict(
    metrics,
    grad_norm=optax.tree.norm(grads) if hasattr(optax, "tree") else optax.global_norm(grads),
  )
  return state.apply_gradients(grads=grads), metrics


def jit_train_step(state_shardings=None):
  """The jitted step; with ``state_shardings`` (see :func:`shard_train_state`) the new state
  keeps the sharding of the old one."""
  if state_shardings is None:
    return jax.jit(train_step, donate_argnums=0)
  from models.parallel import batch_sharded_activations

  mesh = jax.tree.leaves(state_shardings)[0].mesh

  def sharded_step(state, tokens, rng):
    with batch_sharded_activations(mesh):
      return train_step(state, tokens, rng)

  return jax.jit(sharded_step, donate_argnums=0, out_shardings=(state_shardings, None))


def _moved_to(x, sharding):
  """``x`` on ``sharding`` (unchanged where it lies so already)."""
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  return jax.device_put(x, sharding)


def shard_train_state(state: TrainState, parallelism, mesh):
  """Places ``state`` on ``mesh`` (params and optimizer state per ``parallelism``, see
  models.parallel); returns (state, its shardings). Optimizer state in the store
  (``offload_optimizer``) is made again from the placed parameters, so that each device streams
  its own blocks, and filled with the values it held."""
  import jax_ssdtrain as ssd

  offloaded = jax.tree.leaves(state.opt_state, is_leaf=_is_offloaded)
  if any(_is_offloaded(x) for x in offloaded):
    placed, _ = shard_train_state(state.replace(opt_state=()), parallelism, mesh)
    values = _state_on_host(state).opt_state  # NumPy, read chunk by chunk
    fresh = state.tx.init(placed.params)
    opt_state = jax.tree.map(
      lambda f, v: ssd.state_from_host(v, f) if _is_offloaded(f) else _place_like(v, f),
      fresh,
      values,
      is_leaf=_is_offloaded,
    )
    placed = placed.replace(opt_state=opt_state)
    return placed, jax.tree.map(lambda x: x.sharding, placed)
  shardings = parallelism.shardings(state, mesh)
  host = jax.tree.map(np.asarray, state)  # from the one device it was created on
  # Every process holds the whole state: each device takes its slice (works across hosts).
  placed = jax.tree.map(
    lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), host, shardings
  )
  return placed, shardings


def _place_like(value, like):
  """``value`` (host) placed as ``like`` (an array of the freshly made optimizer state)."""
  return jax.device_put(np.asarray(value), like.sharding)


def shard_batch(tokens, parallelism, mesh):
  """The global (B, L) batch on ``mesh``; every process passes the whole batch and contributes
  its own block of rows (process i: rows [i*B/n, (i+1)*B/n))."""
  tokens = np.asarray(tokens)
  n, i = jax.process_count(), jax.process_index()
  if tokens.shape[0] % parallelism.data or tokens.shape[0] % n:
    raise ValueError(
      f"batch {tokens.shape[0]} is not divisible by data={parallelism.data} "
      f"and by the {n} process(es)"
    )
  rows = tokens.shape[0] // n
  return jax.make_array_from_process_local_data(
    parallelism.batch_sharding(mesh), tokens[i * rows : (i + 1) * rows]
  )


# ----------------------------------------------------------------------------- planner
def step_memory_bytes(run: RunConfig, policy=None) -> int:
  """Device bytes of one compiled train step (XLA's memory analysis; compiles, runs nothing):
  arguments + outputs + temporaries - donated (aliased) bytes."""
  cfg = run.model_config()
  model = build_model(run.model, cfg, run.remat_policy_object() if policy is None else policy)
  tokens = jax.ShapeDtypeStruct((run.batch, run.example_length(cfg)), jnp.int32)

  def init_state(rng):
    params = model.init(rng, jnp.zeros(tokens.shape, tokens.dtype), rng, method="loss")["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(run)[0])
    return state.replace(step=jnp.zeros((), jnp.int32))

  key = jax.random.key(0)
  state = jax.eval_shape(init_state, key)
  ma = jit_train_step().lower(state, tokens, key).compile().memory_analysis()
  if ma is None:
    raise RuntimeError("this backend gives no memory analysis of compiled programs")
  return int(
    ma.argument_size_in_bytes
    + ma.output_size_in_bytes
    + ma.temp_size_in_bytes
    - ma.alias_size_in_bytes
  )


def profile_run(
  run: RunConfig,
  *,
  directory=None,
  bandwidth=None,
  repeats: int = 5,
  outside_layers: bool = True,
  **options,
):
  """The planner's profile of one block of the run's model at the run's batch and length;
  with ``outside_layers``, also the step's time outside the layers (``other_s``, ``update_s``)."""
  import jax_ssdtrain as ssd

  cfg = run.model_config()
  if run.model != "gpt":
    raise ValueError(f"model: the planner profiles 'gpt' stacks, got {run.model!r}")
  seq = run.seq_len or cfg.max_len
  block = Block(cfg, causal=True)
  x = jax.random.normal(
    jax.random.key(0), (run.batch, seq, cfg.hidden), cfg.compute_dtype
  )  # (B,S,H)
  params = jax.jit(block.init)(jax.random.key(1), x)["params"]
  layer = lambda p, h: block.apply({"params": p}, h)[0]  # noqa: E731
  prof = ssd.profile(
    layer,
    params,
    x,
    num_layers=cfg.num_layers,
    directory=directory,
    bandwidth=bandwidth,
    batch=run.batch,
    repeats=repeats,
    **options,
  )
  if outside_layers:
    other_s, update_s = outside_layers_seconds(run, prof, repeats)
    prof = dataclasses.replace(prof, other_s=other_s, update_s=update_s)
  return prof


def outside_layers_seconds(run: RunConfig, prof, repeats: int = 5) -> tuple[float, float]:
  """``(other_s, update_s)``: the step's time outside the layer stack that grows with the
  batch (embedding, head, loss), and the optimizer update of all ``num_layers``. The first is
  the step of the model cut to one layer (every tag on the device, as the profile) minus that
  layer's forward and backward and minus its optimizer update."""
  from jax_ssdtrain._src.measure.timing import median_time  # the timer ssd.profile uses

  cfg = run.model_config()
  tags = {t.name: "device" for t in prof.tags}
  one = dataclasses.replace(
    run,
    locations=tags or None,
    remat_policy=None if tags else "keep",
    offload_layers=None,
    model_overrides={**run.model_overrides, "num_layers": 1},
  )
  tokens = jnp.zeros((run.batch, run.example_length(one.model_config())), jnp.int32)
  state, _, _ = create_train_state(one)
  step = jax.jit(train_step).lower(state, tokens, jax.random.key(0)).compile()  # no donation
  step_s = median_time(
    lambda step=step, state=state: step(state, tokens, jax.random.key(0))[1], repeats, warmup=1
  )
  del step
  update_1 = _update_seconds(state, repeats)
  del state
  update_l = update_1
  if cfg.num_layers > 1:  # the whole model's parameters and optimizer state
    full, _, _ = create_train_state(dataclasses.replace(run, locations=tags or None))
    update_l = _update_seconds(full, repeats)
  return max(0.0, step_s - prof.forward_s - prof.backward_s - update_1), update_l


def _update_seconds(state: TrainState, repeats: int) -> float:
  """The optimizer update of ``state`` (its parameters standing in for gradients)."""
  from jax_ssdtrain._src.measure.timing import median_time

  update = jax.jit(lambda s: s.apply_gradients(grads=s.params).params)
  return median_time(lambda: update(state), repeats, warmup=1)


def parse_bandwidth(text: str) -> tuple[float, float]:
  """``"W,R"`` (GB/s) -> (write, read), both >= 0 (the ``--bandwidth`` flag of the scripts)."""
  try:
    w, r = (float(v) for v in text.split(","))
  except ValueError:
    raise ValueError(f"expected WRITE,READ in GB/s, got {text!r}") from None
  if w < 0 or r < 0:
    raise ValueError(f"bandwidths must be >= 0, got {text!r}")
  return w, r


def apply_plan(run: RunConfig, plan) -> RunConfig:
  """``run`` with the plan's locations, split and batch."""
  return dataclasses.replace(
    run,
    remat_policy=None,
    locations={n: loc.value for n, loc in plan.locations},
    offload_layers=plan.offload_layers,
    min_bytes=plan.min_bytes,
    batch=plan.profile.batch or run.batch,
  )


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_manager(directory: str, max_to_keep: int = 2):
  import orbax.checkpoint as ocp

  return ocp.CheckpointManager(
    os.path.abspath(directory),
    options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
  )


def _is_offloaded(x) -> bool:
  import jax_ssdtrain as ssd

  return isinstance(x, ssd.OffloadedState)


def optimizer_location(opt_state) -> str:
  """Where the optimizer state lives: "device", "pinned_host" (JAX's own host offload), or the
  store's tier that holds it."""
  stored = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_offloaded) if _is_offloaded(x)]
  if stored:
    return stored[0].location
  kinds = {
    getattr(getattr(x, "sharding", None), "memory_kind", None) for x in jax.tree.leaves(opt_state)
  }
  return "pinned_host" if "pinned_host" in kinds else "device"


def _state_on_host(state: TrainState) -> TrainState:
  """``state`` with optimizer state in the store read into host memory (NumPy), chunk by chunk."""
  import jax_ssdtrain as ssd

  return state.replace(
    opt_state=jax.tree.map(
      lambda x: ssd.state_to_host(x) if _is_offloaded(x) else x,
      state.opt_state,
      is_leaf=_is_offloaded,
    )
  )


def save_checkpoint(manager, state: TrainState) -> None:
  """Saves ``state`` at its step (Orbax: written beside the last checkpoint and made current
  when complete, so an interrupted save leaves the last one). Optimizer state in the store is
  written from it one chunk at a time (jax_ssdtrain.checkpointing): never whole in memory."""
  from jax_ssdtrain import checkpointing

  manager.save(int(state.step), args=checkpointing.save_args(state))
  manager.wait_until_finished()


def restore_checkpoint(manager, state: TrainState, step: int | None = None) -> TrainState:
  """Restore ``step`` (default: the latest) into the structure of ``state``; optimizer state in
  the store is written back into it chunk by chunk, in the layout of ``state``'s."""
  from jax_ssdtrain import checkpointing

  return checkpointing.restore(manager, state, step)
