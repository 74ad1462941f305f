"""The stack: :class:`StreamedStack` and its layout, and moving one layer into or out of the store.

Owns the type a streamed stack is (:class:`StreamedStack`, its static :class:`_Layout` with each
leaf's store site, and its role, ``kind``: ``"params"``, ``"grad_sum"``, ``"opt_state"``...),
the checks of a stack given as an argument (:func:`_check_stack`, :func:`_check_role`), and the
loads and stores of one layer (:func:`_load_layer`, :func:`_store_layer`) that every program of
the layer stream is made of: each leaf's row of a layer is one piece of a stored leaf, loaded
and stored through ``stored_io.py`` (the seam the optimizer's chunks go through too, which owns
the primitives' attributes, the passes over a stack's layers, :class:`StreamPass`, and the
device reference). With ``location="device"`` the same programs keep the stacked leaves on the
device (``[L, *shape]``), each load and store replaced by a copy XLA cannot see through
(``primitives.opaque_copy``): the reference that the store's results equal bit for bit (the
arithmetic is, in both, a region bounded by custom calls, which XLA compiles alike).

Ordering and read-ahead. The stores and loads are ordered by their data (a load needs its
handle) and within a scan iteration by the carry. A layer's loads are chained in its leaves'
order on the CPU (XLA:CPU runs independent custom calls in any order: each waits for one
element of the one before, as the optimizer's chunks do). The parameters and the sums were
stored by an earlier execution; their loads are streamed (``exact="stream"``, see
:func:`_load_layer`): each pass gives its layer order (:class:`StreamPass`), and so did the
pass that stored the version it loads, so the engine predicts every load of a leaf after the
pass's first (which reads its handle) and reads the next ones ahead (files to host memory,
host memory to device staging) in the pass's direction, with store order or against it (the
backward pass's parameter loads, an update's loads of a sum). Each scan iteration's loads and
stores wait for the iteration before (:func:`_after`): the predictions follow the order of the
loads and of the stores.

Lifetimes. Every entry made here escapes its execution (its handle is returned): the sweeps
release it once no live array holds its handle (lifetimes.py). A step that replaces the sums or
the parameters leaves the old version in the store until then: donate the old stack to the
jitted step (``donate_argnums``) or drop it, and the next sweep frees it. The layer inputs saved
in the store are counted (one load each) and released at their load. Because every new version
is written beside the old one, a step or an update whose write fails (a full tier, a disk
error) raises, and the sums and parameters it was given are still whole: the last consistent
state (the store then holds two versions at a step). ``in_place=True`` (of the step and of
:func:`map_stack`, and of :func:`apply_streamed_update`, whose loads then read the old
parameters too) holds one instead: each old entry's load is its last (``consume``), as the
optimizer's ``in_place``; a failure then leaves no consistent state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import stored_io
from jax_ssdtrain._src.lifetimes import COUNTED_OR_LATER
from jax_ssdtrain._src.location import TIER_CODES, Location
from jax_ssdtrain._src.remat import derived_site
from jax_ssdtrain._src.stored_io import (  # noqa: F401 (StreamPass, new_pass: the stack's API)
  _PASSES,
  StoredLeaf,
  StreamPass,
  new_pass,
  ordered_after,
)
from jax_ssdtrain._src.stored_io import chain_loads as _chain_loads  # noqa: F401
from jax_ssdtrain._src.stored_io import token as _token  # noqa: F401
from jax_ssdtrain._src.stored_io import token32 as _token32

HANDLE_DTYPE = np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------------
# The stack


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What a stack holds (static: hashable, the pytree's auxiliary data): per leaf a
  :class:`~jax_ssdtrain._src.stored_io.StoredLeaf` (its path, one layer's shape, its dtype and
  the store site of its entries, one per layer), where they live and the stack's role."""

  treedef: Any  # of one layer's tree
  leaves: tuple[StoredLeaf, ...]  # one layer's, in the treedef's order
  num_layers: int
  location: Location
  kind: str  # "params", "grad_sum", ...: entry names and messages

  @property
  def paths(self) -> tuple[str, ...]:  # per leaf, for messages and entry names
    return tuple(leaf.path for leaf in self.leaves)

  @property
  def shapes(self) -> tuple[tuple[int, ...], ...]:  # per leaf, one layer's shape
    return tuple(leaf.shape for leaf in self.leaves)

  @property
  def dtypes(self) -> tuple[np.dtype, ...]:
    return tuple(leaf.dtype for leaf in self.leaves)

  @property
  def sites(self) -> tuple[int, ...]:  # per leaf: the store site of its entries
    return tuple(leaf.site for leaf in self.leaves)

  @property
  def on_device(self) -> bool:
    return self.location is Location.DEVICE

  @property
  def tier(self) -> int:
    return TIER_CODES[self.location]

  @property
  def prefix(self) -> str:
    """The names of its entries: this, then the leaf's path."""
    return f"layer_stream.{self.kind}"

  def layer_struct(self) -> Any:
    """One layer's tree of ``jax.ShapeDtypeStruct``."""
    leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes)]
    return jax.tree.unflatten(self.treedef, leaves)

  def layer_bytes(self) -> int:
    return sum(int(np.prod(s)) * d.itemsize for s, d in zip(self.shapes, self.dtypes))


