"""Optimizer state in the store: ``offload_optimizer(tx)`` wraps an optax transformation.

The wrapped transformation's state is a :class:`OffloadedState`: the large leaves of ``tx``'s
state live in the store (host tier, files, or the host tier spilling to the files), cut into
chunks of rows, and the device holds one handle (uint32[2]) per chunk; small leaves (step
counts, scalars) stay on the device.

How ``update`` computes what ``tx`` computes. ``tx.update`` is traced once, as it is, on the
whole trees, and its equations are split, not rewritten (nested jit calls are expanded, each
call with its own variables):

* *device part*: every equation that reads no stored leaf (a global norm of the gradients, a
  schedule, the step count) runs first, on the device, exactly as ``tx`` would run it;
* *groups*: the other equations, partitioned by the stored leaves they read (union-find: an
  equation that reads two stored leaves joins their groups; Adam's ``mu`` and ``nu`` of one
  parameter form one group). Each group runs on its own, one after the other, loading its
  leaves and storing the new ones.

A group whose equations are all elementwise over one shape runs chunk by chunk, as a
``lax.scan`` (rows ``[r0, r1)`` of every operand of that shape; scalars as they are):
elementwise operations give the same bits on a slice as on the whole, though XLA may fuse and
rewrite the streamed program differently from ``tx``'s own (a few ulps). The same program with
the state on the device, ``location="device"``, agrees bit for bit: there each load and store is
a copy XLA cannot see through (``primitives.opaque_copy``), and in both the values a group reads
and its results cross one, so that the group's arithmetic is a region bounded by custom calls
that XLA compiles alike. Any other group runs whole (its leaves loaded at once): one parameter's
leaves of several shapes (sm3, galore). One that reads the state of several parameters together
is split where a ``lax.cond`` decided before any stored state is read joins them (both branches
run and ``select_n`` picks, see ``_Program.inline``), and otherwise refused, naming the
transformation and the operation. Chunks are pipelined: the loads of chunk ``k`` wait for the
stores of chunk ``k - 2`` (an optimization barrier), so at most three chunks' state is on the
device at once; on the CPU a chunk's loads are chained in the group's order through copies of
their handles (XLA:CPU runs independent custom calls in any order).
The state's loads read their handles (``exact``): their entries come from an earlier step.

Sharded state (FSDP). When ``init`` gets parameters placed with NamedShardings on a mesh of
several devices, each stored leaf takes the PartitionSpec of the parameter it mirrors (its path
ends with the parameter's; replicated where none matches) and every device streams its own block
of it: the groups run in one ``shard_map`` over the mesh, each device loading and storing its
blocks' chunks through its own engine, and the handles are ``uint32[devices, chunks, 2]`` with one
row per device. The device part (a global norm) stays in the partitioned program. A group that
is not elementwise (a norm of one whole leaf, as LAMB's trust ratio) would see only a block and
is refused.

The new version of each chunk is written beside the old one: the old entries are released by the
store's sweeps once no live array holds their handles (lifetimes.py), so a failed step leaves
the state it started from intact. The store then holds two versions at the update. With
``in_place=True`` it holds one: each chunk's load is its entry's last (``consume``), the engine
releases the entry once the chunk is on the device, and the new chunk's store takes its room. A
failed update then leaves a state that is part old, part new, and gone: its next use raises
(the entries are released), and training resumes from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.location import TIER_CODES, TIER_NAMES, Location
from jax_ssdtrain._src.primitives import load_p, opaque_copy, store_p

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_MIN_BYTES = 1 << 20
PIPELINE_DEPTH = 2  # the loads of chunk k wait for the stores of chunk k - PIPELINE_DEPTH
PIECES_AHEAD = 3  # stream_in: pieces asked of `read` before the one it stores
# location="device": the same streamed program with each stored leaf kept whole on the device
# (the reference that the store's round trip must match bit for bit).
DEVICE_TIER = -1


class OptimizerOffloadError(ValueError):
  """A transformation or a state that the optimizer store cannot take (the message says why)."""


# ---------------------------------------------------------------------------------------------
# Public API


def offload_optimizer(
  tx: Any,
  *,
  location: str | Location = "host",
  min_bytes: int = DEFAULT_MIN_BYTES,
  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
  in_place: bool = False,
  param_shardings: Callable[[Any], Any] | None = None,
):
  """Wraps an optax transformation so that its state lives in the store.

  Args:
    tx: an optax ``GradientTransformation`` (chains, ``masked``, schedules,
      ``clip_by_global_norm``, ...), or anything with optax's ``init``/``update``.
      For gradient accumulation wrap the result: ``accumulate_gradients(offload_optimizer(tx),
      k)`` streams the state once per ``k`` micro-batches (``optax.MultiSteps`` around it
      streams it at every micro-batch).
    location: ``"host"`` (pinned host memory), ``"nvme"`` (the store files) or ``"host,nvme"``
      (the host tier while it has room, then the files); ``"auto"``: chosen by ``init`` from the
      state's size and the store's (see :func:`choose_location`); ``"device"`` runs the same
      streamed program with the state on the device (a reference: the store's results equal it
      bit for bit).
    min_bytes: state leaves smaller than this stay on the device (scalars always do: a step
      count is read by every parameter's update).
    chunk_bytes: rows of a leaf streamed at once (a leaf is cut along its first axis).
    in_place: the update reads each chunk of the state for the last time and writes the new
      chunk into its room, so the store holds one version of the state instead of two (half
      the host memory or disk: what lets the largest models fit). The state an update was given
      is then gone (donate it to the jitted step; using it again raises), and an update that
      fails part way (a write error, say) leaves no consistent state: resume from a checkpoint.
      Default ``False``: the new version is written beside the old, and a failed update leaves
      the old one intact.
    param_shardings: for ``init`` under ``jit``, whose parameters (tracers) carry no sharding:
      a function of ``init``'s argument (as given, ``nnx.Param`` variables included) returning
      the parameters' NamedShardings (the tree of ``init``'s parameters, or None for
      none): the state is then sharded as for parameters placed so (see the module doc).
      Default: the parameters' own shardings.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` runs ``tx``'s operations (its
    results are those of ``location="device"`` bit for bit, and within a few ulps of ``tx`` on
    the device, see the module doc), and whose state is an :class:`OffloadedState`.
  """
  import optax

  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")
  auto = location == "auto"
  expected = f"location: expected 'host', 'nvme', 'host,nvme', 'auto' or 'device', got {location!r}"
  try:
    loc = Location.HOST if auto else Location.parse(location, what="location")
  except ValueError:
    raise ValueError(expected) from None
  if not loc.in_store and loc is not Location.DEVICE:
    raise ValueError(expected)
  if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
    raise ValueError(f"min_bytes: expected an integer >= 0, got {min_bytes!r}")
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
    raise ValueError(f"chunk_bytes: expected an integer >= 4096, got {chunk_bytes!r}")
  if not isinstance(in_place, bool):
    raise ValueError(f"in_place: expected True or False, got {in_place!r}")
  multi = _multisteps(tx)
  if multi is not None:  # as optax.MultiSteps(offload_optimizer(inner), k): see _multisteps
    inner = offload_optimizer(
      multi._opt,
      location=location,
      min_bytes=min_bytes,
      chunk_bytes=chunk_bytes,
      in_place=in_place,
      param_shardings=param_shardings,
    )
    return optax.MultiSteps(
      inner,
      multi._every_k_schedule,
      use_grad_mean=multi._use_grad_mean,
      should_skip_update_fn=multi._should_skip_update_fn,
      accumulator_dtype=multi._accumulator_dtype,
    ).gradient_transformation()
  tier = DEVICE_TIER if loc is Location.DEVICE else TIER_CODES[loc]
  opts = _Options(tier=tier, min_bytes=min_bytes, chunk_bytes=chunk_bytes, in_place=in_place)
  name = _describe(tx)
  warned = []

  def init_fn(params):
    shardings = param_shardings(params) if param_shardings is not None else None
    params = _plain(params)
    shapes = jax.eval_shape(tx.init, params)
    layout = _make_layout(shapes, opts, name, params, shardings)
    if not layout.stores_anything and loc is not Location.DEVICE and not warned:
      warned.append(True)
      warnings.warn(_stores_nothing(layout, name, min_bytes), stacklevel=2)
    where = choose_location(_room_bytes(layout)) if auto else loc
    if where is not loc:
      layout = dataclasses.replace(layout, tier=TIER_CODES[where])
    _check_room(layout, where, name)
    # Under jit: a stored leaf is made and stored chunk by chunk, never whole next to the others.
    return jax.jit(lambda p: _stream(tx.init, (p,), layout, None, name)[1])(params)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, OffloadedState):
      raise TypeError(
        f"state: expected the OffloadedState that offload_optimizer(...).init made, got "
        f"{type(state).__name__}"
      )
    _check_made_for(tx, state, params if params is not None else updates, name)
    fn = lambda g, s, p: tx.update(g, s, p, **extra_args) if extra_args else tx.update(g, s, p)
    return _stream(fn, (updates, params), state.layout, state, name)

  def apply_fn(updates, state, params, **extra_args):  # apply_gradients' streamed form
    if not isinstance(state, OffloadedState):
      raise TypeError(
        f"opt_state: expected the OffloadedState that offload_optimizer(...).init made, got "
        f"{type(state).__name__}"
      )
    _check_made_for(tx, state, params, name)
    fn = lambda g, s, p: tx.update(g, s, p, **extra_args) if extra_args else tx.update(g, s, p)
    return _stream(fn, (updates, params), state.layout, state, name, apply=True)

  update_fn.apply_gradients = apply_fn
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _stores_nothing(layout: Layout, name: str, min_bytes: int) -> str:
  sized = [leaf for leaf in layout.leaves if _storable_dtype(leaf.dtype) and leaf.shape]
  largest = max(sized, key=lambda leaf: leaf.nbytes, default=None)
  biggest = (
    f"the largest is {largest.path}, {largest.nbytes} bytes"
    if largest
    else "its leaves are scalars"
  )
  return (
    f"{name} stores nothing: every leaf of its state is under min_bytes={min_bytes} ({biggest}), "
    "so the whole state stays on the device (state.location says 'device'); lower min_bytes "
    "(offload_optimizer(tx, min_bytes=...)) to stream it"
  )


def _plain(params: Any) -> Any:
  """``params`` with Flax NNX variables replaced by their values (``nnx.as_pure``):
  ``nnx.Optimizer`` hands ``init`` the ``nnx.Param`` variables and ``update`` plain arrays, and
  the state's structure must be the same for both. Other trees are returned as they are."""
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None)
  if variable is None:
    return params
  leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, variable))
  if not any(isinstance(x, variable) for x in leaves):
    return params
  return nnx.as_pure(params)


