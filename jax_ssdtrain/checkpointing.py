"""Orbax checkpoints of training state whose optimizer state is in the store.

An :class:`~jax_ssdtrain.OffloadedState` holds handles, which mean nothing to another process:
a checkpoint must hold ``tx``'s own state. This module writes it straight from the store into
the checkpoint, chunk by chunk (tensorstore arrays, one per state leaf; a few chunks written or
read at once), and restores it into the store the same way: neither the device nor host memory
ever holds the whole state, so a state larger than host memory (gpt-8b's 99 GB) can be saved.
The rest of the tree (the parameters, the step, state kept on the device) is Orbax's
``StandardSave``::

    import orbax.checkpoint as ocp
    from jax_ssdtrain import checkpointing

    manager = ocp.CheckpointManager(directory)
    manager.save(step, args=checkpointing.save_args(train_state))
    ...
    train_state = checkpointing.restore(manager, like=train_state)  # the latest step

Orbax writes a step into a temporary directory and makes it current only once every item is
complete: a save that fails or is interrupted leaves the last checkpoint as it was. A restore
checks the saved layout (structure, leaf shapes and dtypes) against ``like``'s and names the
first difference. ``OptimizerStateSave`` / ``OptimizerStateRestore`` are the Orbax arguments
of the optimizer state alone, for a ``Composite`` of one's own.

A :class:`~jax_ssdtrain.StreamedStack` in the store (a streamed stack's parameters, a
``StreamedOptState``'s per-layer state and master copy; anywhere in the tree) holds handles
too: it is written layer by layer into the item ``streamed_stacks`` (``StreamedStackSave`` /
``StreamedStackRestore``): per leaf one tensorstore array ``[L, *layer_shape]`` in the leaf's
dtype, each layer loaded from the store by a jitted load and written into its row, a few rows in
flight; a restore reads row by row and stores each layer where ``like``'s stack lives (a jitted
store per layer), so that neither memory holds more than a few layers. Its layout (kind, depth,
layer structure, leaf paths, shapes, dtypes) is checked against ``like``'s, naming the first
difference. One process only: a multi-process run is refused. A stack on the device is its
arrays, saved with the tree.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

try:
  import orbax.checkpoint as ocp
except ImportError as e:  # an optional dependency (the `demo` extra)
  raise ImportError(
    "jax_ssdtrain.checkpointing needs orbax-checkpoint: pip install orbax-checkpoint "
    "(or jax_ssdtrain[demo])"
  ) from e

from jax_ssdtrain._src.layer_stream import (
  StreamedStack,
  _Layout,
  _load_layer,
  _store_layer,
  new_pass,
)
from jax_ssdtrain._src.optimizer import (
  LeafLayout,
  OffloadedState,
  OptimizerOffloadError,
  check_leaf,
  spans_processes,
  stream_in,
  stream_out,
)
from jax_ssdtrain._src.optimizer.host_io import PIECES_AHEAD

__all__ = [
  "OptimizerStateHandler",
  "OptimizerStateRestore",
  "OptimizerStateSave",
  "StreamedStackHandler",
  "StreamedStackRestore",
  "StreamedStackSave",
  "restore",
  "restore_args",
  "save_args",
]

# Item names in a step's directory.
TREE_ITEM = "tree"
STATE_ITEM = "optimizer_state"
STACKS_ITEM = "streamed_stacks"  # only in a step whose tree holds a StreamedStack in the store
# Chunks a save writes at once (the restore reads optimizer.host_io.PIECES_AHEAD ahead): one chunk
# at a time left the disk idle while the next chunk came out of the store.
WRITES_IN_FLIGHT = 4


def save_args(tree: Any) -> ocp.args.Composite:
  """The Orbax arguments that save ``tree`` (a train state, or any pytree): every
  :class:`OffloadedState` in it streamed from the store (:class:`OptimizerStateSave`), every
  :class:`~jax_ssdtrain.StreamedStack` in the store (a streamed stack's parameters, or the
  ``per_layer`` part of a ``StreamedOptState``) layer by layer (:class:`StreamedStackSave`), the
  rest with ``StandardSave`` (items ``tree``, ``optimizer_state`` and, where the tree holds such
  a stack, ``streamed_stacks`` of the step)."""
  rest, states, stacks = _split(tree, "save_args")
  items = {TREE_ITEM: ocp.args.StandardSave(rest), STATE_ITEM: OptimizerStateSave(states)}
  if stacks:
    items[STACKS_ITEM] = StreamedStackSave(stacks)
  return ocp.args.Composite(**items)


def restore_args(like: Any) -> ocp.args.Composite:
  """The Orbax arguments that restore a checkpoint :func:`save_args` wrote into the structure
  of ``like`` (its OffloadedStates and StreamedStacks give the layouts and the store
  locations)."""
  rest, states, stacks = _split(like, "restore_args")
  items = {TREE_ITEM: ocp.args.StandardRestore(rest), STATE_ITEM: OptimizerStateRestore(states)}
  if stacks:
    items[STACKS_ITEM] = StreamedStackRestore(stacks)
  return ocp.args.Composite(**items)


def restore(manager: ocp.CheckpointManager, like: Any, step: int | None = None) -> Any:
  """Restores ``step`` (default: the latest) of ``manager`` into the structure of ``like``:
  ``like``'s own tree, each OffloadedState's leaves written into the store chunk by chunk, each
  StreamedStack's layer by layer."""
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {manager.directory}")
  try:
    restored = manager.restore(step, args=restore_args(like))
  except ValueError as e:
    if "single, unnamed" not in str(e):
      raise
    raise ValueError(
      f"step {step} of {manager.directory} holds one unnamed item (a plain Orbax save, as "
      "jax_ssdtrain's example trainer wrote before jax_ssdtrain.checkpointing), not what "
      "checkpointing.save_args writes: restore it with ocp.args.StandardRestore and put the "
      "optimizer state back with ssd.state_from_host"
    ) from e
  stacks = restored[STACKS_ITEM] if STACKS_ITEM in restored else []
  return _join(like, restored[TREE_ITEM], restored[STATE_ITEM], stacks)