@jax.tree_util.register_pytree_node_class
class StreamedStack:
  """A scanned layer stack's tensors (parameters, or a gradient sum) held layer by layer.

  ``handles`` is a pytree of one layer's structure whose leaves are, in the store,
  ``uint32[L, 2]`` handles (one entry per layer per leaf), and with ``location="device"`` the
  stacked leaves themselves (``[L, *shape]``). It is a pytree (the handles are its leaves): pass
  it to ``jax.jit`` and donate it. Made by :func:`init_streamed`, :func:`stack_from_tree`,
  :func:`map_stack` and :func:`value_and_grad_streamed`; read by :func:`stack_to_tree`.

  ``layout.kind`` is its role: ``"params"`` (:func:`init_streamed`, :func:`stack_from_tree`),
  ``"grad_sum"`` (:func:`value_and_grad_streamed`'s sum), ``"opt_state"`` (a
  :class:`StreamedOptState`'s ``per_layer``); :func:`map_stack`'s result keeps its first stack's
  kind, or takes its ``kind``. Where the parameters are expected a gradient sum or a state is
  refused, and where a gradient sum is expected a state.
  """

  def __init__(self, handles: Any, layout: _Layout):
    self.handles = handles
    self.layout = layout

  def tree_flatten(self):
    # Up to one layer's structure: a leaf mapped to None (Orbax's per-leaf save arguments)
    # stays a child.
    return self.layout.treedef.flatten_up_to(self.handles), self.layout

  @classmethod
  def tree_unflatten(cls, layout, leaves):
    return cls(jax.tree.unflatten(layout.treedef, list(leaves)), layout)

  @property
  def num_layers(self) -> int:
    return self.layout.num_layers

  @property
  def location(self) -> Location:
    return self.layout.location

  def layer_struct(self) -> Any:
    """One layer's tree of ``jax.ShapeDtypeStruct``."""
    return self.layout.layer_struct()

  @property
  def nbytes(self) -> int:
    """Bytes of the whole stack (all layers), wherever it lives."""
    return self.layout.layer_bytes() * self.layout.num_layers

  def __repr__(self) -> str:
    lay = self.layout
    return (
      f"StreamedStack({lay.kind}, {lay.num_layers} layers of {len(lay.shapes)} leaves, "
      f"{self.nbytes} bytes, location={lay.location.value!r})"
    )


def _site_of(kind: str, index: int, path: str, shape, dtype, num_layers: int) -> int:
  """A leaf's store site, derived from what it holds (never a counter: two inits of one model
  make equal layouts). Negative: activation sites count up from 1."""
  return derived_site(
    ("layer_stream", kind, index, path, tuple(shape), np.dtype(dtype).name, num_layers)
  )


def _parse_location(location: Any, what: str = "location") -> Location:
  expected = f"{what}: expected 'host', 'nvme', 'host,nvme' or 'device', got {location!r}"
  try:
    loc = Location.parse(location, what=what)
  except ValueError:
    raise ValueError(expected) from None
  if not (loc.in_store or loc is Location.DEVICE):
    raise ValueError(expected)
  return loc