def _multisteps(tx: Any) -> Any:
  """The ``optax.MultiSteps`` that ``tx`` is (or whose ``gradient_transformation()`` it is), or
  None. ``offload_optimizer(MultiSteps(inner, k))`` is built as ``MultiSteps(offload_optimizer(
  inner), k)``: the same results and the same store traffic, the accumulator on the device
  (streaming MultiSteps' own update would store the accumulator and read the state of every
  parameter in one lax.cond). It reads MultiSteps' constructor arguments back from its private
  attributes (optax 0.2: ``_opt``, ``_every_k_schedule``, ``_use_grad_mean``,
  ``_should_skip_update_fn``, ``_accumulator_dtype``)."""
  import optax

  multi = tx if isinstance(tx, optax.MultiSteps) else getattr(tx.init, "__self__", None)
  if not isinstance(multi, optax.MultiSteps):
    return None
  needed = ("_opt", "_every_k_schedule", "_use_grad_mean", "_should_skip_update_fn")
  if not all(hasattr(multi, a) for a in needed + ("_accumulator_dtype",)):
    raise OptimizerOffloadError(
      "offload_optimizer(optax.MultiSteps(tx, k)): this optax's MultiSteps does not keep its "
      f"arguments as {needed}; wrap the other way round: optax.MultiSteps(offload_optimizer(tx), "
      "k), or jax_ssdtrain.accumulate_gradients(offload_optimizer(tx), k)"
    )
  return multi


def _check_made_for(tx: Any, state: OffloadedState, params: Any, name: str) -> None:
  """Raises OptimizerOffloadError unless ``state`` has the tree structure and leaf shapes that
  ``tx.init`` makes for ``params`` (a state of another optimizer, or of another model)."""
  want = jax.eval_shape(tx.init, params)
  layout = state.layout
  got_shapes = [leaf.shape for leaf in layout.leaves]
  want_leaves, want_def = jax.tree_util.tree_flatten(want)
  if want_def == layout.treedef and got_shapes == [tuple(x.shape) for x in want_leaves]:
    return

  def describe(paths_shapes):
    items = [f"{p}{list(sh)}" for p, sh in paths_shapes]
    return ", ".join(items[:6]) + (f", ... ({len(items)} leaves)" if len(items) > 6 else "")

  want_paths = [
    (jax.tree_util.keystr(p), tuple(x.shape))
    for p, x in jax.tree_util.tree_flatten_with_path(want)[0]
  ]
  raise OptimizerOffloadError(
    f"state: this OffloadedState was not made by {name} for these parameters: its layout has "
    f"{describe([(leaf.path, leaf.shape) for leaf in layout.leaves])}, where init would make "
    f"{describe(want_paths)}. Pass the state that this optimizer's init made (a state of "
    "another optimizer, or of another model?)"
  )


def apply_gradients(tx: Any, grads: Any, opt_state: Any, params: Any, **extra_args):
  """One optimizer step: ``tx.update`` and ``optax.apply_updates``; returns ``(new params, new
  opt_state)``.

  With a transformation made by :func:`offload_optimizer`, the updates of the streamed state are
  added to the parameters inside the stream, chunk by chunk, in place: no array of updates is
  ever whole on the device (4 bytes per float32 parameter less than ``update`` followed by
  ``optax.apply_updates``; donate the parameters to the jitted step, or XLA copies them once).
  The results equal the same call with ``location="device"`` bit for bit, and ``update`` +
  ``apply_updates`` to float32 rounding (XLA fuses the two programs differently: an ulp).
  ``accumulate_gradients(offload_optimizer(tx), k)`` does the same at its k-th micro-step. Any
  other transformation runs as ``update`` + ``apply_updates``.
  """
  import optax

  streamed = getattr(getattr(tx, "update", None), "apply_gradients", None)
  if streamed is not None:
    return streamed(grads, opt_state, params, **extra_args)
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state


def optimizer_state(state: OffloadedState) -> Any:
  """``tx``'s own state, every stored leaf loaded onto the device (for inspection, tests and
  small models: it needs the whole state's device memory). Checkpoints do not need it."""
  _check_state(state, "state")
  return jax.jit(_materialize)(state)


def state_to_host(state: OffloadedState) -> Any:
  """``tx``'s state as NumPy arrays in host memory, read from the store one chunk at a time (the
  device holds one chunk at once; sharded state: each device one chunk of its block). A
  checkpoint needs no whole copy: :mod:`jax_ssdtrain.checkpointing` writes chunk by chunk. See
  :func:`state_from_host`."""
  _check_state(state, "state")
  layout = state.layout
  out = [np.empty(leaf.shape, leaf.dtype) for leaf in layout.leaves]

  def put(i, leaf, index, value):
    out[i][index] = value

  stream_out(state, put)
  return layout.treedef.unflatten(out)


def state_from_host(tree: Any, like: OffloadedState) -> OffloadedState:
  """An :class:`OffloadedState` of ``like``'s layout holding ``tree`` (``tx``'s state, e.g. from a
  checkpoint), written to the store one chunk at a time. Raises OptimizerOffloadError when
  ``tree`` does not have ``like``'s structure, shapes and dtypes (a checkpoint of another
  layout)."""
  _check_state(like, "like")
  layout = like.layout
  values, treedef = jax.tree_util.tree_flatten(tree)
  if treedef != layout.treedef:
    raise OptimizerOffloadError(
      f"tree: the state has another structure than the optimizer's ({treedef} against "
      f"{layout.treedef}): a checkpoint of another optimizer or model?"
    )
  for leaf, value in zip(layout.leaves, values):
    check_leaf(leaf, tuple(np.shape(value)), np.dtype(value.dtype), "tree")
  return stream_in(like, lambda i, leaf, index: np.asarray(values[i])[index])


def check_leaf(leaf: LeafLayout, shape: tuple[int, ...], dtype: Any, what: str) -> None:
  """Raises OptimizerOffloadError unless a saved leaf of ``shape`` and ``dtype`` fits ``leaf``."""
  if shape != leaf.shape or np.dtype(dtype) != leaf.dtype:
    raise OptimizerOffloadError(
      f"{what}: state leaf {leaf.path} is {np.dtype(dtype).name}{list(shape)}, "
      f"the optimizer's is {leaf.dtype.name}{list(leaf.shape)}: a checkpoint of another layout?"
    )


def stream_out(state: OffloadedState, write: Callable[..., None]) -> None:
  """Reads ``tx``'s state out of ``state`` piece by piece: ``write(i, leaf, index, value)`` for
  each, with ``i`` the leaf's index in ``state.layout.leaves``, ``index`` the piece's place in
  the whole leaf (a tuple of slices; ``()`` for a whole leaf) and ``value`` a NumPy array. A
  stored leaf comes one chunk at a time (sharded state: each device's rows of that chunk of its
  block), read from the store onto the device and then into host memory; the rest whole."""
  _check_state(state, "state")
  layout = state.layout
  blocks = _device_blocks(layout, "reading the state out of the store")
  device, handles = iter(state.device), iter(state.handles)
  for i, leaf in enumerate(layout.leaves):
    if not leaf.stored:
      write(i, leaf, (), np.asarray(next(device)))
      continue
    hs = next(handles)
    if layout.tier == DEVICE_TIER:
      write(i, leaf, (), np.asarray(hs))
      continue
    for k, (r0, r1) in enumerate(leaf.bounds):
      load = _load_jit(leaf, r1 - r0, layout.tier, layout.mesh)
      chunk = np.asarray(load(hs, np.int32(k)) if blocks else load(hs[k]))
      if blocks:  # [devices, rows, ...]: each device's rows of its block
        for d, index in enumerate(blocks(leaf)):
          write(i, leaf, _rows_of(index, r0, r1), chunk[d])
      else:
        write(i, leaf, (slice(r0, r1),), chunk)


