"""Host I/O: ``tx``'s state between the store and host memory, piece by piece.

:func:`stream_out` reads a state out (one chunk of a stored leaf on the device at once; sharded
state: each device one chunk of its block), :func:`stream_in` writes one in (reading
:data:`PIECES_AHEAD` pieces ahead), through the layout's chunk I/O (``chunk_io.py``).
:func:`state_to_host` and :func:`state_from_host` are the whole-tree forms. These, with
:func:`check_leaf` and :func:`device_blocks`, are the seam :mod:`jax_ssdtrain.checkpointing`
writes and restores checkpoints through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.chunk_io import chunk_io
from jax_ssdtrain._src.optimizer.layout import Layout, LeafLayout
from jax_ssdtrain._src.optimizer.state import OffloadedState, check_state

PIECES_AHEAD = 3  # stream_in: pieces asked of `read` before the one it stores


def state_to_host(state: OffloadedState) -> Any:
  """``tx``'s state as NumPy arrays in host memory, read from the store one chunk at a time (the
  device holds one chunk at once; sharded state: each device one chunk of its block). A
  checkpoint needs no whole copy: :mod:`jax_ssdtrain.checkpointing` writes chunk by chunk. See
  :func:`state_from_host`."""
  check_state(state, "state")
  layout = state.layout
  if spans_processes(layout):
    raise OptimizerOffloadError(
      "state_to_host: the state is sharded over the devices of several processes and each "
      "holds only its own devices' blocks; save it with jax_ssdtrain.checkpointing (every "
      "process writes its blocks) or read it per process with stream_out"
    )
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
  check_state(like, "like")
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
  block), read from the store onto the device and then into host memory; the rest whole (a
  leaf sharded over several processes' devices: this process's blocks)."""
  check_state(state, "state")
  layout = state.layout
  io = chunk_io(layout.location)
  blocks = device_blocks(layout, "reading the state out of the store")
  device, handles = iter(state.device), iter(state.handles)
  for i, leaf in enumerate(layout.leaves):
    if not leaf.stored:
      _write_kept(write, i, leaf, next(device))
      continue
    for index, value in io.read_chunks(leaf, next(handles), layout.mesh, blocks):
      write(i, leaf, index, value)


def _write_kept(write: Callable[..., None], i: int, leaf: LeafLayout, x: Any) -> None:
  """A leaf kept on the device, to ``write``: whole where this process holds all of it; else
  (sharded as its parameter over several processes' devices) this process's blocks, each once
  over the processes (the replica 0 of each)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    write(i, leaf, (), np.asarray(x))
    return
  done = set()
  for shard in x.addressable_shards:
    key = tuple((s.start, s.stop) for s in shard.index)
    if shard.replica_id == 0 and key not in done:
      done.add(key)
      write(i, leaf, shard.index, np.asarray(shard.data))


def stream_in(like: OffloadedState, read: Callable[..., Any]) -> OffloadedState:
  """An :class:`OffloadedState` of ``like``'s layout whose pieces are ``read(i, leaf, index)``
  (the pieces :func:`stream_out` writes): a NumPy array, or a future of one (anything with
  ``result()``, e.g. a tensorstore read), which is asked for :data:`PIECES_AHEAD` pieces before
  its chunk goes to the store, so that reads overlap (the host holds at most that many chunks
  and one more; sharded state: chunks of every device's block). The caller checks shapes and
  dtypes (:func:`check_leaf`)."""
  check_state(like, "like")
  layout = like.layout
  io = chunk_io(layout.location)
  blocks = device_blocks(layout, "writing the state into the store")
  device, handles = [], []
  for i, leaf in enumerate(layout.leaves):
    if not leaf.stored:
      value = _resolved(read(i, leaf, ()))
      if layout.mesh is None:
        device.append(jnp.asarray(value))
      else:  # as init makes them: its parameter's sharding (every process gives the value)
        spec = jax.sharding.PartitionSpec() if leaf.spec is None else leaf.spec
        where = jax.sharding.NamedSharding(layout.mesh, spec)
        device.append(jax.make_array_from_callback(value.shape, where, lambda ix: value[ix]))
      continue
    pieces = _ahead(
      lambda indices, i=i, leaf=leaf: [read(i, leaf, index) for index in indices],
      io.piece_indices(leaf, blocks),
    )
    values = ([_resolved(p) for p in ps] for ps in pieces)
    handles.append(io.write_chunks(leaf, layout.mesh, blocks, values))
  if layout.mesh is None:  # on like's device, committed as like's arrays are: a step jitted
    # with out_shardings returns committed ones, and an uncommitted input made it compile twice
    device = [_like(x, y) for x, y in zip(device, like.device)]
    handles = [_like(x, y) for x, y in zip(handles, like.handles)]
  return OffloadedState(device, handles, layout)


def _like(x: Any, like: Any) -> Any:
  """``x`` placed as ``like`` where ``like`` is an array committed to its device."""
  if isinstance(like, jax.Array) and getattr(like, "committed", False):
    return jax.device_put(x, like.sharding)
  return x


def device_blocks(layout: Layout, what: str):
  """For state sharded over several devices: ``blocks(leaf)``, the index of the block of
  ``leaf`` of each of this process's devices (in ``mesh.devices.flat`` order), as
  :func:`stream_out` writes its pieces (with several processes, each streams its own devices'
  blocks); None where each leaf is one piece per chunk (state on one device, or kept on the
  device). ``what``: the operation, for messages."""
  return chunk_io(layout.location).blocks(layout.mesh, what)


def spans_processes(layout: Layout) -> bool:
  """Whether the state is sharded over devices of several processes (each streams its own)."""
  mesh = layout.mesh
  return mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)


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