def _make_layout(layer: Any, num_layers: int, location: Location, kind: str, what: str) -> _Layout:
  """The layout of a stack of ``num_layers`` layers shaped like ``layer`` (a tree of arrays or
  ShapeDtypeStructs, one layer's)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(layer)
  if not flat:
    raise ValueError(f"{what}: one layer's tree has no arrays")
  paths, shapes, dtypes = [], [], []
  for path, leaf in flat:
    name = jax.tree_util.keystr(path)
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(f"{what}: leaf {name or '<root>'} is {type(leaf).__name__}, not an array")
    dtype = (
      np.dtype(leaf.dtype) if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended) else None
    )
    if dtype is None:
      raise TypeError(
        f"{what}: leaf {name or '<root>'} has the extended dtype {leaf.dtype} (a typed PRNG key?), "
        "which the store cannot hold as bytes"
      )
    paths.append(name)
    shapes.append(tuple(int(d) for d in leaf.shape))
    dtypes.append(dtype)
  leaves = tuple(
    StoredLeaf(p, s, d, _site_of(kind, i, p, s, d, num_layers))
    for i, (p, s, d) in enumerate(zip(paths, shapes, dtypes))
  )
  return _Layout(treedef, leaves, num_layers, location, kind)


def _check_num_layers(num_layers: Any) -> int:
  if (
    isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1
  ):
    raise ValueError(f"num_layers: expected an integer >= 1, got {num_layers!r}")
  return int(num_layers)


def _check_bool(value: Any, what: str) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{what}: expected True or False, got {value!r}")


def _check_stack(stack: Any, what: str, role: str | None = None) -> _Layout:
  """``stack``'s layout, once its handles agree with it and (``role``: ``"params"`` or
  ``"grad_sum"``) its kind may play that role (a clear error where they do not)."""
  if not isinstance(stack, StreamedStack):
    hint = ""
    if type(stack).__name__ == "StreamedOptState":  # update.py's, which imports this module
      hint = " (init_streamed_optimizer's state: its per-layer leaves are the stack .per_layer)"
    raise TypeError(
      f"{what}: expected a StreamedStack (init_streamed, stack_from_tree, map_stack or "
      f"value_and_grad_streamed make one), got {type(stack).__name__}{hint}"
    )
  lay = stack.layout
  leaves = jax.tree.leaves(stack.handles)
  if len(leaves) != len(lay.shapes):
    raise ValueError(
      f"{what}: {len(leaves)} handle arrays for a layout of {len(lay.shapes)} leaves"
    )
  for leaf, path, shape, dtype in zip(leaves, lay.paths, lay.shapes, lay.dtypes):
    if lay.on_device:
      want, want_dtype = (lay.num_layers,) + shape, dtype
    else:
      want, want_dtype = (lay.num_layers, 2), HANDLE_DTYPE
    if tuple(leaf.shape) != want or np.dtype(leaf.dtype) != want_dtype:
      raise ValueError(
        f"{what}: leaf {path or '<root>'} of this {lay.kind} stack ({lay.location.value}) must be "
        f"{want_dtype.name}{list(want)}, got {np.dtype(leaf.dtype).name}{list(leaf.shape)}"
        + ("" if lay.on_device else " (its handles: one uint32[2] per layer)")
      )
  if role is not None:
    _check_role(lay, role, what)
  return lay


# What a stack of each kind holds, for messages.
_KIND_NAMES = {
  "params": "the parameters",
  "grad_sum": "a gradient sum",
  "opt_state": "an optimizer state's per-layer leaves",
}
# The kinds refused in each role. A gradient sum may be a "params" stack: map_stack's result
# keeps its first stack's kind (a sum computed from parameters), so only a state is refused.
_NOT_IN_ROLE = {"params": ("grad_sum", "opt_state"), "grad_sum": ("opt_state",)}


def _kind_name(lay: _Layout) -> str:
  return f"{_KIND_NAMES.get(lay.kind, 'a stack')} ({lay.kind!r} stack)"


def _check_role(lay: _Layout, role: str, what: str, call: str = "", other: Any = None) -> None:
  """Refuses a stack whose kind cannot play ``role`` (``"params"``: where the parameters are
  expected; ``"grad_sum"``: a gradient sum). ``call``: the function's signature, for the
  message; ``other``: ``(name, layout)`` of the argument in the other role, to name a swap."""
  if lay.kind not in _NOT_IN_ROLE[role]:
    return
  wanted = "the parameters are" if role == "params" else "a gradient sum is"
  message = f"{what}: {_kind_name(lay)}, where {wanted} expected"
  if other is not None and role == "params" and lay.kind == "grad_sum":
    other_what, other_lay = other
    if other_lay.kind == "params":
      message += f", and {other_what} is {_kind_name(other_lay)}: the two look swapped"
  if call:
    message += f". The order is {call}"
  raise ValueError(message)


# ---------------------------------------------------------------------------------------------
# Loading and storing one layer (the store's entries, or the device reference's copies)


def _load_layer(
  stack: StreamedStack,
  i: Any,
  stream_pass: StreamPass | None,
  consume: bool = False,
  after: Any = (),
) -> Any:
  """Layer ``i``'s tree (``i`` an int or a traced scalar); ``stream_pass``: the pass the load
  belongs to (:func:`new_pass`; None: the loads read their handles); ``consume``: the loads are
  their entries' last (the engine releases each once its bytes are copied); ``after``: arrays
  the loads wait for (not read).

  The loads are streamed (``exact="stream"``): a pass loads a stack's layers one after the
  other in one direction (0 up, or down), so the engine predicts each leaf's next entry from
  the pass's last two loads of it (or, where both passes give their direction, the last one)
  instead of reading the handle (a sync each). A pass's loads must run in that order: loads
  outside a scan wait for the ones before them (``after``), or XLA may move them. Each leaf's
  row is one piece of it, loaded through ``stored_io`` (chained in the leaves' order on the CPU:
  :func:`stored_io.load_next`)."""
  lay = stack.layout
  given = [a for a in after if a is not None]
  out, before = [], given
  for hs, leaf in zip(jax.tree.leaves(stack.handles), lay.leaves):
    row = jax.lax.dynamic_index_in_dim(hs, i, axis=0, keepdims=False)
    x, before = stored_io.load_next(
      row,
      leaf,
      lay.location,
      lay.prefix,
      after=before,
      given=given,
      stream=stream_pass,
      consume=consume,
    )
    out.append(x)
  return jax.tree.unflatten(lay.treedef, out)


def _after(i: Any, *tokens: Any) -> Any:
  """The layer index ``i`` once ``tokens`` are computed: what a scan iteration derives from it
  (its loads, the data it stores) comes after the iteration before it. XLA may unroll a scan
  and order its iterations' independent calls as it likes; the engine predicts a stack's loads
  from their order and the stores' order (see :func:`_load_layer`)."""
  return ordered_after(i, *tokens)