def stream_in(like: OffloadedState, read: Callable[..., Any]) -> OffloadedState:
  """An :class:`OffloadedState` of ``like``'s layout whose pieces are ``read(i, leaf, index)``
  (the pieces :func:`stream_out` writes): a NumPy array, or a future of one (anything with
  ``result()``, e.g. a tensorstore read), which is asked for :data:`PIECES_AHEAD` pieces before
  its chunk goes to the store, so that reads overlap (the host holds at most that many chunks
  and one more; sharded state: chunks of every device's block). The caller checks shapes and
  dtypes (:func:`check_leaf`)."""
  _check_state(like, "like")
  layout = like.layout
  blocks = _device_blocks(layout, "writing the state into the store")
  device, handles = [], []
  for i, leaf in enumerate(layout.leaves):
    if not leaf.stored:
      value = _resolved(read(i, leaf, ()))
      if layout.mesh is None:
        device.append(jnp.asarray(value))
      else:  # replicated over the mesh, as init makes them
        replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
        device.append(jax.device_put(value, replicated))
    elif layout.tier == DEVICE_TIER:
      sharding = None if not layout.mesh else jax.sharding.NamedSharding(layout.mesh, leaf.spec)
      handles.append(jax.device_put(_resolved(read(i, leaf, ())), sharding))
    elif blocks:  # chunk k of every device's block, one row per device
      index = blocks(leaf)
      rows = jax.sharding.NamedSharding(layout.mesh, _per_device(layout.mesh))
      store = _store_jit(leaf, layout.tier, layout.mesh)
      pieces = _ahead(
        lambda b, i=i, leaf=leaf, index=index: [
          read(i, leaf, _rows_of(ix, b[0], b[1])) for ix in index
        ],
        leaf.bounds,
      )
      hs = [store(jax.device_put(np.stack([_resolved(p) for p in ps]), rows)) for ps in pieces]
      handles.append(jnp.stack(hs, axis=1))
    else:
      store = _store_jit(leaf, layout.tier, None)
      pieces = _ahead(lambda b, i=i, leaf=leaf: read(i, leaf, (slice(b[0], b[1]),)), leaf.bounds)
      handles.append(jnp.stack([store(_resolved(p)) for p in pieces]))
  return OffloadedState(device, handles, layout)


def _ahead(fetch: Callable[[Any], Any], items: Sequence[Any]):
  """``fetch(item)`` for each item in order, each asked for :data:`PIECES_AHEAD` items before
  it is yielded."""
  pending = [fetch(x) for x in items[:PIECES_AHEAD]]
  for k in range(len(items)):
    if k + PIECES_AHEAD < len(items):
      pending.append(fetch(items[k + PIECES_AHEAD]))
    yield pending.pop(0)


def _resolved(piece: Any) -> np.ndarray:
  """A piece :func:`stream_in`'s ``read`` gave: the array, or its future's result."""
  return np.asarray(piece.result() if hasattr(piece, "result") else piece)


def _rows_of(index: tuple, r0: int, r1: int) -> tuple:
  """Rows ``r0:r1`` of the block at ``index`` (a device's slices of a leaf), as slices of the
  leaf."""
  first, rest = index[0], tuple(index[1:])
  start = first.start or 0
  return (slice(start + r0, start + r1),) + rest


def _per_device(mesh) -> Any:
  """Arrays with one row per device of ``mesh`` (in ``mesh.devices.flat`` order): handles."""
  return jax.sharding.PartitionSpec(tuple(mesh.axis_names))


def _device_blocks(layout: Layout, what: str):
  """For sharded state: ``blocks(leaf)``, the index of each device's block of ``leaf`` (in
  ``mesh.devices.flat`` order); None for state on one device."""
  mesh = layout.mesh
  if mesh is None or layout.tier == DEVICE_TIER:
    return None
  if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
    raise OptimizerOffloadError(
      f"{what}: the optimizer state is sharded over devices of several processes; each process "
      "can read only its own devices' blocks (save and restore per process)"
    )

  def blocks(leaf):
    where = jax.sharding.NamedSharding(mesh, leaf.spec).devices_indices_map(leaf.shape)
    return [where[d] for d in mesh.devices.flat]

  return blocks


@functools.cache
def _load_jit(leaf: LeafLayout, rows: int, tier: int, mesh: Any):
  """Reads a chunk of ``rows`` rows of ``leaf`` from the store: from its handle, or (sharded)
  from every device's handles and the chunk's index. One program per chunk shape, not per
  chunk (a leaf's chunks are alike but its last)."""
  shape = leaf.chunk_shape(0, rows)
  if mesh is None:
    return jax.jit(lambda h: _load(h, leaf, 0, tier, shape=shape))
  each = lambda hs, k: _load(hs[0, k], leaf, 0, tier, shape=shape)[None]  # noqa: E731
  spec = _per_device(mesh)
  replicated = jax.sharding.PartitionSpec()
  return jax.jit(
    jax.shard_map(each, mesh=mesh, in_specs=(spec, replicated), out_specs=spec, check_vma=False)
  )


@functools.cache
def _store_jit(leaf: LeafLayout, tier: int, mesh: Any):
  """Writes a chunk of ``leaf`` (sharded: one row per device) into the store; jit traces once
  per chunk shape."""
  if mesh is None:
    return jax.jit(lambda x: _store(x, leaf, 0, tier))
  each = lambda x: _store(x[0], leaf, 0, tier)[None]  # noqa: E731
  spec = _per_device(mesh)
  return jax.jit(jax.shard_map(each, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _materialize(state: OffloadedState) -> Any:
  layout = state.layout

  def whole(leaf, hs):  # a leaf, or on each device its block
    parts = [_load(hs[k], leaf, k, layout.tier) for k in range(len(leaf.bounds))]
    value = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    return value.reshape(leaf.block_shape)

  def load(leaf, hs):
    if layout.mesh is None:
      return whole(leaf, hs)
    return jax.shard_map(
      lambda h: whole(leaf, h[0]),
      mesh=layout.mesh,
      in_specs=_per_device(layout.mesh),
      out_specs=leaf.spec,
      check_vma=False,
    )(hs)

  return _tx_state(state, load)


def _tx_state(state: OffloadedState, read_stored) -> Any:
  """``tx``'s state tree from ``state``: the device leaves as they are, each stored leaf as
  ``read_stored(leaf layout, its handles)`` (with location="device": the leaf itself)."""
  layout, device, handles = state.layout, iter(state.device), iter(state.handles)
  leaves = []
  for leaf in layout.leaves:
    if not leaf.stored:
      leaves.append(next(device))
    elif layout.tier == DEVICE_TIER:
      leaves.append(next(handles))
    else:
      leaves.append(read_stored(leaf, next(handles)))
  return layout.treedef.unflatten(leaves)


def _check_state(state: Any, what: str) -> None:
  if not isinstance(state, OffloadedState):
    raise TypeError(f"{what}: expected an OffloadedState, got {type(state).__name__}")


def floating_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
  """``dtype`` as a dtype where it is a floating-point one (bfloat16 included), else a
  ValueError naming ``what`` and the value given (for anything ``jnp.dtype`` refuses too)."""
  try:
    out = jnp.dtype(dtype)
  except TypeError:
    out = None
  if out is None or not jnp.issubdtype(out, jnp.floating):
    raise ValueError(f"{what}: expected a floating-point dtype, got {dtype!r}")
  return out


@jax.tree_util.register_pytree_node_class
class OffloadedState:
  """The state of ``offload_optimizer(tx)``: ``tx``'s state with its large leaves in the store.

  Leaves (what jit, sharding and checkpoints see): ``device`` (the leaves kept on the device, in
  ``tx``'s leaf order) and ``handles`` (per stored leaf, uint32[chunks, 2]). The layout (``tx``'s
  tree structure, shapes, dtypes, chunking, store sites) is static data of the tree.
  """

  def __init__(self, device: Sequence[Any], handles: Sequence[Any], layout: Layout):
    self.device = tuple(device)
    self.handles = tuple(handles)
    self.layout = layout

  @property
  def location(self) -> str:
    """Where the stored leaves live: ``"host"``, ``"nvme"``, ``"host,nvme"`` or ``"device"``
    (``location="auto"`` says here what it chose)."""
    if self.layout.tier == DEVICE_TIER or not self.layout.stores_anything:
      return Location.DEVICE.value
    return TIER_NAMES[self.layout.tier]

  def tree_flatten(self):
    return (self.device, self.handles), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], children[1], layout)

  def __repr__(self):
    if not self.layout.stores_anything:
      return (
        f"OffloadedState({len(self.layout.leaves)} leaves, none in the store: all on the device)"
      )
    return (
      f"OffloadedState({len(self.layout.leaves)} leaves, {len(self.handles)} in the store "
      f"({self.location}{', updated in place' if self.layout.in_place else ''}), "
      f"{self.layout.stored_bytes} bytes)"
    )


