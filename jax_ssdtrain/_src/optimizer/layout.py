"""Layout: which leaves of ``tx``'s state are stored, how they are cut, and where they go.

A stored leaf (:class:`LeafLayout`) is cut into chunks of rows (``bounds``) and has one store
site; small leaves (step counts, scalars) stay on the device. The layout is a function of the
state's shapes and the parameters alone, so that ``init`` is pure.

Sharded state (FSDP). When ``init`` gets parameters placed with NamedShardings on a mesh of
several devices, each stored leaf takes the PartitionSpec of the parameter it mirrors (its path
ends with the parameter's; replicated where none matches) and every device streams its own block
of it (``block_shape``; the bounds cut that block). The stream (``stream.py``) runs the groups
in one ``shard_map`` over the mesh.

Room. An update holds two versions of the stored state (the one it reads and the new one written
beside it), or with ``in_place`` one version and the chunks in flight (``room_bytes``):
``check_room`` refuses a state that does not fit where it is to live, and ``auto_location``
picks the place for ``location="auto"`` by the planner's one rule (``planner/tiers.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.planner.tiers import choose_tiers
from jax_ssdtrain._src.remat import derived_site
from jax_ssdtrain._src.store_space import entry_bytes, store_room
from jax_ssdtrain._src.stored_io import StoredLeaf

PIPELINE_DEPTH = 2  # the stream's loads of chunk k wait for the stores of chunk k - PIPELINE_DEPTH
DEFAULT_CHUNK_BYTES = 64 << 20  # offload_optimizer's chunk_bytes
DEFAULT_MIN_BYTES = 1 << 20  # offload_optimizer's min_bytes


@dataclasses.dataclass(frozen=True)
class Options:
  """``offload_optimizer``'s settings that the layout follows."""

  location: Location
  min_bytes: int
  chunk_bytes: int
  in_place: bool = False


@dataclasses.dataclass(frozen=True)
class LeafLayout(StoredLeaf):
  """One leaf of ``tx``'s state: a :class:`~jax_ssdtrain._src.stored_io.StoredLeaf` (its path,
  shape and dtype; for a stored leaf, the store site of every chunk, the engine checking a
  handle's site on load) with, for a stored leaf, its row chunks (``bounds``), each a piece
  that ``stored_io`` loads and stores."""

  bounds: tuple[tuple[int, int], ...] = ()  # () for a leaf kept on the device
  # Sharded state (Layout.mesh set): the leaf's PartitionSpec (a leaf kept on the device too:
  # its parameter's, so that it lies as optax's own state would, replicated where it mirrors
  # none) and each stored leaf's block shape; bounds cut that block (every device streams its
  # own block, chunk by chunk).
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
  """The state's layout: ``tx``'s tree structure and one :class:`LeafLayout` per leaf, where
  the stored leaves live (``location``: a store location, or the device for the reference) and
  the mesh they are sharded over."""

  treedef: Any
  leaves: tuple[LeafLayout, ...]
  location: Location
  # A jax.sharding.Mesh where the state is sharded (from the params init saw); None: one device.
  mesh: Any = None
  in_place: bool = False  # updates consume the chunks they read (offload_optimizer's in_place)

  @property
  def stored_bytes(self) -> int:
    return sum(leaf.nbytes for leaf in self.leaves if leaf.stored)

  @property
  def stores_anything(self) -> bool:
    return any(leaf.stored for leaf in self.leaves)


