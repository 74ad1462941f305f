"""The training step of a model whose layer stack streams, whole: :class:`StreamedTrainer`.

Owns the glue between the layer stream's pieces that one optimizer step needs: the micro-steps
of :func:`~jax_ssdtrain.value_and_grad_streamed` over ``micro_batches`` batches (the stack's
gradients added into a running sum where ``sum_location`` says), one global norm of the mean
gradient over the stack and the device-resident embedding and head (where clipped), the stack's
update layer by layer (:func:`~jax_ssdtrain.apply_gradients` with the stack's state: its master
copy and optimizer state where ``state_location`` says) and the embedding's and head's on the
device (the same function with their ordinary state); the training state
(:class:`StreamedTrainState`); the store's sizing for the run (its room, checked before anything is stored; its read-ahead); the
choice of each class's location under a device budget
(:func:`~jax_ssdtrain.choose_placement` weighing this trainer's compiled programs); and the
checkpoints of its state (:mod:`jax_ssdtrain.checkpointing`). With every location ``"device"``
the same programs keep every stack on the device: the reference the store's steps equal bit for
bit. The model is three functions and their initialisers: nothing here knows a model.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import config
from jax_ssdtrain._src.layer_stream import (
  StreamedOptState,
  StreamedStack,
  apply_device_update,
  check_streamed_room,
  init_streamed,
  init_streamed_optimizer,
  read_ahead_sizes,
  streamed_global_norm,
  update_stack,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.options import BY_NAME
from jax_ssdtrain._src.planner import Placement, StackPlacement, choose_placement
from jax_ssdtrain._src.stream_scan import value_and_grad_streamed

__all__ = ["StreamedTrainState", "StreamedTrainer"]

# The store options a trainer sizes from its layers (read_ahead_sizes), each unless its variable
# is set in the environment.
READ_AHEAD_OPTIONS = ("prefetch_bytes", "staging_bytes")


def _read_ahead_variables() -> dict[str, str]:
  env = {option: BY_NAME[option].env for option in READ_AHEAD_OPTIONS}
  return {option: var for option, var in env.items() if var not in os.environ}


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["stack", "opt", "side", "side_opt"],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class StreamedTrainState:
  """A :class:`StreamedTrainer`'s training state (a pytree): ``stack``, the stack's parameters
  where they live (a :class:`~jax_ssdtrain.StreamedStack`); ``opt``, its optimizer state with
  the master copy (a :class:`~jax_ssdtrain.StreamedOptState`); ``side``, the embedding's and
  head's parameters ``(embed_params, head_params)`` on the device; ``side_opt``, their optax
  state."""

  stack: StreamedStack
  opt: StreamedOptState
  side: tuple
  side_opt: Any


def _check_location(value: Any, what: str, optional: bool = False) -> None:
  if optional and value is None:
    return
  if isinstance(value, str) and value.strip().lower() == "auto":
    raise ValueError(
      f"{what}: 'auto' is the planner's choice for a batch: "
      "trainer.placed(trainer.choose_placement(batch, memory_budget)) places every class "
      "(ssd.choose_placement's rule, which offload_optimizer's location='auto' follows too)"
    )
  loc = Location.parse(value, what=what)
  if loc is Location.REMAT:
    raise ValueError(
      f"{what}: expected 'device', 'host', 'nvme' or 'host,nvme', got {value!r} (a stack's "
      "tensors are stored, not recomputed)"
    )


@functools.lru_cache(maxsize=64)  # trainers of the same model and settings share the programs
def _micro_program(embed_fn, block_fn, head_fn, save_inputs, sum_dtype, sum_location, in_place):
  fn = value_and_grad_streamed(
    embed_fn,
    block_fn,
    head_fn,
    save_inputs=save_inputs,
    sum_dtype=sum_dtype,
    sum_location=sum_location,
    in_place=in_place,
  )
  return jax.jit(fn, donate_argnums=4)  # the old sums


@functools.lru_cache(maxsize=64)
def _update_program(tx, micro_batches, clip, in_place):
  def update(state, sums):
    scale = 1.0 / micro_batches
    # a pass of loads over the whole sum: only where clipping needs it
    norm = streamed_global_norm(sums[1], (sums[0], sums[2]), scale=scale) if clip else None
    stack, opt = update_stack(
      tx,
      state.stack,
      sums[1],
      state.opt,
      scale=scale,
      clip_global_norm=clip,
      global_norm=norm,
      in_place=in_place,
    )
    side, side_opt = apply_device_update(
      tx,
      state.side,
      (sums[0], sums[2]),
      state.side_opt,
      scale=scale,
      clip_global_norm=clip,
      global_norm=norm,
    )
    return StreamedTrainState(stack, opt, side, side_opt), norm

  # the sums not donated: nothing the update returns has their shapes (XLA would warn)
  return jax.jit(update, donate_argnums=0)


def _cached(program, *args):
  try:
    return program(*args)
  except TypeError:  # an argument that is not hashable: a program of this trainer's own
    return program.__wrapped__(*args)


@dataclasses.dataclass(frozen=True)
class StreamedTrainer:
  """One optimizer step of a model ``head(block_{L-1}(... block_0(embed(batch))))`` whose stack
  of blocks streams from the store, in the style of optax: :meth:`init` makes the state,
  :meth:`step` advances it (its programs jitted inside, compiled once per trainer settings).

  Args:
    embed_fn, block_fn, head_fn: as :func:`~jax_ssdtrain.value_and_grad_streamed`'s
      (``embed_fn(embed_params, batch) -> x``, ``block_fn(layer_params, x) -> x``,
      ``head_fn(head_params, x, batch) -> loss``).
    tx: an optax transformation, the stack's and the embedding's and head's.
    init_layer: ``key -> one layer's parameters`` (:func:`~jax_ssdtrain.init_streamed`'s).
    num_layers: the stack's depth.
    init_side: ``(key, batch) -> (embed_params, head_params)``.
    micro_batches: the batches of one optimizer step (the gradients' mean over them).
    location: where the stack's parameters live (``"host"``, ``"nvme"``, ``"host,nvme"`` or
      ``"device"``: the reference), and by default their gradients' running sum, the master
      copy and the optimizer state too.
    sum_location, state_location: the sum's and the state's own (None: ``location``).
    sum_dtype: the running sum's dtype.
    save_inputs: where each layer's input waits for the backward pass.
    in_place: one version of the sum, the state and the master copy in the store.
    clip_global_norm: clips the mean gradient to this global norm, over the stack and the
      embedding and head at once (None: no clipping).
    collect: :func:`~jax_ssdtrain.collect` after each micro-step and update (old versions leave
      the store at once, as :func:`~jax_ssdtrain.check_streamed_room`'s arithmetic assumes).
  """

  embed_fn: Callable[[Any, Any], Any]
  block_fn: Callable[[Any, Any], Any]
  head_fn: Callable[[Any, Any, Any], Any]
  tx: Any
  _: dataclasses.KW_ONLY
  init_layer: Callable[[Any], Any]
  num_layers: int
  init_side: Callable[[Any, Any], Any]
  micro_batches: int = 1
  location: Any = "host"
  sum_location: Any = None
  state_location: Any = None
  sum_dtype: Any = jnp.float32
  save_inputs: Any = "device"
  in_place: bool = False
  clip_global_norm: float | None = None
  collect: bool = True

  def __post_init__(self):
    for what in ("embed_fn", "block_fn", "head_fn", "init_layer", "init_side"):
      if not callable(getattr(self, what)):
        raise TypeError(f"{what}: expected a function, got {getattr(self, what)!r}")
    if not (hasattr(self.tx, "init") and hasattr(self.tx, "update")):
      raise TypeError(f"tx: expected an optax GradientTransformation, got {self.tx!r}")
    for what in ("num_layers", "micro_batches"):
      v = getattr(self, what)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{what}: expected an integer >= 1, got {v!r}")
    _check_location(self.location, "location")
    _check_location(self.sum_location, "sum_location", optional=True)
    _check_location(self.state_location, "state_location", optional=True)
    clip = self.clip_global_norm
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
      raise TypeError(f"clip_global_norm: expected a number > 0 or None, got {clip!r}")
    if clip is not None and not clip > 0:
      raise ValueError(
        f"clip_global_norm: expected a number > 0 or None (no clipping), got {clip!r}"
      )
    _ = self._micro  # value_and_grad_streamed checks save_inputs, sum_dtype and in_place now

  # -- the state --------------------------------------------------------------------------------

  def _init_stack(self, key):
    return init_streamed(self.init_layer, key, self.num_layers, location=self.location)

  def init(self, key: Any, batch: Any, side_key: Any = None) -> StreamedTrainState:
    """The training state: the stack initialised layer by layer straight where it lives (from
    ``key``; layer ``i`` from ``jax.random.split(key, num_layers)[i]``), its optimizer state
    (the master copy and the moments), the embedding's and head's parameters
    (``init_side(side_key, batch)``; ``side_key`` None: ``key, side_key =
    jax.random.split(key)`` first) and their optimizer state."""
    if side_key is None:
      key, side_key = jax.random.split(key)
    stack = self._init_stack(key)
    opt = init_streamed_optimizer(self.tx, stack, location=self.state_location)
    side = tuple(jax.jit(self.init_side)(side_key, batch))
    if len(side) != 2:
      raise ValueError(
        f"init_side: expected (embed_params, head_params), got a sequence of {len(side)}"
      )
    return StreamedTrainState(stack, opt, side, self.tx.init(side))

  def num_params(self) -> int:
    """The stack's parameter count (nothing made); the side's: ``state.side``'s leaves."""
    layer = jax.eval_shape(self.init_layer, jax.random.key(0))
    return self.num_layers * sum(int(x.size) for x in jax.tree.leaves(layer))

  # -- the step ---------------------------------------------------------------------------------

  @functools.cached_property
  def _micro(self):  # (a frozen dataclass: cached in its __dict__)
    return _cached(
      _micro_program,
      self.embed_fn,
      self.block_fn,
      self.head_fn,
      self.save_inputs,
      jnp.dtype(self.sum_dtype),
      self.sum_location,
      self.in_place,
    )

  @functools.cached_property
  def _update(self):
    return _cached(
      _update_program, self.tx, self.micro_batches, self.clip_global_norm, self.in_place
    )

  def accumulate(self, state: StreamedTrainState, batches: Sequence[Any]) -> tuple[Any, tuple]:
    """The micro-steps of one optimizer step: ``(loss, sums)``, the last micro-batch's loss and
    the gradients' sums over ``batches`` (``micro_batches`` of them) as
    :func:`~jax_ssdtrain.value_and_grad_streamed` returns them ``(embed, stack, head)``."""
    batches = list(batches)
    if len(batches) != self.micro_batches:
      raise ValueError(
        f"batches: {len(batches)} given, micro_batches={self.micro_batches}: give one batch per "
        "micro-step"
      )
    (ep, hp), sums = state.side, None
    for batch in batches:
      loss, sums = self._micro(ep, state.stack, hp, batch, sums)
      if self.collect:  # the old sum's entries go now, not at the daemon's next sweep
        config.collect()
    return loss, sums

  def update(self, state: StreamedTrainState, sums: tuple) -> tuple[StreamedTrainState, Any]:
    """The update of :meth:`accumulate`'s sums (their mean over ``micro_batches``, clipped where
    ``clip_global_norm`` says): ``(new state, grad_norm)``, the mean gradient's global norm
    before clipping (None without clipping). ``state`` is donated; the sums' entries leave the
    store once nothing holds them (:meth:`step` holds them no longer than the update)."""
    new, norm = self._update(state, sums)
    del state, sums
    if self.collect:  # the old parameters and state
      config.collect()
    return new, norm

  def step(
    self, state: StreamedTrainState, batches: Sequence[Any]
  ) -> tuple[StreamedTrainState, dict]:
    """One optimizer step over ``batches`` (``micro_batches`` of them): ``(new state,
    metrics)``, metrics ``loss`` (the last micro-batch's) and, with ``clip_global_norm``,
    ``grad_norm`` (the mean gradient's, before clipping). ``state`` is donated."""
    loss, sums = self.accumulate(state, batches)
    new, norm = self._update(state, sums)
    del state, sums
    if self.collect:  # the old parameters, state and sum
      config.collect()
    return new, {"loss": loss} | ({"grad_norm": norm} if self.clip_global_norm else {})

  # -- the store's sizing -----------------------------------------------------------------------

  def stack_shape(self) -> Any:
    """The stack's structure where it lives (``jax.eval_shape`` of its init: nothing made)."""
    return jax.eval_shape(self._init_stack, jax.random.key(0))

  def _sizing(self) -> dict:
    return dict(
      sum_dtype=jnp.dtype(self.sum_dtype),
      in_place=self.in_place,
      sum_location=self.sum_location,
      state_location=self.state_location,
    )

  def check_room(self, name: str = "model") -> dict:
    """:func:`~jax_ssdtrain.check_streamed_room` of this run (nothing stored yet): raises
    :class:`~jax_ssdtrain.StreamedRoomError` with the arithmetic where the model does not fit
    the store."""
    return check_streamed_room(self.stack_shape(), self.tx, name=name, **self._sizing())

  def read_ahead(self) -> dict:
    """:func:`~jax_ssdtrain.read_ahead_sizes` of this run: the store's read-ahead budget and
    staging arena that read its passes whole layers ahead (nothing made)."""
    return read_ahead_sizes(self.stack_shape(), self.tx, **self._sizing())

  def configure_read_ahead(self) -> dict:
    """Configures the store with :meth:`read_ahead`'s sizes where the environment does not set
    them (:meth:`read_ahead_variables`); call it before anything is stored (reconfiguring drops
    the store's entries). Returns the sizes it set."""
    sized = _read_ahead_variables()
    sizes = {option: v for option, v in self.read_ahead().items() if v and option in sized}
    if sizes:
      config.configure(**sizes)
    return sizes

  @staticmethod
  def read_ahead_variables() -> dict[str, str]:
    """The read-ahead options :meth:`configure_read_ahead` sizes, each with the ``SSDTRAIN_*``
    variable that sets it instead: ``{"prefetch_bytes": "SSDTRAIN_PREFETCH", "staging_bytes":
    "SSDTRAIN_STAGING"}``, less those the environment sets."""
    return _read_ahead_variables()

  # -- placement --------------------------------------------------------------------------------

  def placed(self, locations: Mapping[str, str] | Placement) -> StreamedTrainer:
    """This trainer with each class where ``locations`` says (a
    :class:`~jax_ssdtrain.Placement`, or its ``locations``: ``params``, ``grad_sum``,
    ``optimizer_state`` and, where given, ``activations``: the saved layer inputs)."""
    if isinstance(locations, (Placement, StackPlacement)):  # StackPlacement: deprecated
      locations = locations.locations
    missing = sorted({"params", "grad_sum", "optimizer_state"} - set(locations))
    if missing:
      raise ValueError(
        f"locations: no {', '.join(missing)} in {dict(locations)!r}: give every class's "
        "location (Placement.locations)"
      )
    return dataclasses.replace(
      self,
      location=locations["params"],
      sum_location=locations["grad_sum"],
      state_location=locations["optimizer_state"],
      save_inputs=locations.get("activations", self.save_inputs),
    )

  def activation_bytes(self, batch: Any) -> int:
    """The bytes of the layer inputs one micro-step saves for the backward pass
    (``save_inputs``): the embedding's output for every layer but the last (nothing made)."""
    side = jax.eval_shape(self.init_side, jax.random.key(0), batch)
    x = jax.eval_shape(self.embed_fn, side[0], batch)
    return (self.num_layers - 1) * x.size * x.dtype.itemsize

  def device_bytes(self, batch: Any) -> int:
    """The device memory of this run where it places its classes, from XLA's memory analysis
    of its compiled programs (nothing run or stored): the state and the sums resident beside a
    micro-step's temporaries, or the update's whole program, whichever is larger."""
    state = jax.eval_shape(lambda b: self.init(jax.random.key(0), b), batch)
    (ep, hp), stack = state.side, state.stack
    sums = jax.eval_shape(self._micro, ep, stack, hp, batch, None)[1]
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state, sums)))
    micro = self._micro.lower(ep, stack, hp, batch, sums).compile().memory_analysis()
    update = self._update.lower(state, sums).compile().memory_analysis()
    micro_need = nbytes + micro.temp_size_in_bytes
    update_need = (
      update.argument_size_in_bytes
      + update.output_size_in_bytes
      + update.temp_size_in_bytes
      - update.alias_size_in_bytes
    )
    return int(max(micro_need, update_need))

  def choose_placement(
    self, batch: Any, memory_budget: int | None = None, *, name: str = "model", device: Any = None
  ) -> Placement:
    """Each class's location under ``memory_budget`` (None: the device's memory), by
    :func:`~jax_ssdtrain.choose_placement`: on the device as far as this trainer's compiled
    step fits (its programs' memory analysis, :meth:`device_bytes`, plus on a GPU the staging
    arena it reads ahead with), the rest in the fastest tiers of the store that hold it; the
    saved layer inputs placed too. ``batch``: one micro-batch (or its ``jax.ShapeDtypeStruct``).
    Use the result with :meth:`placed`. Raises :class:`~jax_ssdtrain.StreamedRoomError` where no
    placement fits."""
    here = dataclasses.replace(self, location="device", sum_location=None, state_location=None)
    on_gpu = jax.default_backend() == "gpu"  # where the staging arena takes device memory
    sized = _read_ahead_variables()

    def step_bytes(locations):  # XLA's, plus the staging arena the placement reads ahead with
      placed = here.placed(locations)
      if "staging_bytes" in sized:
        staging = placed.read_ahead()["staging_bytes"]
      else:
        staging = config.stats()["staging_bytes"]  # the arena in force ("auto": its choice so far)
      return placed.device_bytes(batch) + (staging if on_gpu else 0)

    return choose_placement(
      step_bytes,
      memory_budget,
      stack=here.stack_shape(),
      tx=self.tx,
      sum_dtype=jnp.dtype(self.sum_dtype),
      in_place=self.in_place,
      activation_bytes=here.activation_bytes(batch),
      device=device,
      name=name,
    )

  # -- checkpoints ------------------------------------------------------------------------------

  def save(self, manager: Any, step: int, state: StreamedTrainState) -> None:
    """Saves ``state`` and ``step`` as step ``step`` of ``manager`` (an Orbax
    ``CheckpointManager``) through :mod:`jax_ssdtrain.checkpointing`: the stacks in the store
    layer by layer, the rest with Orbax's ``StandardSave``; waits until it is written."""
    import jax_ssdtrain.checkpointing as checkpointing  # needs orbax (optional)

    tree = {"state": _as_dict(state), "step": np.asarray(step, np.int64)}
    manager.save(step, args=checkpointing.save_args(tree))
    manager.wait_until_finished()

  def restore(self, manager: Any, like: StreamedTrainState) -> tuple[StreamedTrainState, int]:
    """The latest checkpoint of ``manager`` that :meth:`save` wrote, restored into the
    structure and locations of ``like`` (a state of this trainer): ``(state, step)``. Raises
    FileNotFoundError where ``manager`` holds none. ``like``'s entries leave the store at the
    next :func:`~jax_ssdtrain.collect` once nothing holds it."""
    import jax_ssdtrain.checkpointing as checkpointing  # needs orbax (optional)

    if not manager.latest_step():
      raise FileNotFoundError(
        f"no checkpoint in {manager.directory}: save one first (StreamedTrainer.save)"
      )
    tree = {"state": _as_dict(like), "step": np.zeros((), np.int64)}
    restored = checkpointing.restore(manager, tree)
    return StreamedTrainState(**restored["state"]), int(restored["step"])


def _as_dict(state: StreamedTrainState) -> dict:
  if not isinstance(state, StreamedTrainState):
    raise TypeError(f"state: expected a StreamedTrainState, got {type(state).__name__}")
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