def _describe(tx: Any) -> str:
  """A name for ``tx`` in messages: optax's factory (``adamw``, ``chain``) where it shows."""
  fn = getattr(tx, "init", None)
  qual = getattr(fn, "__qualname__", "") or type(tx).__name__
  factory = qual.split(".<locals>")[0] if ".<locals>" in qual else qual
  return f"the transformation {factory!r} (offload_optimizer's tx)"


# ---------------------------------------------------------------------------------------------
# Layout: which leaves are stored, and how they are cut


@dataclasses.dataclass(frozen=True)
class _Options:
  tier: int
  min_bytes: int
  chunk_bytes: int
  in_place: bool = False


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """One leaf of ``tx``'s state: its path, shape and dtype; for a stored leaf, its row chunks
  (``bounds``) and one store site per chunk."""

  path: str
  shape: tuple[int, ...]
  dtype: Any
  bounds: tuple[tuple[int, int], ...] = ()  # () for a leaf kept on the device
  site: int = -1  # the store site of every chunk (the engine checks a handle's site on load)
  # Sharded state (Layout.mesh set): the leaf's PartitionSpec and each device's block shape;
  # bounds cut that block (every device streams its own block, chunk by chunk).
  spec: Any = None
  local_shape: tuple[int, ...] | None = None
  # The parameter whose state this is (its index among the parameters' leaves: the longest
  # parameter path found inside the leaf's path, mu['w'] for params['w']); -1 for none.
  owner: int = -1

  @property
  def stored(self) -> bool:
    return bool(self.bounds)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

  @property
  def block_shape(self) -> tuple[int, ...]:
    """The shape one device streams: the leaf's, or its block where the state is sharded."""
    return self.shape if self.local_shape is None else self.local_shape

  @property
  def block_nbytes(self) -> int:
    """Bytes of one device's block of the leaf (``nbytes`` where the state is not sharded)."""
    return math.prod(self.block_shape) * np.dtype(self.dtype).itemsize

  def chunk_shape(self, r0: int, r1: int) -> tuple[int, ...]:
    shape = self.block_shape
    return (r1 - r0,) + shape[1:] if shape else ()


@dataclasses.dataclass(frozen=True)
class Layout:
  treedef: Any
  leaves: tuple[LeafLayout, ...]
  tier: int
  # A jax.sharding.Mesh where the state is sharded (from the params init saw); None: one device.
  mesh: Any = None
  in_place: bool = False  # updates consume the chunks they read (offload_optimizer's in_place)

  @property
  def stored_bytes(self) -> int:
    return sum(leaf.nbytes for leaf in self.leaves if leaf.stored)

  @property
  def stores_anything(self) -> bool:
    return any(leaf.stored for leaf in self.leaves)


def _row_bounds(shape: tuple[int, ...], chunk_bytes: int) -> tuple[tuple[int, int], ...]:
  if not shape or shape[0] == 0:
    return ((0, 0),)
  row = max(1, math.prod(shape[1:])) * 4  # by shape alone: leaves of one shape cut alike
  rows = max(1, chunk_bytes // row)
  return tuple((r, min(r + rows, shape[0])) for r in range(0, shape[0], rows))


def _make_layout(
  shapes: Any, opts: _Options, name: str, params: Any = None, shardings: Any = None
) -> Layout:
  """The layout of a state of ``shapes`` (``tx.init``'s, abstract): a function of its arguments
  alone, so that ``init`` is pure (``jax.eval_shape(tx.init, params)`` has the tree structure of
  ``tx.init(params)``). ``shardings``: the parameters' NamedShardings where they carry none
  (``param_shardings``)."""
  mesh, param_specs = _param_specs(params, name, shardings)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  param_paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  leaves = []
  for path, aval in flat:
    if not hasattr(aval, "shape"):
      raise OptimizerOffloadError(
        f"{name}: state leaf {jax.tree_util.keystr(path)} is {aval!r}, not an array"
      )
    shape = tuple(aval.shape)
    if not _storable_dtype(aval.dtype):  # a typed PRNG key, say: it stays on the device
      leaves.append(LeafLayout(jax.tree_util.keystr(path), shape, aval.dtype))
      continue
    owner = _owner_of(tuple(path), param_paths)
    leaf = LeafLayout(jax.tree_util.keystr(path), shape, np.dtype(aval.dtype), owner=owner)
    # A scalar is no bigger than a handle; a small leaf that mirrors no parameter (muon's
    # Newton-Schulz coefficients) is read by every parameter's update: both stay on the device.
    shared = owner == -1 and leaf.nbytes < opts.chunk_bytes
    if shape and not shared and leaf.nbytes >= max(opts.min_bytes, 1):
      if mesh is not None:
        spec = _spec_for(path, shape, param_specs)
        block = _block_shape(shape, spec, mesh, leaf.path, name)
        leaf = dataclasses.replace(leaf, spec=spec, local_shape=block)
      bounds = _row_bounds(leaf.block_shape, opts.chunk_bytes)
      leaf = dataclasses.replace(leaf, bounds=bounds)
      leaf = dataclasses.replace(leaf, site=_site_of(leaf, len(leaves)))
    leaves.append(leaf)
  return Layout(treedef, tuple(leaves), opts.tier, mesh, opts.in_place)


def _owner_of(path: tuple, param_paths: list[tuple]) -> int:
  """The index of the parameter whose path lies inside the state leaf's ``path`` (optax's state
  trees map the parameters' tree: ``mu['w']``, ``mu['w'][0]`` for params['w']); the longest such
  path wins, and -1 where there is none (a step count)."""
  best, found = 0, -1
  for j, p in enumerate(param_paths):
    if len(p) > best and any(path[k : k + len(p)] == p for k in range(len(path) - len(p) + 1)):
      best, found = len(p), j
  return found


def _storable_dtype(dtype: Any) -> bool:
  """A dtype the store holds as bytes: numbers and booleans, not JAX's extended dtypes (typed
  PRNG keys), whose bits are not their value."""
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _site_of(leaf: LeafLayout, index: int) -> int:
  """The store site of a stored leaf's chunks: derived from the leaf (its index, path, shape,
  dtype, chunking and block), never from a counter, so that two ``init`` calls of one optimizer
  on one model make equal layouts. Negative: activation sites count up from 1."""
  key = repr((index, leaf.path, leaf.shape, leaf.dtype.name, leaf.bounds, leaf.local_shape))
  digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
  return -2 - (int.from_bytes(digest, "little") >> 2)


def choose_location(room_bytes: int) -> Location:
  """``location="auto"``: where a state that needs ``room_bytes`` of the store (this process's
  share of what an update holds at once: two versions, the new written beside the old, or with
  ``in_place`` one and the chunks in flight) goes. The host tier is taken when that fits in
  three quarters of it (the rest is left to
  activations); else the host tier spilling to the files. The files alone never: the link
  carries the host tier's bytes an order of magnitude faster than a disk (45 GB/s each way
  against about 1 GB/s on the results' machine, docs/optimizer.md). A state that fits neither is
  refused by ``init``, naming the settings."""
  from jax_ssdtrain._src.config import ensure_configured

  if room_bytes <= ensure_configured().host_tier_bytes * 3 // 4:
    return Location.HOST
  return Location.HOST_NVME


def _local_devices(layout: Layout) -> int:
  """This process's devices that stream the state (each its own block where it is sharded)."""
  if layout.mesh is None:
    return 1
  return sum(d.process_index == jax.process_index() for d in layout.mesh.devices.flat)


def _version_bytes(layout: Layout) -> int:
  """Bytes of one version of the stored leaves that this process's devices hold."""
  return _local_devices(layout) * sum(leaf.block_nbytes for leaf in layout.leaves if leaf.stored)


def _room_bytes(layout: Layout) -> int:
  """Bytes of the store an update holds at once (this process's share): two versions (the one
  it reads and the one it writes beside it), or in place one version and the chunks in flight
  (every stored leaf of a shape, ``PIPELINE_DEPTH + 1`` chunks of each)."""
  version = _version_bytes(layout)
  if not layout.in_place:
    return 2 * version
  per_shape: dict[tuple[int, ...], int] = {}
  for leaf in layout.leaves:
    if leaf.stored:
      r0, r1 = leaf.bounds[0]
      chunk = math.prod(leaf.chunk_shape(r0, r1)) * np.dtype(leaf.dtype).itemsize
      per_shape[leaf.block_shape] = per_shape.get(leaf.block_shape, 0) + chunk
  in_flight = (PIPELINE_DEPTH + 1) * max(per_shape.values(), default=0)
  return version + _local_devices(layout) * in_flight


def _check_room(layout: Layout, loc: Location, name: str) -> None:
  """Refuses a state whose versions (the one an update reads and the one it writes beside it;
  with ``in_place`` one, and the chunks in flight) do not fit where it is to live: this
  process's host tier, its files, or both."""
  if layout.tier == DEVICE_TIER:
    return
  from jax_ssdtrain._src.config import ensure_configured

  version, need = _version_bytes(layout), _room_bytes(layout)
  cfg = ensure_configured()
  files = cfg.capacity_bytes  # None: the default, decided by the free space when the store opens
  if loc is not Location.HOST and files is None:
    return
  room = cfg.host_tier_bytes if loc is Location.HOST else files
  if loc is Location.HOST_NVME:
    room += cfg.host_tier_bytes
  if need > room:
    what = {
      Location.HOST: "host_tier_bytes",
      Location.NVME: "capacity_bytes",
      Location.HOST_NVME: "host_tier_bytes + capacity_bytes",
    }[loc]
    held = (
      f"an update holds it and the chunks in flight ({need} bytes, in_place=True)"
      if layout.in_place
      else f"an update writes the new version beside the old one ({need} bytes)"
    )
    raise OptimizerOffloadError(
      f"{name}: its state takes {version} bytes in the store, and {held}, more than "
      f"location={loc.value!r} holds ({what} = {room}): configure more (ssd.configure(...)), "
      + ("" if layout.in_place else "update in place (in_place=True: one version), ")
      + "or use location='host,nvme' (the host tier spilling to the files)"
    )


def _param_specs(params: Any, name: str, given: Any = None) -> tuple[Any, dict]:
  """``(mesh, {param path: (shape, PartitionSpec)})`` where ``params`` are arrays placed with
  NamedShardings on one mesh of several devices (or ``given``, a tree of their shardings);
  ``(None, {})`` on one device."""
  if params is None:
    return None, {}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if given is not None:
    shardings = jax.tree_util.tree_leaves(
      given, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
    )
    if len(shardings) != len(flat):
      raise OptimizerOffloadError(
        f"{name}: param_shardings gave {len(shardings)} shardings for {len(flat)} parameters"
      )
  else:
    shardings = [getattr(x, "sharding", None) for _, x in flat]
  if not any(isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1 for s in shardings):
    return None, {}
  meshes = {s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)}
  if len(meshes) > 1 or not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
    raise OptimizerOffloadError(
      f"{name}: to shard the optimizer state, place every parameter with a NamedSharding of one "
      f"mesh before init (found {sorted({type(s).__name__ for s in shardings})} over "
      f"{len(meshes)} mesh(es))"
    )
  (mesh,) = meshes
  return mesh, {tuple(p): (tuple(x.shape), s.spec) for (p, x), s in zip(flat, shardings)}


