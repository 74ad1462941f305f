"""The chunk I/O seam: how a stored leaf is read and written, in the streamed program and from
the host. Two implementations, chosen once from the layout's Location (:func:`chunk_io`; the
layout is data, and names no I/O):

* :class:`StoreIO` (``"host"``, ``"nvme"``, ``"host,nvme"``): a stored leaf's handles are
  uint32[chunks, 2], one engine handle per chunk of rows (sharded state: uint32[devices, chunks,
  2], one row per device, each device streaming its own block through its own engine). A load
  is ``load_p`` of a handle, a store ``store_p`` into the tier. The state's loads are ``exact``
  (their entries come from an earlier step): a leaf loaded whole reads its chunks' handles on
  the GPU (a sync each, in any order); a scan's chunks are ``"ordered"``: the update's first
  load reads its handle and the engine predicts the others in store order, checking each on the
  device (a mismatch fails the step). Reading every chunk's handle stalled the host at each.
* :class:`DeviceIO` (``location="device"``): the same streamed program with each stored leaf
  kept whole on the device (a global array of its PartitionSpec where the state is sharded): the
  reference that the store's round trip must match bit for bit. Where the store's program has a
  load or a store it has a copy XLA cannot see through (``primitives.opaque_copy``), so that the
  group's arithmetic is a region bounded by custom calls that XLA compiles alike in both.

Both bind nothing themselves: each chunk is one piece of a stored leaf, loaded and stored
through ``stored_io.py`` (the seam a streamed stack's layers go through too, which owns the
primitives' attributes, the order of a chunk's loads on XLA:CPU and the device reference's
copies); what is here is which piece of a leaf's handles a chunk is.

Versions. The new version of each chunk is written beside the old one: the old entries are
released by the store's sweeps once no live array holds their handles (lifetimes.py), so a
failed step leaves the state it started from intact. The store then holds two versions at the
update. With ``in_place=True`` it holds one: each chunk's load is its entry's last
(``consume``), the engine releases the entry once the chunk is on the device, and the new
chunk's store takes its room. A failed update then leaves a state that is part old, part new,
and gone: its next use raises (the entries are released), and training resumes from a
checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import stored_io
from jax_ssdtrain._src.lifetimes import LATER_IN_ORDER
from jax_ssdtrain._src.location import TIER_CODES, Location
from jax_ssdtrain._src.optimizer.layout import LeafLayout

# The names of the state's entries: this, then the leaf's path.
PREFIX = "opt_state"

# An index of a piece of a leaf: a tuple of slices (``()`` for the whole leaf).
Index = tuple


class ChunkIO:
  """How a stored leaf's handles are read and written (see the module doc).

  In the streamed program (``stream.py``): ``load_leaf`` / ``store_leaf`` (a group that runs
  whole), ``load_rows`` / ``store_rows`` (one chunk of a chunked group), ``newest`` /
  ``scanned`` / ``single`` (a chunked group's handles as the scan and the last chunk make them),
  and on a mesh ``spec`` / ``local`` / ``from_local`` (the handles inside ``shard_map``). From
  the host (``host_io.py``): ``blocks`` (each device's block of a sharded leaf), ``read_chunks``
  / ``piece_indices`` + ``write_chunks`` (a leaf out of the store and into it, piece by piece),
  and ``to_device`` (a whole leaf on the device, ``optimizer_state``)."""

  location: Location

  # -- in the streamed program ----------------------------------------------------------------

  def load_leaf(self, hs, leaf: LeafLayout, *, consume: bool = False) -> Any:
    """Every chunk of ``leaf``, joined (a group that runs whole)."""
    raise NotImplementedError

  def load_rows(self, hs, leaf: LeafLayout, c, first, rows: int, *, wait, after: list, consume):
    """Chunk ``c`` of ``leaf`` (rows ``first:first + rows``; ``c`` traced in the scan), once
    ``wait`` (the stores of the chunk before last, or None) is computed and after the chunk's
    loads before it (``after``). Returns ``(value, after)`` for the chunk's next load."""
    raise NotImplementedError

  def store_leaf(self, value, leaf: LeafLayout) -> Any:
    """The handles of a whole new ``leaf``, stored chunk by chunk."""
    raise NotImplementedError

  def wait_for(self, hs, after: list) -> Any:
    """``hs`` once ``after`` is computed: a two-pass stream's update pass loads an entry after
    its reduction pass did (in place, the update pass's load is the entry's last). A copy of
    the handles that reads ``after``: a data dependency, which orders custom calls on every
    backend (XLA:CPU drops optimization barriers). The device reference needs no order: its
    handles are the state itself."""
    return stored_io.ordered_after(hs, *after)

  def store_rows(self, value, leaf: LeafLayout) -> Any:
    """The handle of one new chunk of ``leaf``."""
    raise NotImplementedError

  def newest(self, handles: dict, zero) -> Any:
    """What the next chunk's loads wait for: this chunk's store handles (``zero`` for none)."""
    raise NotImplementedError

  def scanned(self, h, rows: int) -> Any:
    """A leaf's handles of the scan's chunks (stacked by the scan), ``rows`` rows in all."""
    raise NotImplementedError

  def single(self, h) -> Any:
    """A leaf's handles of one chunk made outside the scan (to be joined with the others)."""
    raise NotImplementedError

  def spec(self, leaf: LeafLayout, mesh) -> Any:
    """The PartitionSpec of ``leaf``'s handles on ``mesh`` (sharded state)."""
    raise NotImplementedError

  def local(self, h) -> Any:
    """Inside ``shard_map``: this device's handles of the leaf."""
    raise NotImplementedError

  def from_local(self, h) -> Any:
    """Inside ``shard_map``: this device's new handles, as ``spec`` places them."""
    raise NotImplementedError

  # -- from the host ----------------------------------------------------------------------------

  def blocks(self, mesh, what: str) -> Callable[[LeafLayout], list[Index]] | None:
    """For state sharded over ``mesh``: ``blocks(leaf)``, the index of the block of ``leaf`` of
    each of this process's devices of the mesh (in ``mesh.devices.flat`` order: with several
    processes, each reads and writes its own devices' blocks); None where a leaf is read and
    written whole."""
    raise NotImplementedError

  def to_device(self, leaf: LeafLayout, hs, mesh) -> Any:
    """``leaf`` whole on the device (traced: under ``jax.jit``)."""
    raise NotImplementedError

  def read_chunks(self, leaf: LeafLayout, hs, mesh, blocks) -> Iterator[tuple[Index, Any]]:
    """``(index, NumPy array)`` for each piece of ``leaf``, one chunk read at a time."""
    raise NotImplementedError

  def piece_indices(self, leaf: LeafLayout, blocks) -> list[list[Index]]:
    """Per chunk that ``write_chunks`` stores, the indices of the pieces it is made of."""
    raise NotImplementedError

  def write_chunks(self, leaf: LeafLayout, mesh, blocks, values: Iterable[list[Any]]) -> Any:
    """The handles of ``leaf`` made from ``values`` (per chunk, its pieces' NumPy arrays, in the
    order of ``piece_indices``)."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class StoreIO(ChunkIO):
  """The store: handles of engine entries, one per chunk of rows (see the module doc).
  ``ordered``: a scan's chunk loads are predicted in store order; False reads each handle (a
  two-pass stream, whose update pass loads entries its reduction pass loaded before)."""

  location: Location
  ordered: bool = True

  @property
  def tier(self) -> int:
    return TIER_CODES[self.location]

  def load(self, handle, leaf: LeafLayout, k: int, shape=None, consume=False, exact=True):
    """``load_p`` of chunk ``k`` of ``leaf`` (``shape``: the chunk's, by default ``k``'s).
    ``exact``: True reads the handle on the GPU; ``"ordered"`` where the leaf's chunks come in
    store order (a scan's): the engine predicts it after the update's first load (no sync)."""
    shape = leaf.chunk_shape(*leaf.bounds[k]) if shape is None else shape
    return stored_io.load(
      handle, leaf, self.location, PREFIX, shape=shape, exact=exact, consume=consume
    )

  def store(self, x, leaf: LeafLayout, k: int):
    """``store_p`` of chunk ``k`` of ``leaf``: its handle. Loaded by the next update, in store
    order (``LATER_IN_ORDER``: the engine makes its host copy at once, so that device staging
    is free to read the next update's loads ahead)."""
    return stored_io.store(x, leaf, self.location, PREFIX, uses=LATER_IN_ORDER)

  def load_leaf(self, hs, leaf, *, consume=False):
    return joined([self.load(hs[k], leaf, k, consume=consume) for k in range(len(leaf.bounds))])

  def load_rows(self, hs, leaf, c, first, rows, *, wait, after, consume):
    h = hs[c]
    if wait is not None:  # the chunk before last has been stored: see PIPELINE_DEPTH
      h, _ = jax.lax.optimization_barrier((h, wait))
    # The chunk's loads run in the group's order, its stores' order (the engine reads ahead in
    # store order): on XLA:CPU each waits for the one before it (stored_io.load_next).
    shape = (rows,) + leaf.block_shape[1:]
    # a scan's iterations load each leaf's chunks in their store order: predicted on the GPU
    # (unless ``ordered`` is off)
    exact = "ordered" if self.ordered else True
    return stored_io.load_next(
      h, leaf, self.location, PREFIX, after=after, shape=shape, exact=exact, consume=consume
    )

  def store_leaf(self, value, leaf):
    hs = [
      self.store(jax.lax.slice_in_dim(value, *b) if len(leaf.bounds) > 1 else value, leaf, k)
      for k, b in enumerate(leaf.bounds)
    ]
    return jnp.stack(hs)

  def store_rows(self, value, leaf):
    return self.store(value, leaf, 0)

  def newest(self, handles, zero):
    return jnp.stack(list(handles.values())) if handles else zero

  def scanned(self, h, rows):
    return h

  def single(self, h):
    return h[None]

  def spec(self, leaf, mesh):
    return per_device(mesh)

  def local(self, h):
    return h[0]

  def from_local(self, h):
    return h[None]

  def blocks(self, mesh, what):
    if mesh is None:
      return None
    mine = _local_devices(mesh)

    def blocks(leaf):  # this process's devices' blocks (several processes: each its own)
      where = jax.sharding.NamedSharding(mesh, leaf.spec).devices_indices_map(leaf.shape)
      return [where[d] for d in mine]

    return blocks

  def to_device(self, leaf, hs, mesh):
    def whole(leaf, hs):  # a leaf, or on each device its block
      return self.load_leaf(hs, leaf).reshape(leaf.block_shape)

    if mesh is None:
      return whole(leaf, hs)
    return jax.shard_map(
      lambda h: whole(leaf, h[0]),
      mesh=mesh,
      in_specs=per_device(mesh),
      out_specs=leaf.spec,
      check_vma=False,
    )(hs)

  def read_chunks(self, leaf, hs, mesh, blocks):
    for k, (r0, r1) in enumerate(leaf.bounds):
      load = _load_jit(leaf, r1 - r0, self, mesh)
      if not blocks:
        yield (slice(r0, r1),), np.asarray(load(hs[k]))
        continue
      # [devices, rows, ...]: each of this process's devices' rows of its block
      shards = {s.device: s.data for s in load(hs, np.int32(k)).addressable_shards}
      for d, index in zip(_local_devices(mesh), blocks(leaf)):
        yield rows_of(index, r0, r1), np.asarray(shards[d])[0]

  def piece_indices(self, leaf, blocks):
    if blocks:  # chunk k of every device's block, one row per device
      index = blocks(leaf)
      return [[rows_of(ix, r0, r1) for ix in index] for r0, r1 in leaf.bounds]
    return [[(slice(r0, r1),)] for r0, r1 in leaf.bounds]

  def write_chunks(self, leaf, mesh, blocks, values):
    if blocks:  # one row per device, this process's rows from its pieces
      rows = jax.sharding.NamedSharding(mesh, per_device(mesh))
      store = _store_jit(leaf, self, mesh)
      devices = _local_devices(mesh)
      hs = []
      for pieces in values:
        shape = (mesh.devices.size,) + np.shape(pieces[0])
        local = [jax.device_put(p[None], d) for p, d in zip(pieces, devices)]
        hs.append(store(jax.make_array_from_single_device_arrays(shape, rows, local)))
      return jnp.stack(hs, axis=1)
    store = _store_jit(leaf, self, None)
    return jnp.stack([store(pieces[0]) for pieces in values])


@dataclasses.dataclass(frozen=True)
class DeviceIO(ChunkIO):
  """``location="device"``: a stored leaf's "handles" are the leaf itself, whole on the device;
  a copy XLA cannot see through stands where the store has a load or a store."""

  location: Location = Location.DEVICE

  # Each load and store goes through stored_io, whose device reference is a copy XLA cannot see
  # through where the store has a load or a store (see primitives.opaque_copy).

  def load_leaf(self, hs, leaf, *, consume=False):
    return joined(
      [
        stored_io.load(jax.lax.slice_in_dim(hs, *b), leaf, self.location, PREFIX)
        for b in leaf.bounds
      ]
    )

  def load_rows(self, hs, leaf, c, first, rows, *, wait, after, consume):
    if wait is not None:
      hs, _ = jax.lax.optimization_barrier((hs, wait))
    piece = jax.lax.dynamic_slice_in_dim(hs, first, rows)
    return stored_io.load_next(piece, leaf, self.location, PREFIX, after=after)

  def store_leaf(self, value, leaf):
    return joined(
      [
        stored_io.store(
          jax.lax.slice_in_dim(value, *b) if len(leaf.bounds) > 1 else value,
          leaf,
          self.location,
          PREFIX,
          uses=LATER_IN_ORDER,
        )
        for b in leaf.bounds
      ]
    )

  def store_rows(self, value, leaf):
    return stored_io.store(value, leaf, self.location, PREFIX, uses=LATER_IN_ORDER)

  def wait_for(self, hs, after):
    return hs

  def newest(self, handles, zero):
    return zero

  def scanned(self, h, rows):
    return h.reshape((rows,) + h.shape[2:])

  def single(self, h):
    return h

  def spec(self, leaf, mesh):
    return leaf.spec

  def local(self, h):
    return h

  def from_local(self, h):
    return h

  def blocks(self, mesh, what):
    return None

  def to_device(self, leaf, hs, mesh):
    return hs

  def read_chunks(self, leaf, hs, mesh, blocks):
    yield (), np.asarray(hs)

  def piece_indices(self, leaf, blocks):
    return [[()]]

  def write_chunks(self, leaf, mesh, blocks, values):
    sharding = None if not mesh else jax.sharding.NamedSharding(mesh, leaf.spec)
    ((value,),) = values
    return jax.device_put(value, sharding)


def chunk_io(location: Location) -> ChunkIO:
  """The chunk I/O of a state that lives at ``location``: a layout's is
  ``chunk_io(layout.location)`` (the seam chooses from the data)."""
  return DeviceIO() if location is Location.DEVICE else StoreIO(location)


def joined(parts: list[Any]) -> Any:
  """A leaf's chunks joined along its rows."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _local_devices(mesh) -> list:
  """This process's devices of ``mesh``, in ``mesh.devices.flat`` order (``blocks``' order)."""
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def per_device(mesh) -> Any:
  """Arrays with one row per device of ``mesh`` (in ``mesh.devices.flat`` order): handles."""
  return jax.sharding.PartitionSpec(tuple(mesh.axis_names))


def rows_of(index: tuple, r0: int, r1: int) -> tuple:
  """Rows ``r0:r1`` of the block at ``index`` (a device's slices of a leaf), as slices of the
  leaf."""
  first, rest = index[0], tuple(index[1:])
  start = first.start or 0
  return (slice(start + r0, start + r1),) + rest


@functools.cache
def _load_jit(leaf: LeafLayout, rows: int, io: StoreIO, mesh: Any):
  """Reads a chunk of ``rows`` rows of ``leaf`` from the store: from its handle, or (sharded)
  from every device's handles and the chunk's index. One program per chunk shape, not per
  chunk (a leaf's chunks are alike but its last)."""
  shape = leaf.chunk_shape(0, rows)
  if mesh is None:
    return jax.jit(lambda h: io.load(h, leaf, 0, shape=shape))
  each = lambda hs, k: io.load(hs[0, k], leaf, 0, shape=shape)[None]  # noqa: E731
  spec = per_device(mesh)
  replicated = jax.sharding.PartitionSpec()
  return jax.jit(
    jax.shard_map(each, mesh=mesh, in_specs=(spec, replicated), out_specs=spec, check_vma=False)
  )


@functools.cache
def _store_jit(leaf: LeafLayout, io: StoreIO, mesh: Any):
  """Writes a chunk of ``leaf`` (sharded: one row per device) into the store; jit traces once
  per chunk shape."""
  if mesh is None:
    return jax.jit(lambda x: io.store(x, leaf, 0))
  each = lambda x: io.store(x[0], leaf, 0)[None]  # noqa: E731
  spec = per_device(mesh)
  return jax.jit(jax.shard_map(each, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