@dataclasses.dataclass
class OptimizerStateSave(ocp.args.CheckpointArgs):
  """Saves ``states`` (OffloadedStates, in order) from the store, chunk by chunk."""

  states: Sequence[OffloadedState]


@dataclasses.dataclass
class OptimizerStateRestore(ocp.args.CheckpointArgs):
  """Restores the states an :class:`OptimizerStateSave` wrote into ``like``'s layouts (one
  OffloadedState each, in the same order); returns a list of OffloadedStates."""

  like: Sequence[OffloadedState]


class OptimizerStateHandler(ocp.CheckpointHandler):
  """Writes each OffloadedState's leaves into tensorstore arrays (``state<i>/leaf<j>``, zarr3,
  one zarr chunk per stored chunk) and its layout into ``layout.json``, written last."""

  def save(self, directory, args: OptimizerStateSave) -> None:
    states = list(args.states)
    for s in states:
      _check_offloaded(s, "OptimizerStateSave.states")
    # State sharded over several processes' devices: every process writes its own devices'
    # blocks into arrays the first process makes; else the first process writes it all.
    shared = any(spans_processes(s.layout) for s in states)
    primary = jax.process_index() == 0
    if not (shared or primary):
      return
    if primary:
      directory.mkdir(parents=True, exist_ok=True)
    if shared:
      if primary:
        for si, state in enumerate(states):
          for i, leaf in enumerate(state.layout.leaves):
            _open(directory, si, i, leaf, create=True, shared=True)
      multihost_utils.sync_global_devices(f"jax_ssdtrain.checkpointing made {directory}")
    for si, state in enumerate(states):
      arrays = {}
      with _Writes() as writes:  # up to WRITES_IN_FLIGHT chunks written at once

        def write(i, leaf, index, value, si=si, arrays=arrays, writes=writes):
          if shared and not leaf.stored and not primary and not index:
            return  # a leaf kept on the device, replicated: written once (else its blocks)
          if i not in arrays:
            arrays[i] = _open(directory, si, i, leaf, create=not shared)
          target = arrays[i][index] if index else arrays[i]
          writes.add([target.write(value)])

        stream_out(state, write)
    if shared:  # every process's blocks are written before the layout says the save is whole
      multihost_utils.sync_global_devices(f"jax_ssdtrain.checkpointing wrote {directory}")
    if primary:
      _write_layout(directory, states=[_describe(s) for s in states])

  def restore(self, directory, args: OptimizerStateRestore) -> list[OffloadedState]:
    like = list(args.like)
    for s in like:
      _check_offloaded(s, "OptimizerStateRestore.like")
    saved = self.metadata(directory)["states"]
    _check_saved(saved, like, "optimizer state", _check_layout)
    out = []
    for si, state in enumerate(like):
      arrays: dict[int, Any] = {}

      def read(i, leaf, index, si=si, arrays=arrays):
        if i not in arrays:
          arrays[i] = _open(directory, si, i, leaf, create=False)
        source = arrays[i][index] if index else arrays[i]
        return source.read()  # a future: stream_in reads ahead

      out.append(stream_in(state, read))
    return out

  def metadata(self, directory) -> dict:
    return _read_layout(directory, "optimizer state")