def row_bounds(shape: tuple[int, ...], chunk_bytes: int) -> tuple[tuple[int, int], ...]:
  """The chunks of rows of a leaf (or block) of ``shape``."""
  if not shape or shape[0] == 0:
    return ((0, 0),)
  row = max(1, math.prod(shape[1:])) * 4  # by shape alone: leaves of one shape cut alike
  rows = max(1, chunk_bytes // row)
  return tuple((r, min(r + rows, shape[0])) for r in range(0, shape[0], rows))


def make_layout(
  shapes: Any, opts: Options, name: str, params: Any = None, shardings: Any = None
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
    if not storable_dtype(aval.dtype):  # a typed PRNG key, say: it stays on the device
      leaves.append(LeafLayout(jax.tree_util.keystr(path), shape, aval.dtype))
      continue
    owner = owner_of(tuple(path), param_paths)
    leaf = LeafLayout(jax.tree_util.keystr(path), shape, np.dtype(aval.dtype), owner=owner)
    # A scalar is no bigger than a handle; a small leaf that mirrors no parameter (muon's
    # Newton-Schulz coefficients) is read by every parameter's update: both stay on the device.
    shared = owner == -1 and leaf.nbytes < opts.chunk_bytes
    if mesh is not None:  # kept on the device too: sharded as its parameter (no gathers)
      leaf = dataclasses.replace(leaf, spec=_spec_for(path, shape, param_specs))
    if shape and not shared and leaf.nbytes >= max(opts.min_bytes, 1):
      if mesh is not None:
        block = _block_shape(shape, leaf.spec, mesh, leaf.path, name)
        leaf = dataclasses.replace(leaf, local_shape=block)
      bounds = row_bounds(leaf.block_shape, opts.chunk_bytes)
      leaf = dataclasses.replace(leaf, bounds=bounds)
      leaf = dataclasses.replace(leaf, site=site_of(leaf, len(leaves)))
    leaves.append(leaf)
  return Layout(treedef, tuple(leaves), opts.location, mesh, opts.in_place)


def owner_of(path: tuple, param_paths: list[tuple]) -> int:
  """The index of the parameter whose path lies inside the state leaf's ``path`` (optax's state
  trees map the parameters' tree: ``mu['w']``, ``mu['w'][0]`` for params['w']); the longest such
  path wins, and -1 where there is none (a step count)."""
  best, found = 0, -1
  for j, p in enumerate(param_paths):
    if len(p) > best and any(path[k : k + len(p)] == p for k in range(len(path) - len(p) + 1)):
      best, found = len(p), j
  return found


def storable_dtype(dtype: Any) -> bool:
  """A dtype the store holds as bytes: numbers and booleans, not JAX's extended dtypes (typed
  PRNG keys), whose bits are not their value."""
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def site_of(leaf: LeafLayout, index: int) -> int:
  """The store site of a stored leaf's chunks: derived from the leaf (its index, path, shape,
  dtype, chunking and block), never from a counter, so that two ``init`` calls of one optimizer
  on one model make equal layouts (``remat.derived_site``, as a streamed stack's leaves').
  Negative: activation sites count up from 1."""
  return derived_site(
    (index, leaf.path, leaf.shape, leaf.dtype.name, leaf.bounds, leaf.local_shape)
  )


# ---------------------------------------------------------------------------------------------
# Room: what an update holds in the store, and where it fits


def auto_location(layout: Layout) -> Location:
  """``location="auto"``: where the state of ``layout`` goes, by the planner's one rule for every
  ``"auto"`` (:func:`~jax_ssdtrain._src.planner.tiers.choose_tiers`, one class: the state)
  weighing what an update holds in the store at once (:func:`room_bytes`: this process's share;
  two versions, the new written beside the old, or with ``in_place`` one and the chunks in
  flight): the host tier where that fits in its share for state (three quarters: the rest is
  left to activations); else the host tier spilling to the files where the store holds it;
  else the files (only where there is no host tier). Where none holds it, ``"host,nvme"``,
  which ``init`` refuses (:func:`check_room`), naming the settings."""
  need = room_bytes(layout)

  def weigh(placement: dict) -> tuple[int, bool, None]:
    loc = placement["optimizer_state"]
    return (need if loc is Location.HOST else 0), need <= store_room(loc)[0], None

  found = choose_tiers(("optimizer_state",), weigh)
  return Location.HOST_NVME if found is None else found[0]["optimizer_state"]


def _local_devices(layout: Layout) -> int:
  """This process's devices that stream the state (each its own block where it is sharded)."""
  if layout.mesh is None:
    return 1
  return sum(d.process_index == jax.process_index() for d in layout.mesh.devices.flat)


def _chunk_bytes(leaf: LeafLayout, r0: int, r1: int) -> int:
  """Bytes a chunk's entry takes in the store (rounded up to the engine's alignment)."""
  return entry_bytes(math.prod(leaf.chunk_shape(r0, r1)) * np.dtype(leaf.dtype).itemsize)


def _version_bytes(layout: Layout) -> int:
  """Bytes of one version of the stored leaves that this process's devices hold (each chunk an
  entry, rounded up to the engine's alignment as the store holds it)."""
  return _local_devices(layout) * sum(
    _chunk_bytes(leaf, r0, r1) for leaf in layout.leaves if leaf.stored for r0, r1 in leaf.bounds
  )


def room_bytes(layout: Layout) -> int:
  """Bytes of the store an update holds at once (this process's share): two versions (the one
  it reads and the one it writes beside it), or in place one version and the chunks in flight
  (every stored leaf of a shape, ``PIPELINE_DEPTH + 1`` chunks of each)."""
  version = _version_bytes(layout)
  if not layout.in_place:
    return 2 * version
  per_shape: dict[tuple[int, ...], int] = {}
  for leaf in layout.leaves:
    if leaf.stored:
      chunk = _chunk_bytes(leaf, *leaf.bounds[0])
      per_shape[leaf.block_shape] = per_shape.get(leaf.block_shape, 0) + chunk
  in_flight = (PIPELINE_DEPTH + 1) * max(per_shape.values(), default=0)
  return version + _local_devices(layout) * in_flight


def check_room(layout: Layout, loc: Location, name: str) -> None:
  """Refuses a state whose versions (the one an update reads and the one it writes beside it;
    with ``in_place`` one, and the chunks in flight) do not fit where it is to live: this
    process's host tier, its files (``capacity_bytes``; unset: 90% of the store directories' free
  space), or both: ``store_space.store_room``, the room a streamed stack's check uses. State on
  the device takes no room in the store."""
  if not loc.in_store:
    return
  version, need = _version_bytes(layout), room_bytes(layout)
  room, parts = store_room(loc)  # as a streamed stack's room (capacity_bytes unset: free space)
  if need > room:
    what = {
      Location.HOST: "host_tier_bytes",
      Location.NVME: "capacity_bytes",
      Location.HOST_NVME: "host_tier_bytes + capacity_bytes",
    }[loc]
    free = "".join(f"; {p}" for p in parts if "free space" in p)  # capacity_bytes unset
    held = (
      f"an update holds it and the chunks in flight ({need} bytes, in_place=True)"
      if layout.in_place
      else f"an update writes the new version beside the old one ({need} bytes)"
    )
    raise OptimizerOffloadError(
      f"{name}: its state takes {version} bytes in the store, and {held}, more than "
      f"location={loc.value!r} holds ({what} = {room}{free}): configure more "
      "(ssd.configure(...)), "
      + ("" if layout.in_place else "update in place (in_place=True: one version), ")
      + "or use location='host,nvme' (the host tier spilling to the files)"
    )


# ---------------------------------------------------------------------------------------------
# Sharding: each stored leaf's PartitionSpec and block


def _param_specs(params: Any, name: str, given: Any = None) -> tuple[Any, dict]:
  """``(mesh, {param path: (shape, PartitionSpec)})`` where ``params`` are arrays placed with
  NamedShardings on one mesh of several devices (or ``given``, a tree of their shardings:
  ``offload_optimizer``'s ``param_shardings``); ``(None, {})`` on one device."""
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