def _spec_for(path: tuple, shape: tuple[int, ...], param_specs: dict) -> Any:
  """The PartitionSpec of a state leaf: that of the parameter it mirrors (optax's state trees
  end with the parameters' paths: ``mu['w']`` for ``params['w']``) where the shapes agree;
  replicated otherwise (each device then streams the whole leaf, as it would hold it)."""
  for k in range(len(path)):
    found = param_specs.get(tuple(path[k:]))
    if found is not None and found[0] == shape:
      return found[1]
  return jax.sharding.PartitionSpec()


def _block_shape(shape, spec, mesh, path: str, name: str) -> tuple[int, ...]:
  block = list(shape)
  for d, axes in enumerate(tuple(spec)[: len(shape)]):
    if axes is None:
      continue
    n = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
    if shape[d] % n:
      raise OptimizerOffloadError(
        f"{name}: state leaf {path} of shape {list(shape)} is sharded {spec} over {n} devices "
        f"along axis {d}, which they do not divide evenly"
      )
    block[d] = shape[d] // n
  return tuple(block)


# ---------------------------------------------------------------------------------------------
# Streaming: the device part, then each group, chunk by chunk


def _stream(fn, args, layout: Layout, state: OffloadedState | None, name: str, apply=False):
  """Update (``state`` given): runs ``fn(updates, tx_state, params)`` with ``tx_state``'s stored
  leaves loaded and the new ones stored chunk by chunk; returns ``(updates, new state)``, with
  ``apply`` ``(new params, new state)``, the updates of the streamed groups added to the
  parameters chunk by chunk in place. Init (``state`` None): runs ``fn(params)`` and stores its
  stored leaves; returns ``(None, state)``."""
  leaves = layout.leaves
  stored_ids = [i for i, leaf in enumerate(leaves) if leaf.stored]
  if state is not None:
    updates, params = args
    state_avals = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]

    updates_tree = []  # the structure of the updates tx returns (lookahead's differs from g's)

    def traced(updates, state_leaves, params):
      new_updates, new_state = fn(updates, layout.treedef.unflatten(state_leaves), params)
      updates_tree.append(jax.tree_util.tree_structure(new_updates))
      new_leaves, treedef = jax.tree_util.tree_flatten(new_state)
      if treedef != layout.treedef:
        raise OptimizerOffloadError(
          f"{name}: update returned a state of another structure than init made "
          f"({treedef} against {layout.treedef})"
        )
      return jax.tree_util.tree_leaves(new_updates), new_leaves

    closed = jax.make_jaxpr(traced)(updates, state_avals, params)
    flat_updates = jax.tree_util.tree_leaves(updates)
    device_leaves = iter(state.device)
    state_values = [None if leaf.stored else next(device_leaves) for leaf in leaves]
    in_values = flat_updates + state_values + jax.tree_util.tree_leaves(params)
    first_state_in = len(flat_updates)
    n_updates = len(closed.jaxpr.outvars) - len(leaves)
  else:
    (params,) = args
    closed = jax.make_jaxpr(lambda p: jax.tree_util.tree_leaves(fn(p)))(params)
    in_values = jax.tree_util.tree_leaves(params)
    n_updates = 0

  expand: frozenset = frozenset()
  while True:  # each pass expands the conditions the last plan found decided on the device
    prog = _Program.inline(closed, expand)
    stored_in = {}
    if state is not None:
      stored_in = {prog.invars[first_state_in + i]: i for i in stored_ids}
    stored_out = {i: prog.outvars[n_updates + i] for i in stored_ids}
    plan = _plan(prog, stored_in, stored_out, leaves, name)
    if not isinstance(plan, frozenset):
      break
    expand |= plan  # the conditions to expand first
  applied = set()
  if apply:
    first_param_in = first_state_in + len(leaves)
    applied = _mark_applied(plan, prog, prog.invars[first_param_in:], n_updates)

  env = dict(prog.consts)
  for v, x in zip(prog.invars, in_values):
    if x is not None:
      env[v] = x
  for eqn in plan.device_eqns:  # 1. what reads no stored leaf, as tx runs it
    _eval_eqn(eqn, env)

  handles_in = dict(zip(stored_ids, state.handles)) if state is not None else {}
  new_handles: dict[int, Any] = {}
  for group in plan.groups:  # a leaf the update leaves as it is: the same entries
    new_handles.update({i: handles_in[i] for i in group.passed})
  consume = layout.in_place and state is not None  # in place: each load is its entry's last
  run = functools.partial(_run_groups, plan, leaves, stored_out, layout.tier, consume=consume)
  if layout.mesh is None:  # 2. each group, chunk by chunk
    handles, group_outs = run(env, handles_in)
  else:  # 2. each device runs every group on its own blocks
    handles, group_outs = _on_each_device(run, plan, layout, env, handles_in, name)
  new_handles.update(handles)
  env.update(group_outs)

  outs = [
    None if k - n_updates in stored_out else _read(env, v) for k, v in enumerate(prog.outvars)
  ]
  device_state = [outs[n_updates + i] for i, leaf in enumerate(leaves) if not leaf.stored]
  new_state = OffloadedState(device_state, [new_handles[i] for i in stored_ids], layout)
  if state is None:
    return None, new_state
  if apply:  # the parameters: updated in place where applied, else as optax.apply_updates
    new_params = [
      outs[k] if v in applied else jnp.asarray(p + outs[k]).astype(p.dtype)
      for k, (v, p) in enumerate(zip(prog.outvars[:n_updates], jax.tree_util.tree_leaves(params)))
    ]
    return jax.tree_util.tree_structure(params).unflatten(new_params), new_state
  new_updates = updates_tree[0].unflatten(outs[:n_updates])
  return new_updates, new_state


def _mark_applied(plan: _Plan, prog: _Program, param_vars: list, n_updates: int) -> set:
  """For ``apply_gradients``: each update that a chunked group computes for a parameter that no
  other group reads is added to that parameter inside the group, chunk by chunk, in place (no
  whole array of updates on the device). Returns the update vars so applied."""
  readers: dict[Any, int] = {}
  for group in plan.groups:
    for v in set(group.reads):
      readers[v] = readers.get(v, 0) + 1
  returned = [v for v in prog.outvars if _is_var(v)]
  applied = set()
  for u, p in zip(prog.outvars[:n_updates], param_vars):
    if not _is_var(u) or returned.count(u) != 1 or tuple(u.aval.shape) != tuple(p.aval.shape):
      continue
    group = next((g for g in plan.groups if u in g.outputs), None)
    if group is None or not group.chunked or readers.get(p, 0) > (p in group.reads):
      continue
    group.applied[u] = p
    if p not in group.reads:
      group.reads.append(p)
    applied.add(u)
  return applied