def _store_layer(lay: _Layout, layer: Any, stream_pass: StreamPass) -> list[Any]:
  """One layer's entries: per leaf a handle uint32[2] (on the device: the leaf, copied).
  ``stream_pass``: the pass that stores this version of the stack (:func:`new_pass`): a later
  pass's streamed loads follow one version's entries (a program may store two versions of a
  stack at the same sites, as micro-steps in one program store their sums)."""
  out = []
  for x, leaf in zip(jax.tree.leaves(layer), lay.leaves):
    x = jnp.asarray(x)
    if x.shape != leaf.shape or x.dtype != leaf.dtype:
      raise ValueError(
        f"{lay.kind} layer leaf {leaf.path or '<root>'}: expected "
        f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}, got {x.dtype.name}{list(x.shape)}"
      )
    # counted where this program loads it; else loaded by later programs, layer after layer:
    # the engine makes the host copy at once (LATER_IN_ORDER)
    out.append(
      stored_io.store(x, leaf, lay.location, lay.prefix, uses=COUNTED_OR_LATER, stream=stream_pass)
    )
  return out


def _stacked(lay: _Layout, per_layer: list[list[Any]]) -> StreamedStack:
  """A stack from parts, each a list (per leaf) of arrays with a leading layer axis."""
  leaves = [parts[0] if len(parts) == 1 else jnp.concatenate(parts) for parts in zip(*per_layer)]
  return StreamedStack(jax.tree.unflatten(lay.treedef, leaves), lay)


def _scan_layers(lay: _Layout, fn: Callable[[Any], Any]) -> StreamedStack:
  """A stack whose layer ``i`` is ``fn(i)`` (a layer's tree), made and stored one layer per
  scan iteration (the device holds one layer at a time)."""
  store_pass = new_pass(1)

  def body(token, i):
    handles = _store_layer(lay, fn(_after(i, token)), store_pass)
    return _token32(handles), handles

  rows = jnp.arange(lay.num_layers, dtype=jnp.int32)
  _, leaves = jax.lax.scan(body, jnp.zeros((1,), jnp.float32), rows)
  return StreamedStack(jax.tree.unflatten(lay.treedef, leaves), lay)


# ---------------------------------------------------------------------------------------------
# Describing values in messages, and a stack's gradient sum


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (tuple, list, dict))


def _describe(tree: Any) -> str:
  """A value for messages: an array's dtype and shape (``float32[4, 16]``); any other pytree's
  type and leaves (``tuple of 2 arrays (float32[4, 16], bool[4])``)."""

  def one(x):
    if _is_array(x):
      return f"{x.dtype}{list(x.shape)}"
    return type(x).__name__

  if _is_array(tree):
    return one(tree)
  leaves = jax.tree.leaves(tree)
  if not leaves or leaves == [tree]:
    return type(tree).__name__
  shown = ", ".join(one(x) for x in leaves[:6]) + (", ..." if len(leaves) > 6 else "")
  arrays = all(_is_array(x) for x in leaves)
  noun = ("arrays" if arrays else "leaves") if len(leaves) > 1 else ("array" if arrays else "leaf")
  return f"{type(tree).__name__} of {len(leaves)} {noun} ({shown})"


def _sum_layout(lay: _Layout, sum_dtype: np.dtype, location: Location) -> _Layout:
  """The layout of a gradient sum of the stack ``lay`` (its leaves in ``sum_dtype``) at
  ``location``."""
  layer = jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(s, sum_dtype) for s in lay.shapes])
  return _make_layout(layer, lay.num_layers, location, "grad_sum", "stack")