ocp.args.register_with_handler(OptimizerStateHandler, for_save=True)(OptimizerStateSave)
ocp.args.register_with_handler(OptimizerStateHandler, for_restore=True)(OptimizerStateRestore)


@dataclasses.dataclass
class StreamedStackSave(ocp.args.CheckpointArgs):
  """Saves ``stacks`` (StreamedStacks in the store, in order) layer by layer."""

  stacks: Sequence[StreamedStack]


@dataclasses.dataclass
class StreamedStackRestore(ocp.args.CheckpointArgs):
  """Restores the stacks a :class:`StreamedStackSave` wrote into ``like``'s layouts and store
  locations (one StreamedStack each, in the same order; their handles may be abstract);
  returns a list of StreamedStacks."""

  like: Sequence[StreamedStack]


class StreamedStackHandler(ocp.CheckpointHandler):
  """Writes each StreamedStack's leaves into tensorstore arrays (``stack<i>/leaf<j>``, zarr3,
  ``[L, *layer_shape]`` in the leaf's dtype, one zarr chunk per layer), one layer at a time out
  of the store, and its layout into ``layout.json``, written last. A restore reads a layer's
  rows and stores them where ``like`` lives: neither the device nor host memory holds more than
  a few layers. One process only."""

  def save(self, directory, args: StreamedStackSave) -> None:
    stacks = list(args.stacks)
    for s in stacks:
      _check_store_stack(s, "StreamedStackSave.stacks")
    _single_process(stacks, "save")
    directory.mkdir(parents=True, exist_ok=True)
    for si, stack in enumerate(stacks):
      lay = stack.layout
      arrays = [_open_stack(directory, si, j, lay, create=True) for j in range(len(lay.shapes))]
      with _Writes() as writes:  # up to WRITES_IN_FLIGHT layers written at once
        for i in range(lay.num_layers):
          leaves = jax.device_get(jax.tree.leaves(_layer_jit(stack, np.int32(i))))
          writes.add([a[i].write(x) for a, x in zip(arrays, leaves)])
    _write_layout(directory, stacks=[_describe_stack(s.layout) for s in stacks])

  def restore(self, directory, args: StreamedStackRestore) -> list[StreamedStack]:
    like = list(args.like)
    for s in like:
      _check_store_stack(s, "StreamedStackRestore.like")
    _single_process(like, "restore")
    saved = self.metadata(directory)["stacks"]
    _check_saved(saved, [s.layout for s in like], "StreamedStack", _check_stack_layout)
    out = []
    for si, stack in enumerate(like):
      lay = stack.layout
      arrays = [_open_stack(directory, si, j, lay, create=False) for j in range(len(lay.shapes))]
      reading = collections.deque()  # layers asked of tensorstore ahead of the one stored
      handles = []  # per layer, per leaf: uint32[2] (jax.Arrays: a sweep sees them held)
      for i in range(lay.num_layers + PIECES_AHEAD):
        if i < lay.num_layers:
          reading.append([a[i].read() for a in arrays])
        if len(reading) > PIECES_AHEAD or (i >= lay.num_layers and reading):
          layer = jax.tree.unflatten(lay.treedef, [r.result() for r in reading.popleft()])
          handles.append(_store_jit(lay, layer))
      leaves = [jnp.stack(hs) for hs in zip(*handles)]
      out.append(StreamedStack(jax.tree.unflatten(lay.treedef, leaves), lay))
    return out

  def metadata(self, directory) -> dict:
    return _read_layout(directory, "StreamedStack")


ocp.args.register_with_handler(StreamedStackHandler, for_save=True)(StreamedStackSave)
ocp.args.register_with_handler(StreamedStackHandler, for_restore=True)(StreamedStackRestore)


class _Writes:
  """A save's tensorstore writes in flight, at most WRITES_IN_FLIGHT pieces (each a list of
  write futures). Every write ends, or raises, before the ``with`` block is left: on an error
  the writes in flight end first and the first error is the one raised; without one, the
  caller writes layout.json after the block."""

  def __init__(self):
    self._pieces = collections.deque()

  def add(self, futures: list) -> None:
    self._pieces.append(futures)
    while len(self._pieces) > WRITES_IN_FLIGHT:
      for w in self._pieces.popleft():
        w.result()

  def __enter__(self) -> _Writes:
    return self

  def __exit__(self, kind, error, tb) -> None:
    if kind is not None:
      for futures in self._pieces:
        for w in futures:
          try:
            w.result()
          except Exception:  # noqa: BLE001 (the first error is the one raised)
            pass
      return
    while self._pieces:
      for w in self._pieces.popleft():
        w.result()