def _on_each_device(run, plan: _Plan, layout: Layout, env: dict, handles_in: dict, name: str):
  """Sharded state: one ``shard_map`` over the layout's mesh runs ``run`` (every group) on each
  device's blocks: its own handles, its block of each state leaf and of the gradients and
  parameters of the same shape (resharded by XLA where they come sharded otherwise); scalars
  (a learning rate, a clipping factor of the device part) replicated."""
  P = jax.sharding.PartitionSpec
  leaves, on_device = layout.leaves, layout.tier == DEVICE_TIER
  per_device = _per_device(layout.mesh)  # handles: [devices, chunks, 2], one row each
  read_specs: dict[Any, Any] = {}
  out_specs: dict[Any, Any] = {}
  for group in plan.groups:
    members = sorted(set(group.stores) | {i for _, i in group.loads})
    if not members:
      continue
    specs = {leaves[i].spec for i in members}
    if not group.chunked or len(specs) > 1:
      paths = ", ".join(leaves[i].path for i in members[:6])
      raise OptimizerOffloadError(
        f"{name} cannot stream sharded state: its update of {paths} "
        + (
          "is not elementwise (a norm or a reshape of one parameter's state needs the whole "
          "leaf, and each device holds a block of it)"
          if not group.chunked
          else f"reads leaves sharded differently ({sorted(map(str, specs))})"
        )
        + "; keep that state on the devices, or place the parameters unsharded before init"
      )
    (spec,) = specs
    for v in group.reads:
      want = P() if tuple(v.aval.shape) == () else spec
      if read_specs.setdefault(v, want) != want:
        raise OptimizerOffloadError(
          f"{name} cannot stream sharded state: a value of shape {list(v.aval.shape)} is read by "
          f"updates of state sharded {read_specs[v]} and {want}"
        )
    for v in group.outputs:
      out_specs[v] = P() if tuple(v.aval.shape) == () else spec
  reads, out_vars = list(read_specs), list(out_specs)
  loaded = sorted({i for g in plan.groups for _, i in g.loads})
  stored = sorted({i for g in plan.groups for i in g.stores})
  placed = lambda i: leaves[i].spec if on_device else per_device  # noqa: E731

  def body(read_values, hs):
    local_hs = {i: h if on_device else h[0] for i, h in zip(loaded, hs)}
    handles, outs = run(dict(zip(reads, read_values)), local_hs)
    new = [handles[i] if on_device else handles[i][None] for i in stored]
    return new, [outs[v] for v in out_vars]

  # check_vma off: the store's calls have no replication rule (their handles differ per device).
  each = jax.shard_map(
    body,
    mesh=layout.mesh,
    in_specs=([read_specs[v] for v in reads], [placed(i) for i in loaded]),
    out_specs=([placed(i) for i in stored], [out_specs[v] for v in out_vars]),
    check_vma=False,
  )
  new, outs = each([env[v] for v in reads], [handles_in[i] for i in loaded])
  return dict(zip(stored, new)), dict(zip(out_vars, outs))


def _run_groups(
  plan: _Plan, leaves, stored_out: dict, tier: int, env: dict, handles_in: dict, consume=False
):
  """Runs ``plan``'s groups one after the other; returns ``({stored leaf: new handles},
  {output var: value})``. ``env`` holds every value a group reads; ``consume``: each load is its
  entry's last (``in_place``)."""
  env = dict(env)
  new_handles: dict[int, Any] = {}
  outputs: dict[Any, Any] = {}
  last: list[Any] = []  # the newest store handles, which the next group's loads wait for
  for group in plan.groups:
    if not group.loads and not group.stores:
      continue
    hs_in = {i: handles_in[i] for _, i in group.loads}
    if last:  # this group's loads start once the last group's stores are under way
      hs_in, _ = jax.lax.optimization_barrier((hs_in, last))
    run = functools.partial(_run_chunk, group, leaves, env, stored_out, tier, consume=consume)
    if not group.chunked:
      handles, outs = run(None, hs_in, None)
      new_handles.update({i: h for i, h in handles.items()})
      outputs.update(outs)
      last = list(handles.values())
      continue
    # Uniform chunks in a scan (one copy of the group's operations, as in tx's own program, and
    # a program whose size does not grow with the state), the last, shorter one after it.
    rows = group.chunks[0][1] - group.chunks[0][0]
    full = sum(1 for r0, r1 in group.chunks if r1 - r0 == rows)
    stacked_h: dict[int, list[Any]] = {i: [] for i in group.stores}
    stacked_o: dict[Any, list[Any]] = {v: [] for v in group.outputs}
    zero = jnp.zeros((max(len(group.stores), 1), 2), jnp.uint32)
    on_device = tier == DEVICE_TIER

    # Parameters updated in place (apply_gradients) are carried whole, the others stacked.
    applied = group.applied
    carried = {p: env[p] for p in applied.values()}
    for v in applied:
      del stacked_o[v]

    def split(outs, applied=applied):
      return {p: outs[u] for u, p in applied.items()}, {
        v: o for v, o in outs.items() if v not in applied
      }

    # The scan's carry and outputs are lists in these orders (pytree dicts need sortable keys).
    params_order, outs_order = list(carried), list(stacked_o)

    def body(carry, c, run=run, rows=rows, hs_in=hs_in, split=split, order=params_order):
      before_last, newest, carried = carry
      carried = dict(zip(order, carried))
      handles, outs = run(c, hs_in, rows, wait=before_last, carried=carried)
      mine = jnp.stack(list(handles.values())) if handles and not on_device else zero
      carried, outs = split(outs)
      return (newest, mine, [carried[p] for p in order]), (handles, [outs[v] for v in outs_order])

    if full > 1:
      (_, newest, carried), (hs, os) = jax.lax.scan(
        body, (zero, zero, [carried[p] for p in params_order]), jnp.arange(full, dtype=jnp.int32)
      )
      carried = dict(zip(params_order, carried))
      for i, h in hs.items():
        stacked_h[i].append(h.reshape((full * rows,) + h.shape[2:]) if on_device else h)
      for v, o in zip(outs_order, os):
        stacked_o[v].append(o.reshape((full * rows,) + o.shape[2:]))
    else:  # one full chunk: no scan (its arithmetic is bounded by custom calls all the same)
      handles, outs = run(0, hs_in, rows, start=0, carried=carried)
      carried, outs = split(outs)
      for i, h in handles.items():
        stacked_h[i].append(h if on_device else h[None])
      stacked_o.update({v: [o] for v, o in outs.items()})
      newest = jnp.stack(list(handles.values())) if handles and not on_device else zero
    last = [newest]
    if full < len(group.chunks):  # the rest of the rows
      r0, r1 = group.chunks[full]
      handles, outs = run(full, hs_in, r1 - r0, wait=newest, start=r0, carried=carried)
      carried, outs = split(outs)
      for i, h in handles.items():
        stacked_h[i].append(h if on_device else h[None])
      for v, o in outs.items():
        stacked_o[v].append(o)
      last = list(handles.values())
    for i, parts in stacked_h.items():
      new_handles[i] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    for v, parts in stacked_o.items():
      outputs[v] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    outputs.update({u: carried[p] for u, p in applied.items()})
  return new_handles, outputs


