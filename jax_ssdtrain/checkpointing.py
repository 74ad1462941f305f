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
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

try:
  import orbax.checkpoint as ocp
except ImportError as e:  # an optional dependency (the `demo` extra)
  raise ImportError(
    "jax_ssdtrain.checkpointing needs orbax-checkpoint: pip install orbax-checkpoint "
    "(or jax_ssdtrain[demo])"
  ) from e

from jax_ssdtrain._src.layer_stream import StreamedStack
from jax_ssdtrain._src.optimizer import (
  LeafLayout,
  OffloadedState,
  OptimizerOffloadError,
  check_leaf,
  spans_processes,
  stream_in,
  stream_out,
)

__all__ = [
  "OptimizerStateHandler",
  "OptimizerStateRestore",
  "OptimizerStateSave",
  "restore",
  "restore_args",
  "save_args",
]

# Item names in a step's directory.
TREE_ITEM = "tree"
STATE_ITEM = "optimizer_state"
# Chunks a save writes at once (the restore reads optimizer.host_io.PIECES_AHEAD ahead): one chunk
# at a time left the disk idle while the next chunk came out of the store.
WRITES_IN_FLIGHT = 4


def save_args(tree: Any) -> ocp.args.Composite:
  """The Orbax arguments that save ``tree`` (a train state, or any pytree): every
  :class:`OffloadedState` in it streamed from the store (:class:`OptimizerStateSave`), the rest
  with ``StandardSave`` (items ``tree`` and ``optimizer_state`` of the step)."""
  _refuse_stacks(tree, "save_args")
  rest, states = _split(tree)
  return ocp.args.Composite(
    **{TREE_ITEM: ocp.args.StandardSave(rest), STATE_ITEM: OptimizerStateSave(states)}
  )


def restore_args(like: Any) -> ocp.args.Composite:
  """The Orbax arguments that restore a checkpoint :func:`save_args` wrote into the structure
  of ``like`` (its OffloadedStates give the layout and the store locations)."""
  _refuse_stacks(like, "restore_args")
  rest, states = _split(like)
  return ocp.args.Composite(
    **{TREE_ITEM: ocp.args.StandardRestore(rest), STATE_ITEM: OptimizerStateRestore(states)}
  )


def restore(manager: ocp.CheckpointManager, like: Any, step: int | None = None) -> Any:
  """Restores ``step`` (default: the latest) of ``manager`` into the structure of ``like``:
  ``like``'s own tree, each OffloadedState's leaves written into the store chunk by chunk."""
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
  return _join(like, restored[TREE_ITEM], restored[STATE_ITEM])


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
      writing = collections.deque()  # up to WRITES_IN_FLIGHT chunks written at once

      def write(i, leaf, index, value, si=si, arrays=arrays, writing=writing):
        if shared and not leaf.stored and not primary and not index:
          return  # a leaf kept on the device, replicated: written once (else its blocks)
        if i not in arrays:
          arrays[i] = _open(directory, si, i, leaf, create=not shared)
        target = arrays[i][index] if index else arrays[i]
        writing.append(target.write(value))
        while len(writing) > WRITES_IN_FLIGHT:
          writing.popleft().result()

      try:
        stream_out(state, write)
      except BaseException:  # the writes in flight end before the error leaves the save
        for w in writing:
          try:
            w.result()
          except Exception:  # noqa: BLE001 (the first error is the one raised)
            pass
        raise
      while writing:  # every write ends, or raises, before layout.json is written
        writing.popleft().result()
    if shared:  # every process's blocks are written before the layout says the save is whole
      multihost_utils.sync_global_devices(f"jax_ssdtrain.checkpointing wrote {directory}")
    if primary:
      layout = {"format": 1, "states": [_describe(s) for s in states]}
      (directory / "layout.json").write_text(json.dumps(layout, indent=1) + "\n")

  def restore(self, directory, args: OptimizerStateRestore) -> list[OffloadedState]:
    like = list(args.like)
    for s in like:
      _check_offloaded(s, "OptimizerStateRestore.like")
    saved = self.metadata(directory)["states"]
    if len(saved) != len(like):
      raise OptimizerOffloadError(
        f"the checkpoint holds {len(saved)} optimizer state(s) in the store, the tree to restore "
        f"into {len(like)}: a checkpoint of another training setup?"
      )
    for si, (state, meta) in enumerate(zip(like, saved)):
      _check_layout(state, meta, si)  # all of them before anything is written to the store
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
    path = directory / "layout.json"
    if not path.exists():
      raise FileNotFoundError(
        f"{path}: no optimizer state layout (not written by jax_ssdtrain.checkpointing, or a "
        "save that did not complete)"
      )
    return json.loads(path.read_text())


ocp.args.register_with_handler(OptimizerStateHandler, for_save=True)(OptimizerStateSave)
ocp.args.register_with_handler(OptimizerStateHandler, for_restore=True)(OptimizerStateRestore)


def _is_offloaded(x) -> bool:
  return isinstance(x, OffloadedState)


def _is_stack(x) -> bool:
  return isinstance(x, StreamedStack)


def _refuse_stacks(tree: Any, what: str) -> None:
  """A StreamedStack in the store holds handles, which mean nothing once saved: refused."""
  for x in jax.tree.leaves(tree, is_leaf=_is_stack):
    if _is_stack(x) and not x.layout.on_device:
      raise TypeError(
        f"{what}: the tree holds {x!r}, whose leaves are store handles (uint32[L, 2]) that "
        "mean nothing in a checkpoint: jax_ssdtrain.checkpointing cannot stream a StreamedStack "
        "yet. Save ssd.stack_to_tree(stack) in its place (it loads the whole stack onto the "
        "device) and restore with ssd.stack_from_tree, or keep the stack at location='device'"
      )


def _check_offloaded(x, what: str) -> None:
  if not _is_offloaded(x):
    raise TypeError(f"{what}: expected OffloadedStates, got {type(x).__name__}")


def _split(tree: Any) -> tuple[Any, list[OffloadedState]]:
  """``tree`` with a placeholder (a scalar leaf, saved with the tree) for each OffloadedState,
  and those states in tree order."""
  states = [x for x in jax.tree.leaves(tree, is_leaf=_is_offloaded) if _is_offloaded(x)]
  rest = jax.tree.map(
    lambda x: _placeholder() if _is_offloaded(x) else x, tree, is_leaf=_is_offloaded
  )
  return rest, states


def _placeholder():
  return np.zeros((), np.int8)


def _join(like: Any, rest: Any, states: list[OffloadedState]) -> Any:
  """``rest`` (``like`` with a placeholder for each OffloadedState) with the restored states in
  their places."""
  leaves, treedef = jax.tree_util.tree_flatten(like, is_leaf=_is_offloaded)
  restored = jax.tree_util.tree_leaves(rest)
  it = iter(states)
  return treedef.unflatten(
    [next(it) if _is_offloaded(x) else r for x, r in zip(leaves, restored, strict=True)]
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