def _write_layout(directory, **entries: list) -> None:
  """A handler's ``layout.json``: its format and ``entries`` (a description per saved state or
  stack), written after every byte of the save, so that its presence says the save is whole."""
  layout = {"format": 1, **entries}
  (directory / "layout.json").write_text(json.dumps(layout, indent=1) + "\n")


def _read_layout(directory, what: str) -> dict:
  """The ``layout.json`` a handler's save writes last (``what``: its kind, for the message)."""
  path = directory / "layout.json"
  if not path.exists():
    raise FileNotFoundError(
      f"{path}: no {what} layout (not written by jax_ssdtrain.checkpointing, or a save that "
      "did not complete)"
    )
  return json.loads(path.read_text())


def _check_saved(saved: list, like: list, what: str, check) -> None:
  """The layouts a checkpoint holds (``saved``) against what a restore fills (``like``): as many,
  and each one ``like``'s (``check(entry, meta, index)`` raises where not); all of them checked
  before anything is written to the store. ``what``: their kind, for the message."""
  if len(saved) != len(like):
    raise OptimizerOffloadError(
      f"the checkpoint holds {len(saved)} {what}(s) in the store, the tree to restore into "
      f"{len(like)}: a checkpoint of another training setup?"
    )
  for si, (entry, meta) in enumerate(zip(like, saved)):
    check(entry, meta, si)


@jax.jit
def _layer_jit(stack: StreamedStack, i):
  """Layer ``i`` of a stack in the store, loaded (not consumed)."""
  return _load_layer(stack, i, new_pass())


@jax.jit(static_argnums=0)
def _store_jit(lay: _Layout, layer):
  """One layer stored where ``lay`` lives: per leaf a handle uint32[2]."""
  return _store_layer(lay, layer, new_pass())


def _is_offloaded(x) -> bool:
  return isinstance(x, OffloadedState)


def _check_offloaded(x, what: str) -> None:
  if not _is_offloaded(x):
    raise TypeError(f"{what}: expected OffloadedStates, got {type(x).__name__}")


def _is_store_stack(x) -> bool:
  return isinstance(x, StreamedStack) and not x.layout.on_device


def _is_streamed(x) -> bool:
  """Streamed into its own item: an OffloadedState, a StreamedStack in the store. A stack on
  the device is its arrays (StandardSave)."""
  return _is_offloaded(x) or _is_store_stack(x)


def _check_store_stack(x, what: str) -> None:
  if not _is_store_stack(x):
    raise TypeError(
      f"{what}: expected StreamedStacks in the store, got "
      + (repr(x) if isinstance(x, StreamedStack) else type(x).__name__)
    )


def _single_process(stacks: list, what: str) -> None:
  if stacks and jax.process_count() > 1:
    raise ValueError(
      f"{what}: {stacks[0]!r} in a run of {jax.process_count()} processes: "
      "jax_ssdtrain.checkpointing streams StreamedStacks in one process only. Save "
      "ssd.stack_to_tree(stack) in its place and restore with ssd.stack_from_tree, or "
      "checkpoint from a single-process run"
    )


def _split(tree: Any, what: str) -> tuple[Any, list[OffloadedState], list[StreamedStack]]:
  """``tree`` with a placeholder (a scalar leaf, saved with the tree) for each OffloadedState
  and each StreamedStack in the store, and those states and stacks in tree order."""
  found = [x for x in jax.tree.leaves(tree, is_leaf=_is_streamed) if _is_streamed(x)]
  states = [x for x in found if _is_offloaded(x)]
  stacks = [x for x in found if _is_store_stack(x)]
  _single_process(stacks, what)
  rest = jax.tree.map(
    lambda x: _placeholder() if _is_streamed(x) else x, tree, is_leaf=_is_streamed
  )
  return rest, states, stacks


def _placeholder():
  return np.zeros((), np.int8)


def _join(like: Any, rest: Any, states: list[OffloadedState], stacks: list[StreamedStack]) -> Any:
  """``rest`` (``like`` with a placeholder for each OffloadedState and StreamedStack in the
  store) with the restored states and stacks in their places."""
  leaves, treedef = jax.tree_util.tree_flatten(like, is_leaf=_is_streamed)
  restored = jax.tree_util.tree_leaves(rest)
  its, itk = iter(states), iter(stacks)
  return treedef.unflatten(
    [
      next(its) if _is_offloaded(x) else next(itk) if _is_store_stack(x) else r
      for x, r in zip(leaves, restored, strict=True)
    ]
  )