def _run_chunk(
  group,
  leaves,
  env,
  stored_out,
  tier,
  c,
  hs_in,
  rows,
  wait=None,
  start=None,
  carried=None,
  consume=False,
):
  """One chunk of a group (``c``: its index, traced in the scan; ``rows``: its length), or the
  whole group (``rows`` None). Returns ``({stored leaf: handle(s)}, {output var: value})``; with
  ``group.applied``, the parameters (``carried``: the whole arrays, the chunk's rows read from
  and written back into them) are the values of their update vars."""
  carried = {} if carried is None else carried
  local: dict[Any, Any] = {} if rows is not None else dict(env)
  first = None if rows is None else start if start is not None else c * rows
  before = []  # the chunk's last load, which its next load waits for
  for v, i in group.loads:
    leaf, hs = leaves[i], hs_in[i]
    if tier == DEVICE_TIER:  # the same program with the state on the device: hs is the leaf
      if wait is not None:
        hs, _ = jax.lax.optimization_barrier((hs, wait))
      if rows is not None:  # a copy where the store has a load (see primitives.opaque_copy)
        local[v] = opaque_copy(jax.lax.dynamic_slice_in_dim(hs, first, rows))
      else:
        local[v] = _joined([opaque_copy(jax.lax.slice_in_dim(hs, *b)) for b in leaf.bounds])
      continue
    if rows is None:  # every chunk of the leaf, joined
      local[v] = _joined(
        [
          _load(hs[k], leaf, k, tier, consume=consume and i not in group.kept)
          for k in range(len(leaf.bounds))
        ]
      )
      continue
    h = hs[c]
    if wait is not None:  # the chunk before last has been stored: see PIPELINE_DEPTH
      h, _ = jax.lax.optimization_barrier((h, wait))
    # The chunk's loads run in the group's order, its stores' order (the engine reads ahead in
    # store order). XLA:CPU runs independent custom calls in any order: there each waits for
    # the one before it through a copy of its handle (a data dependency). A GPU runs them in
    # its stream's order, and a load reads its handle on the host: a handle made on the stream
    # after the previous load would hold the host until that load's data had crossed the link.
    if before and jax.default_backend() == "cpu":
      h = opaque_copy(h, *before, effect=False)
    shape = (rows,) + leaf.block_shape[1:]
    local[v] = _load(h, leaf, 0, tier, shape=shape, consume=consume and i not in group.kept)
    before = [local[v].reshape(-1)[:1]]  # one element of it: the load has run
  # The group's arithmetic is a region bounded by custom calls on every side, in every mode, so
  # that XLA compiles it alike whether its state comes from the store or from the device
  # (location="device") and the two agree bit for bit (an optimization barrier does not hold:
  # XLA:CPU removes it before fusing). Its state comes from loads (on the device: copies XLA
  # cannot see through, primitives.opaque_copy), the values it reads (gradients, parameters,
  # scalars of the device part) cross such a copy too, and so do its results below.
  used = {v for e in group.eqns for v in e.invars if _is_var(v)}
  for v in group.reads:
    x = carried[v] if v in carried else env[v]  # a parameter updated in place: its rows
    x = jax.lax.dynamic_slice_in_dim(x, first, rows) if rows and np.ndim(x) else x
    local[v] = opaque_copy(x) if v in used else x  # else only apply_gradients adds to it
  if rows is not None:
    shape = (rows,) + group.shape[1:]
  for eqn in group.eqns:
    _eval_eqn(eqn, local, shape if rows is not None else None)
  handles = {}
  for i in group.stores:
    leaf, value = leaves[i], _read(local, stored_out[i])
    if tier == DEVICE_TIER:  # a copy where the store has a store
      if rows is not None:
        handles[i] = opaque_copy(value)
      else:
        handles[i] = _joined(
          [
            opaque_copy(
              jax.lax.slice_in_dim(value, *b) if len(leaf.bounds) > 1 else value,
            )
            for b in leaf.bounds
          ]
        )
    elif rows is not None:
      handles[i] = _store(value, leaf, 0, tier)
    else:
      hs = [
        _store(jax.lax.slice_in_dim(value, *b) if len(leaf.bounds) > 1 else value, leaf, k, tier)
        for k, b in enumerate(leaf.bounds)
      ]
      handles[i] = jnp.stack(hs)
  outs = {v: opaque_copy(jnp.asarray(_read(local, v))) for v in group.outputs}
  for u, p in group.applied.items():  # as optax.apply_updates: (p + u) in p's dtype
    if rows is None:
      outs[u] = jnp.asarray(env[p] + outs[u]).astype(env[p].dtype)
    else:
      new = jnp.asarray(local[p] + outs[u]).astype(local[p].dtype)
      outs[u] = jax.lax.dynamic_update_slice_in_dim(carried[p], new, first, axis=0)
  return handles, outs


def _joined(parts: list[Any]) -> Any:
  """A leaf's chunks joined along its rows."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _load(handle, leaf: LeafLayout, k: int, tier: int, shape=None, consume=False):
  shape = leaf.chunk_shape(*leaf.bounds[k]) if shape is None else shape
  aval = jax.core.ShapedArray(shape, leaf.dtype)
  name = f"opt_state{leaf.path}"
  extra = {"consume": True} if consume else {}
  return load_p.bind(handle, aval=aval, site=leaf.site, tier=tier, name=name, exact=True, **extra)


def _store(x, leaf: LeafLayout, k: int, tier: int):
  name = f"opt_state{leaf.path}"
  return store_p.bind(x, site=leaf.site, tier=tier, name=name, uses=None)[1]


# ---------------------------------------------------------------------------------------------
# The program: tx's equations with nested calls expanded


@dataclasses.dataclass
class _Eqn:
  primitive: Any  # None: an alias (outvars[0] = invars[0])
  params: dict
  invars: list[Any]
  outvars: list[Any]
  origin: Any = None  # the traced equation this one comes from (its source, for messages)


@dataclasses.dataclass
class _Program:
  invars: list[Any]
  outvars: list[Any]
  eqns: list[_Eqn]
  consts: dict[Any, Any]

  @classmethod
  def inline(cls, closed, expand: frozenset = frozenset()) -> _Program:
    """``closed`` with nested jit calls (and custom-derivative calls: the update is not
    differentiated) expanded in place, so that the plan sees primitives. Each ``cond`` equation
    in ``expand`` (ids of traced equations) becomes its branches, each run, and a ``select_n``
    of their results by its index: the same values, for a condition the plan found decided
    before any stored state is read, whose branches would otherwise join the state of every
    parameter they touch into one group."""
    prog = cls(list(closed.jaxpr.invars), list(closed.jaxpr.outvars), [], {})
    prog.consts.update(zip(closed.jaxpr.constvars, closed.consts))
    prog._add(closed.jaxpr, {}, None, expand)
    return prog

  def _add(self, jaxpr, rename: dict, scoped: dict | None, expand: frozenset) -> None:
    """Appends ``jaxpr``'s equations. ``rename``: its inputs' outer values. ``scoped`` (None at
    the top level): this inlining's own variables, so that one body inlined twice (a cached
    trace called twice, e.g. a bias correction for each moment) keeps its values apart."""

    def key(v):
      if not _is_var(v) or isinstance(v, ji.DropVar):
        return v
      if v in rename:
        return rename[v]
      return v if scoped is None else scoped.setdefault(v, _Scoped(v))

    for eqn in jaxpr.eqns:
      inner = ji.called_jaxpr(eqn)
      if inner is not None:
        results = self._inline_body(inner, [key(v) for v in eqn.invars], expand)
        for out, res in zip(eqn.outvars, results):
          if not isinstance(out, ji.DropVar):
            self.eqns.append(_Eqn(None, {}, [res], [key(out)], eqn))
        continue
      if id(eqn) in expand:
        index, *operands = [key(v) for v in eqn.invars]
        results = [self._inline_body(b, operands, expand) for b in ji.cond_branches(eqn)]
        for k, out in enumerate(eqn.outvars):
          if not isinstance(out, ji.DropVar):
            cases = [r[k] for r in results]
            self.eqns.append(_Eqn(ji.select_n_p, {}, [index, *cases], [key(out)], eqn))
        continue
      self.eqns.append(
        _Eqn(
          eqn.primitive,
          eqn.params,
          [key(v) for v in eqn.invars],
          [key(v) for v in eqn.outvars],
          eqn,
        )
      )

  def _inline_body(self, closed, args: list[Any], expand: frozenset) -> list[Any]:
    """Appends ``closed``'s equations with its inputs bound to ``args`` (outer values), in a
    scope of its own; returns the values of its outputs."""
    body, scope = closed.jaxpr, {}
    rename = dict(zip(body.invars, args))
    for cv, c in zip(body.constvars, closed.consts):
      rename[cv] = scope.setdefault(cv, _Scoped(cv))
      self.consts[rename[cv]] = c
    self._add(body, rename, scope, expand)
    out = []
    for res in body.outvars:
      if _is_var(res):
        res = rename[res] if res in rename else scope.setdefault(res, _Scoped(res))
      out.append(res)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _Scoped:
  """A variable of one inlined call (compared by identity: one per variable and inlining)."""

  var: Any

  @property
  def aval(self):
    return self.var.aval


# ---------------------------------------------------------------------------------------------
# The plan: device equations, groups, chunking


@dataclasses.dataclass
class _Group:
  eqns: list[_Eqn]
  loads: list[tuple[Any, int]]  # (var, stored leaf): the stored inputs the group reads
  stores: list[int]  # stored leaves whose new value the group computes
  passed: list[int]  # stored leaves the update returns unchanged
  reads: list[Any]  # device-part vars (and inputs) the group reads
  outputs: list[Any]  # the group's results that stay on the device (updates, small leaves)
  shape: tuple[int, ...]
  chunked: bool
  chunks: tuple[tuple[int, int], ...]
  # apply_gradients: {update var: parameter var} whose sum the group writes into the parameter,
  # chunk by chunk in place (the value under the update var is then the new parameter)
  applied: dict = dataclasses.field(default_factory=dict)
  kept: frozenset = frozenset()  # loaded leaves the update returns unchanged (never consumed)


@dataclasses.dataclass
class _Plan:
  device_eqns: list[_Eqn]
  groups: list[_Group]


# Elementwise primitives: on rows [r0, r1) of every operand they give rows [r0, r1) of the result.
ELEMENTWISE = frozenset(
  """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy
  copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
  is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
  reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor""".split()
)


def _plan(
  prog: _Program, stored_in: dict, stored_out: dict, leaves, name: str
) -> _Plan | frozenset:
  """The device part and the groups of ``prog``; or the ids of the ``cond`` equations that join
  the state of several parameters and are decided before any stored state is read, which
  ``_Program.inline`` must expand first."""
  parent: dict[int, int] = {}

  def find(i):
    while parent.setdefault(i, i) != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  def union(ids):
    roots = sorted({find(i) for i in ids})
    for r in roots[1:]:
      parent[r] = roots[0]

  passed = {i for i, v in stored_out.items() if _is_var(v) and stored_in.get(v) == i}
  deps: dict[Any, frozenset[int]] = {v: frozenset({i}) for v, i in stored_in.items()}
  eqn_deps = []
  for eqn in prog.eqns:
    d = frozenset().union(*(deps.get(v, frozenset()) for v in eqn.invars if _is_var(v)))
    union(d)
    for v in eqn.outvars:
      if d:
        deps[v] = d
    eqn_deps.append(d)
  for i, v in stored_out.items():
    if i not in passed:
      union({i} | deps.get(v, frozenset()) if _is_var(v) else {i})

  # An elementwise equation that reads no stored leaf and feeds groups alone runs in them:
  # one on the chunk (0.1 * g in Adam's first moment) in the one group it feeds, a scalar one
  # (a bias correction 1 - b ** count) in each group that uses it. Then each group holds the
  # same chain of operations as tx's own program from its inputs on, and XLA can rewrite it as
  # it rewrites tx's (x / s into x * (1 / s), say): the results stay within ulps of tx's.
  owners: list[set[int]] = [{find(next(iter(d)))} if d else set() for d in eqn_deps]
  stored_eqn = [bool(d) for d in eqn_deps]
  consumers: dict[Any, set] = {}
  for k, eqn in enumerate(prog.eqns):
    for v in eqn.invars:
      if _is_var(v):
        consumers.setdefault(v, set()).add(k)
  outputs = {v for v in prog.outvars if _is_var(v)}
  for k in range(len(prog.eqns) - 1, -1, -1):
    eqn = prog.eqns[k]
    if stored_eqn[k] or not _pullable(eqn) or any(v in outputs for v in eqn.outvars):
      continue
    users = [owners[j] for v in eqn.outvars for j in consumers.get(v, ())]
    if not users or any(not u for u in users):  # the device part needs it too
      continue
    groups_using = set().union(*users)
    scalar = all(tuple(v.aval.shape) == () for v in eqn.outvars)
    if scalar or len(groups_using) == 1:  # a scalar is recomputed by each group that uses it
      owners[k] = groups_using
  device_eqns, by_root = [], {}
  for eqn, roots in zip(prog.eqns, owners):
    if not roots:
      device_eqns.append(eqn)
    for root in roots:
      by_root.setdefault(root, []).append(eqn)
  # Results that stay on the device: every output but the stored leaves' new values (a var that
  # is also returned elsewhere, e.g. as an update, stays too).
  stored_vars = {id(v) for v in stored_out.values()}
  device_out = [
    v
    for v in prog.outvars
    if _is_var(v) and (id(v) not in stored_vars or sum(o is v for o in prog.outvars) > 1)
  ]
  groups = []
  roots = sorted({find(i) for i in stored_out if i not in passed} | set(by_root))
  for root in roots:
    eqns = by_root.get(root, [])
    members = [i for i in stored_out if find(i) == root and i not in passed]
    members += [i for i in stored_in.values() if find(i) == root and i not in members]
    # A leaf the update returns unchanged is loaded where its group reads it (and kept: its
    # entries stay the state's), never stored again.
    read_vars = {v for e in eqns for v in e.invars if _is_var(v)}
    loads = [
      (v, i)
      for v, i in stored_in.items()
      if find(i) == root and (i not in passed or v in read_vars)
    ]
    defined = {v for e in eqns for v in e.outvars} | {v for v, _ in loads}
    reads = []
    for v in [v for e in eqns for v in e.invars] + [
      stored_out[i] for i in members if i in stored_out
    ]:
      if _is_var(v) and v not in defined and v not in reads:
        reads.append(v)
    shapes = {leaves[i].shape for i in members}
    owners = {leaves[i].owner for i in members} - {-1}
    if len(owners) > 1:  # the state of several parameters together: split it, or refuse
      conds = [
        e.origin
        for e in eqns
        if e.primitive is not None
        and e.primitive.name == ji.COND_PRIMITIVE
        and _is_var(e.invars[0])
        and not deps.get(e.invars[0])
      ]
      if conds:  # decided before any stored state is read: run both branches, select
        return frozenset(id(e) for e in conds)
      if len(shapes) > 1:
        raise _coupling_error(name, eqns, deps, leaves, sorted(members))
    shape = leaves[members[0]].shape if len(shapes) > 1 else next(iter(shapes))
    bounds = {leaves[i].bounds for i in members}
    # One parameter's leaves of several shapes (sm3's per-axis accumulators, adafactor's
    # factored moments, galore's projector) run whole, as one group.
    chunked = len(shapes) == 1 and len(bounds) == 1 and _elementwise(eqns, shape)
    chunks = next(iter(bounds)) if chunked else ((0, shape[0] if shape else 0),)
    outputs = [v for v in dict.fromkeys(device_out) if v in defined]
    stores = sorted(i for i in members if i in stored_out and i not in passed)
    block = leaves[members[0]].block_shape  # what one device streams (sharded state: its block)
    kept = frozenset(i for _, i in loads if i in passed)
    groups.append(
      _Group(eqns, loads, stores, [], reads, outputs, block, chunked, chunks, kept=kept)
    )
  if passed:
    groups.append(_Group([], [], [], sorted(passed), [], [], (), False, ()))
  return _Plan(device_eqns, groups)


def _coupling_error(name: str, eqns, deps: dict, leaves, members: list[int]):
  """The refusal of a group that reads the state of several parameters together: it names the
  first equation that does (its operation, the transformation and line that traced it) and the
  leaves it reads."""
  cause, read = None, ()
  for e in eqns:
    d = frozenset().union(*(deps.get(v, frozenset()) for v in e.invars if _is_var(v)))
    if len({leaves[i].owner for i in d} - {-1}) > 1:
      cause, read = e, sorted(d)
      break
  read = read or members
  paths = ", ".join(leaves[i].path for i in read[:6]) + (", ..." if len(read) > 6 else "")
  if cause is None:
    what, where = "its update", None
  else:
    what = f"its {cause.primitive.name if cause.primitive else 'copy'} operation"
    where = ji.equation_origin(cause.origin) if cause.origin is not None else None
  prim = cause.primitive.name if cause is not None and cause.primitive else ""
  scalar = cause is not None and all(
    tuple(getattr(v, "aval", v).shape) == () for v in cause.outvars
  )
  if scalar or prim.startswith("reduce") or prim in ("dot_general", "argmax", "argmin"):
    why = (
      "a number built from the stored state of every parameter (a norm, a sum or a dot product "
      "over the whole tree) that feeds every parameter's update: no parameter's state can be "
      "updated before all of it has been read"
    )
  elif prim in ("cond", "while", "switch", "scan"):
    why = (
      "a condition or a loop over the whole state whose outcome depends on the stored state "
      "itself: it cannot be decided one parameter at a time"
    )
  else:
    why = "they cannot be updated one parameter at a time"
  transformation = where.split(".<locals>")[0].split(" (")[0] if where else None
  inner = f"the transformation {transformation!r} ({where}) in " if transformation else ""
  return OptimizerOffloadError(
    f"{inner}{name} cannot be streamed: {what} reads the state of several parameters "
    f"together ({paths}): {why}. Keep this transformation's state on the device (apply it "
    "outside offload_optimizer, or raise min_bytes above its leaves), or for gradient "
    "accumulation wrap the streamed optimizer: optax.MultiSteps(offload_optimizer(tx), k) or "
    "jax_ssdtrain.accumulate_gradients(offload_optimizer(tx), k)."
  )


def _pullable(eqn: _Eqn) -> bool:
  """An elementwise equation (what a group may run on its chunk, or recompute if scalar)."""
  if eqn.primitive is None or not eqn.outvars:
    return eqn.primitive is None
  name = eqn.primitive.name
  return name in ELEMENTWISE or (name == "broadcast_in_dim" and eqn.invars[0].aval.shape == ())


def _elementwise(eqns: list[_Eqn], shape: tuple[int, ...]) -> bool:
  if not shape:
    return False
  for e in eqns:
    if e.primitive is None:
      pass
    elif e.primitive.name == "broadcast_in_dim":  # of a scalar only
      if tuple(e.invars[0].aval.shape) != ():
        return False
    elif e.primitive.name not in ELEMENTWISE:
      return False
    for v in list(e.invars) + list(e.outvars):
      if tuple(v.aval.shape) not in ((), shape):
        return False
  return True


def _is_var(v) -> bool:
  return not isinstance(v, ji.Literal)


def _read(env, v):
  return v.val if isinstance(v, ji.Literal) else env[v]


def _eval_eqn(eqn: _Eqn, env: dict, rows: tuple[int, ...] | None = None) -> None:
  invals = [_read(env, v) for v in eqn.invars]
  if eqn.primitive is None:
    outs = invals
  elif rows is not None and eqn.primitive.name == "broadcast_in_dim":
    outs = [jax.lax.broadcast_in_dim(invals[0], rows, ())]
  else:
    outs = ji.bind_equation(eqn.primitive, eqn.params, invals)
  for v, x in zip(eqn.outvars, outs):
    if not isinstance(v, ji.DropVar):
      env[v] = x