def _open(directory, si: int, i: int, leaf: LeafLayout, *, create: bool, shared: bool = False):
  import tensorstore as ts  # orbax-checkpoint's own dependency (optional, as orbax is)

  spec = {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": str(directory / f"state{si}/leaf{i}")},
  }
  if not create:
    return ts.open(spec, open=True).result()
  chunk = leaf.shape  # a leaf kept on the device: one zarr chunk
  if leaf.stored:  # one zarr chunk per stored chunk (sharded: of a device's block)
    r0, r1 = leaf.bounds[0]
    rows = r1 - r0
    if shared:  # written by several processes: no zarr chunk across two devices' blocks
      rows = math.gcd(rows, leaf.block_shape[0])
    chunk = (rows,) + tuple(leaf.block_shape[1:])
  return ts.open(
    spec,
    create=True,
    dtype=ts.dtype(np.dtype(leaf.dtype).name),
    shape=leaf.shape,
    chunk_layout=ts.ChunkLayout(write_chunk_shape=chunk),
  ).result()


def _describe(state: OffloadedState) -> dict:
  layout = state.layout
  return {
    "structure": str(layout.treedef),
    "leaves": [
      {"path": leaf.path, "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}
      for leaf in layout.leaves
    ],
  }


def _check_layout(state: OffloadedState, meta: dict, si: int) -> None:
  layout = state.layout
  what = f"checkpointed optimizer state {si}"
  if meta["structure"] != str(layout.treedef):
    raise OptimizerOffloadError(
      f"{what} has another structure than the optimizer's ({meta['structure']} against "
      f"{layout.treedef}): a checkpoint of another optimizer or model?"
    )
  for leaf, saved in zip(layout.leaves, meta["leaves"]):
    check_leaf(leaf, tuple(saved["shape"]), saved["dtype"], what)


def _open_stack(directory, si: int, j: int, lay: _Layout, *, create: bool):
  import tensorstore as ts  # orbax-checkpoint's own dependency (optional, as orbax is)

  spec = {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": str(directory / f"stack{si}/leaf{j}")},
  }
  if not create:
    return ts.open(spec, open=True).result()
  shape = (lay.num_layers,) + lay.shapes[j]
  return ts.open(
    spec,
    create=True,
    dtype=ts.dtype(np.dtype(lay.dtypes[j]).name),
    shape=shape,
    chunk_layout=ts.ChunkLayout(write_chunk_shape=(1,) + lay.shapes[j]),  # one layer a chunk
  ).result()


def _describe_stack(lay: _Layout) -> dict:
  return {
    "kind": lay.kind,
    "num_layers": lay.num_layers,
    "location": lay.location.value,  # where it was: a restore stores it where `like` lives
    "structure": str(lay.treedef),
    "leaves": [
      {"path": p, "shape": list(sh), "dtype": np.dtype(d).name}
      for p, sh, d in zip(lay.paths, lay.shapes, lay.dtypes)
    ],
  }


def _check_stack_layout(lay: _Layout, meta: dict, si: int) -> None:
  """``meta`` (a saved stack's description) against ``lay``'s: the first difference named."""
  what = f"checkpointed StreamedStack {si} ({meta['kind']}, {meta['num_layers']} layers)"
  fix = "a checkpoint of another model, optimizer or depth?"
  if meta["kind"] != lay.kind:
    raise OptimizerOffloadError(
      f"{what} is a {meta['kind']} stack, the one to restore into a {lay.kind} stack: {fix}"
    )
  if meta["num_layers"] != lay.num_layers:
    raise OptimizerOffloadError(
      f"{what} has {meta['num_layers']} layers, the stack to restore into {lay.num_layers}: {fix}"
    )
  if meta["structure"] != str(lay.treedef):
    raise OptimizerOffloadError(
      f"{what} has another layer structure than the stack to restore into "
      f"({meta['structure']} against {lay.treedef}): {fix}"
    )
  for saved, path, shape, dtype in zip(meta["leaves"], lay.paths, lay.shapes, lay.dtypes):
    want = (path, list(shape), np.dtype(dtype).name)
    got = (saved["path"], saved["shape"], saved["dtype"])
    if got != want:
      raise OptimizerOffloadError(
        f"{what}: leaf {saved['path'] or '<root>'} is {got[2]}{got[1]}, the stack to restore "
        f"into has {path or '<root>'} {want[2]}{want[1]}: {fix}"
      )
