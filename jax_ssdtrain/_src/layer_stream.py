"""A scanned layer stack whose parameters live in the store and whose gradients leave per layer.

Issue 35's core (a preview: ``scripts/train.py --stream-layers`` and the planner's
:func:`~jax_ssdtrain.choose_stack_location` use it; ``offload_optimizer`` does not yet): the
device holds a window of layers, never the whole stack's parameters or gradients. Each class of
tensor has its own location: the parameters where the stack lives, the gradients' running sum
(``sum_location``) and the optimizer state with the master copy (``init_streamed_optimizer``'s
``location``) there too by default, or each on the device or in another tier.

* :class:`StreamedStack`: a pytree of per-layer tensors with a leading layer axis ``L`` (the
  parameters of a scanned stack, or their gradients' running sum) kept in the store as one
  entry per layer per leaf; the device holds, per leaf, a handles array ``uint32[L, 2]``. With
  ``location="device"`` the same programs keep the stacked leaves on the device instead
  (``[L, *shape]``), each load and store replaced by a copy XLA cannot see through
  (``primitives.opaque_copy``): the reference that the store's results equal bit for bit (the
  arithmetic is, in both, a region bounded by custom calls, which XLA compiles alike).
* :func:`init_streamed` initialises layer by layer straight into the store (a ``lax.scan``
  whose iteration makes and stores one layer; pure, so ``jax.eval_shape`` of it works).
  :func:`stack_from_tree` stores a stacked tree that is already on the device.
* :func:`value_and_grad_streamed` makes a training micro-step with an explicit per-layer
  backward pass (a ``custom_vjp`` cannot return new store handles from its backward rule):
  forward, a ``lax.scan`` over the layers that loads layer ``i + 1``'s parameters while layer
  ``i`` computes (they travel in the carry: two layers on the device) and saves each layer's
  input (on the device, or in the store); the head through ``jax.vjp``; backward, a reverse
  ``lax.scan`` that loads the parameters again (layer ``i - 1`` read ahead while layer ``i``
  runs), recomputes the layer under ``jax.vjp``, adds its parameter gradient into the running
  sum in the store and passes the input cotangent down. The last layer's parameters and
  ``jax.vjp`` from the forward pass serve its backward (one layer's load and compute fewer). The
  embedding and head parameters stay on the device with ordinary gradients (their running sums
  too): they are small.
* :func:`map_stack` runs a function layer by layer over stacks and stores its results: the update
  path (new bfloat16 parameters from the old ones and the gradient sum, written straight back to
  the store); :func:`stack_to_tree` loads a whole stack (tests, small models, the optimizer's
  consumption until it streams them itself).
* :func:`init_streamed_optimizer` and :func:`apply_streamed_update`: an optax transformation's
  update of the stack, layer by layer (a ``lax.scan`` read ahead one layer), with the state's
  per-parameter leaves and the float32 master copy stored per layer at the state's location and
  its shared scalars (the step count) once on the device; :func:`streamed_global_norm` (a pass
  of loads and reductions) for global-norm clipping, which ``tx`` itself cannot do per layer
  (refused, by tracing ``tx.update`` of one layer for reductions); :func:`apply_device_update`
  for the embedding's and head's parameters with ``tx``'s ordinary state.

Where the sum is added: on the device, which reads the old sum back, adds the layer's gradient
and stores the new sum beside the old one. The alternative, the host's cores adding each arriving
gradient into the sum in place, crosses the link once per micro-batch instead of twice. Per
parameter and micro-batch (bfloat16 parameters, float32 sum), the device's way moves 8 B in (the
parameters twice, the old sum) and 4 B out (the new sum); the host's way 4 B in, 4 B out. The
link runs both ways at once (~45 GB/s each way on an H100), so the inbound side binds: at 400
TFLOP/s (6 FLOP per parameter and token) the device's way hides behind the compute from about
12k tokens per micro-batch (9k with a bfloat16 sum), the host's from about 6k. What the host's
way costs instead: (1) the sum is updated in place, so a micro-step that fails part way leaves
a sum that is part old, part new (issue 35 asks that a failed write leave the last consistent
state; keeping two versions on the host costs the memory the device's way costs); (2) 16 B of
host-memory traffic per parameter (the arriving gradient written and read, the sum read and
written): 480 GB per micro-batch at 30B parameters, 1.6-2.4 s of a server's memory bandwidth,
shared with the link's copies and the disk, and a dozen cores or more doing float32 adds at that
rate; (3) arithmetic in the engine (dtype conversion, an entry that is both read and written,
its ordering against the loads of the sum), which today only moves bytes; with the sum in the
files both ways read and write it on the disk. So the device adds here: consistent under
failure, no host-memory or core budget, the addition is XLA's and bit for bit the device
reference's, in any tier, and the first micro-batch of a step reads nothing back (k micro-batches
read the sum k - 1 times). The host's add is the follow-up where the GPU runs show the link
binding at the micro-batch sizes that fit (docs/layer_stream.md has the arithmetic).

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
import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.config import ensure_configured, store_directories
from jax_ssdtrain._src.lifetimes import COUNTED_OR_LATER
from jax_ssdtrain._src.location import TIER_CODES, Location
from jax_ssdtrain._src.options import free_bytes_total
from jax_ssdtrain._src.primitives import load_p, opaque_copy, store_p
from jax_ssdtrain._src.remat import new_site_id

HANDLE_DTYPE = np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------------
# The stack


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What a stack holds (static: hashable, the pytree's auxiliary data)."""

  treedef: Any  # of one layer's tree
  paths: tuple[str, ...]  # per leaf, for messages and entry names
  shapes: tuple[tuple[int, ...], ...]  # per leaf, one layer's shape
  dtypes: tuple[np.dtype, ...]
  num_layers: int
  location: Location
  sites: tuple[int, ...]  # per leaf: the store site of its entries
  kind: str  # "params", "grad_sum", ...: entry names and messages

  @property
  def on_device(self) -> bool:
    return self.location is Location.DEVICE

  @property
  def tier(self) -> int:
    return TIER_CODES[self.location]

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
  key = repr(("layer_stream", kind, index, path, tuple(shape), np.dtype(dtype).name, num_layers))
  digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
  return -2 - (int.from_bytes(digest, "little") >> 2)


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
  sites = tuple(
    _site_of(kind, i, p, s, d, num_layers) for i, (p, s, d) in enumerate(zip(paths, shapes, dtypes))
  )
  return _Layout(
    treedef, tuple(paths), tuple(shapes), tuple(dtypes), num_layers, location, sites, kind
  )


def master_weights_of(lay: _Layout, master_weights: bool | None) -> bool:
  """``master_weights`` checked, or where None its default: a float32 master copy where the
  stack has floating-point leaves narrower than float32."""
  if master_weights is None:
    master_weights = any(jnp.issubdtype(d, jnp.floating) and d.itemsize < 4 for d in lay.dtypes)
  _check_bool(master_weights, "master_weights")
  return master_weights


def _class_locations(lay: _Layout, sum_location: Any, state_location: Any) -> dict:
  """Each class's :class:`Location` (``STACK_CLASSES``): the parameters where the stack lives,
  the sum and the state there too unless given."""

  def parse(loc, what):
    return lay.location if loc is None else _parse_location(loc, what)

  return dict(
    params=lay.location,
    grad_sum=parse(sum_location, "sum_location"),
    optimizer_state=parse(state_location, "state_location"),
  )


def _check_num_layers(num_layers: Any) -> int:
  if (
    isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1
  ):
    raise ValueError(f"num_layers: expected an integer >= 1, got {num_layers!r}")
  return int(num_layers)


def _check_stack(stack: Any, what: str) -> _Layout:
  """``stack``'s layout, once its handles agree with it (a clear error where they do not)."""
  if not isinstance(stack, StreamedStack):
    raise TypeError(
      f"{what}: expected a StreamedStack (init_streamed, stack_from_tree, map_stack or "
      f"value_and_grad_streamed make one), got {type(stack).__name__}"
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
  return lay


# ---------------------------------------------------------------------------------------------
# Loading and storing one layer (the store's entries, or the device reference's copies)


def _chain_loads() -> bool:
  # XLA:CPU runs independent custom calls in any order: chain a layer's loads (read-ahead
  # order). A GPU runs them in its stream's order.
  return jax.default_backend() == "cpu"


_PASSES = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class StreamPass:
  """One pass of a program over a stack's layers (its loads, or the stores of one version):
  ``number``, which no other pass uses, and ``direction``, the order of its layers (1: up, -1:
  down, 0: not said). With both passes' directions the engine predicts a pass's loads from the
  second on (from the third without)."""

  number: int
  direction: int


def new_pass(direction: int = 0) -> StreamPass:
  """A pass no other pass of a stack's loads and stores uses (see :func:`_load_layer`); the
  store and load primitives check ``direction``."""
  return StreamPass(next(_PASSES), direction)


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
  outside a scan wait for the ones before them (``after``), or XLA may move them."""
  lay = stack.layout
  leaves = jax.tree.leaves(stack.handles)
  given = [a for a in after if a is not None]
  out, before = [], given
  for leaf, path, shape, dtype, site in zip(leaves, lay.paths, lay.shapes, lay.dtypes, lay.sites):
    row = jax.lax.dynamic_index_in_dim(leaf, i, axis=0, keepdims=False)
    if lay.on_device:  # a copy where the store has a load (see primitives.opaque_copy)
      out.append(opaque_copy(row))
      continue
    deps = before if _chain_loads() else given  # on a GPU each leaf waits for `after`
    if deps:
      row = opaque_copy(row, *deps, effect=False)
    aval = jax.core.ShapedArray(shape, dtype)
    name = f"layer_stream.{lay.kind}{path}"
    extra = {"consume": True} if consume else {}
    if stream_pass:
      extra |= dict(
        exact="stream", stream_pass=stream_pass.number, stream_dir=stream_pass.direction
      )
    else:
      extra |= {"exact": True}
    x = load_p.bind(row, aval=aval, site=site, tier=lay.tier, name=name, **extra)
    before = [x.reshape(-1)[:1]] if x.size else []
    out.append(x)
  return jax.tree.unflatten(lay.treedef, out)


def _token(leaves: list[Any]) -> Any:
  """A one-element slice of the last non-empty leaf (what a later load waits for), or None."""
  sized = [x for x in leaves if x.size]
  return sized[-1].reshape(-1)[:1] if sized else None


def _token32(leaves: list[Any]) -> Any:
  """:func:`_token` as float32[1] (zeros without a non-empty leaf): a scan's carry."""
  t = _token(leaves)
  return jnp.zeros((1,), jnp.float32) if t is None else t.astype(jnp.float32)


def _after(i: Any, *tokens: Any) -> Any:
  """The layer index ``i`` once ``tokens`` are computed: what a scan iteration derives from it
  (its loads, the data it stores) comes after the iteration before it. XLA may unroll a scan
  and order its iterations' independent calls as it likes; the engine predicts a stack's loads
  from their order and the stores' order (see :func:`_load_layer`)."""
  return opaque_copy(i, *tokens, effect=False)


def _store_layer(lay: _Layout, layer: Any, stream_pass: StreamPass) -> list[Any]:
  """One layer's entries: per leaf a handle uint32[2] (on the device: the leaf, copied).
  ``stream_pass``: the pass that stores this version of the stack (:func:`new_pass`): a later
  pass's streamed loads follow one version's entries (a program may store two versions of a
  stack at the same sites, as micro-steps in one program store their sums)."""
  leaves = jax.tree.leaves(layer)
  out = []
  for x, path, shape, dtype, site in zip(leaves, lay.paths, lay.shapes, lay.dtypes, lay.sites):
    x = jnp.asarray(x)
    if x.shape != shape or x.dtype != dtype:
      raise ValueError(
        f"{lay.kind} layer leaf {path or '<root>'}: expected {np.dtype(dtype).name}{list(shape)}, "
        f"got {x.dtype.name}{list(x.shape)}"
      )
    if lay.on_device:
      out.append(opaque_copy(x))
    else:
      name = f"layer_stream.{lay.kind}{path}"
      # counted where this program loads it; else loaded by later programs, layer after layer:
      # the engine makes the host copy at once (LATER_IN_ORDER)
      out.append(
        store_p.bind(
          x,
          site=site,
          tier=lay.tier,
          name=name,
          uses=COUNTED_OR_LATER,
          stream_pass=stream_pass.number,
          stream_dir=stream_pass.direction,
        )[1]
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
# Making, reading and updating stacks


def init_streamed(
  init_layer_fn: Callable[[Any], Any], key: Any, num_layers: int, *, location: Any = "host"
) -> StreamedStack:
  """Initialises a stack of ``num_layers`` layers straight into the store, layer by layer.

  ``init_layer_fn(key) -> layer`` makes one layer's parameters (a pytree of arrays); layer ``i``
  gets ``jax.random.split(key, num_layers)[i]``, so the stack equals
  ``jax.vmap(init_layer_fn)(jax.random.split(key, num_layers))`` without ever being whole on the
  device. ``location``: ``"host"``, ``"nvme"``, ``"host,nvme"`` or ``"device"`` (the reference:
  the stacked tree on the device). Pure: ``jax.eval_shape`` of it gives the stack's structure.
  """
  loc = _parse_location(location)
  num_layers = _check_num_layers(num_layers)
  keys = jax.random.split(key, num_layers)
  layer = jax.eval_shape(init_layer_fn, keys[0])
  lay = _make_layout(layer, num_layers, loc, "params", "init_layer_fn's result")
  return _init_jit(init_layer_fn, lay, keys)


@jax.jit(static_argnums=(0, 1))
def _init_jit(init_layer_fn, lay, keys):
  return _scan_layers(lay, lambda i: init_layer_fn(keys[i]))


def stack_from_tree(tree: Any, *, location: Any = "host", kind: str = "params") -> StreamedStack:
  """Stores a stacked tree (leaves ``[L, ...]``, on the device) layer by layer: for stacks that
  fit on the device (tests, a checkpoint restored whole). :func:`init_streamed` makes one that
  does not fit."""
  loc = _parse_location(location)
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError("tree: no arrays")
  lengths = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(lengths) != 1 or None in lengths:
    raise ValueError(
      f"tree: every leaf needs the same leading layer axis, got leading sizes "
      f"{sorted(str(n) for n in lengths)}"
    )
  (num_layers,) = lengths
  num_layers = _check_num_layers(num_layers)
  layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.asarray(x).dtype), tree)
  lay = _make_layout(layer, num_layers, loc, kind, "tree")
  return _from_tree_jit(lay, tree)


@jax.jit(static_argnums=0)
def _from_tree_jit(lay, tree):
  return _scan_layers(
    lay, lambda i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), tree)
  )


def stack_to_tree(stack: StreamedStack) -> Any:
  """The whole stack as a stacked tree (leaves ``[L, ...]``) on the device: for tests, small
  models and reading a gradient sum back. Loads layer by layer."""
  lay = _check_stack(stack, "stack")
  if lay.on_device:
    return stack.handles
  return _to_tree_jit(stack)


@jax.jit
def _to_tree_jit(stack):
  lay = stack.layout

  def body(token, i):
    # The loads read their handles (stream_pass None): on the GPU this program's streamed loads
    # were found one layer behind their prediction (the training programs' were not); it serves
    # tests and small models.
    leaves = jax.tree.leaves(_load_layer(stack, _after(i, token), None))
    return _token32(leaves), leaves

  rows = jnp.arange(lay.num_layers, dtype=jnp.int32)
  _, leaves = jax.lax.scan(body, jnp.zeros((1,), jnp.float32), rows)
  return jax.tree.unflatten(lay.treedef, leaves)


def map_stack(
  fn: Callable[..., Any], *stacks: StreamedStack, kind: str | None = None, in_place: bool = False
):
  """``fn`` layer by layer over stacks of equal depth; its results stored as a new stack where
  the first lives. ``fn(*layers) -> layer``: one layer of each stack in, one layer's tree out. The
  update path: ``params = map_stack(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)``
  reads each layer's bfloat16 parameters and float32 gradient sum and writes the new bfloat16
  copy straight back to the store (the device holds one layer). A result shaped like the first
  stack keeps its kind and sites (``kind`` names another). Call it under ``jax.jit`` or not.

  ``in_place``: each layer's loads are its entries' last: the engine releases the input stacks'
  entries as the layers are read, so that the store holds one version of the parameters instead
  of two. The input stacks are then gone (using them again raises), and an update that fails
  part way leaves no consistent state: resume from a checkpoint. Default ``False``: the new stack
  is written beside the inputs, which stay whole until no live array holds their handles."""
  if not stacks:
    raise TypeError("map_stack: expected at least one StreamedStack")
  _check_bool(in_place, "in_place")
  lays = [_check_stack(s, f"stacks[{k}]") for k, s in enumerate(stacks)]
  first = lays[0]
  for k, lay in enumerate(lays[1:], 1):
    if lay.num_layers != first.num_layers:
      raise ValueError(
        f"map_stack: stacks[{k}] has {lay.num_layers} layers, stacks[0] {first.num_layers}: "
        "they must agree"
      )
  layer = jax.eval_shape(fn, *[lay.layer_struct() for lay in lays])
  out_kind = kind or first.kind
  lay = _make_layout(layer, first.num_layers, first.location, out_kind, "map_stack's fn result")
  if kind is None and (lay.treedef, lay.shapes, lay.dtypes) != (
    first.treedef,
    first.shapes,
    first.dtypes,
  ):
    lay = _make_layout(layer, first.num_layers, first.location, "mapped", "fn's result")

  return _map_jit(fn, lay, in_place, list(stacks))


@jax.jit(static_argnums=(0, 1, 2))
def _map_jit(fn, lay, in_place, stacks):
  # a pass per stack: the engine follows a pass's loads per site, and stacks of one kind and
  # structure (two parameter stacks) share their sites
  passes = [new_pass(1) for _ in stacks]
  return _scan_layers(
    lay, lambda i: fn(*[_load_layer(s, i, p, consume=in_place) for s, p in zip(stacks, passes)])
  )


def _check_bool(value: Any, what: str) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{what}: expected True or False, got {value!r}")


# ---------------------------------------------------------------------------------------------
# The training micro-step


def value_and_grad_streamed(
  embed_fn: Callable[[Any, Any], Any],
  block_fn: Callable[[Any, Any], Any],
  head_fn: Callable[[Any, Any, Any], Any],
  *,
  save_inputs: Any = "device",
  sum_dtype: Any = jnp.float32,
  sum_location: Any = None,
  in_place: bool = False,
):
  """A micro-step over a model ``head(block_{L-1}(... block_0(embed(batch))))`` whose stack of
  blocks streams: its parameters from the store, its gradients into a running sum in the store.

  ``embed_fn(embed_params, batch) -> x``, ``block_fn(layer_params, x) -> x`` (same shape and
  dtype), ``head_fn(head_params, x, batch) -> loss`` (a scalar). Returns
  ``step(embed_params, stack, head_params, batch, sums=None) -> (loss, sums)``, to call under
  ``jax.jit`` (donate ``sums``): ``stack`` is the blocks' parameters (a :class:`StreamedStack`),
  ``sums`` the running sums of the gradients ``(embed, stack, head)`` (``None`` at the first
  micro-batch of a step: the returned sums are then its gradients). The embedding and head sums
  stay on the device; the stack's is a :class:`StreamedStack` at ``sum_location``: ``None``
  (default) where ``stack`` lives, else ``"device"`` or a store location (the planner's choice
  per class: :func:`jax_ssdtrain.choose_stack_location`).

  ``sum_dtype``: of the sums, float32 (default) or bfloat16 (2 B per parameter instead of 4; each
  micro-batch's sum rounds to it). ``save_inputs``: where each block's input waits for the
  backward pass: ``"device"`` or a store location (``"host"``, ``"nvme"``, ``"host,nvme"``); the
  blocks are recomputed in the backward pass in every case (from those inputs).

  ``in_place``: each load of the old sum is its entries' last: the engine releases them as the
  backward pass reads them, so that the store holds one version of the sum instead of two (4 B
  per parameter less at float32). The sums a step was given are then gone (donate them), and a
  step that fails part way leaves no consistent sum. Default ``False``: the new sum is written
  beside the old one, which a failed step leaves whole.

  Each block's gradient is added to the sum in ``sum_dtype`` (the parameters' gradient converted,
  then added), so that the sum over micro-batches is that of ``jax.grad`` of the same model, up to
  XLA's reassociation; with the stack at ``location="device"`` the same program is the bit-for-bit
  reference of the store's.
  """
  _check_bool(in_place, "in_place")
  sum_dtype = np.dtype(sum_dtype)
  if not jnp.issubdtype(sum_dtype, jnp.floating):
    raise ValueError(f"sum_dtype: expected a floating dtype, got {sum_dtype}")
  sum_loc = None if sum_location is None else _parse_location(sum_location, "sum_location")
  save_loc = Location.parse(save_inputs, what="save_inputs")
  if not (save_loc.in_store or save_loc is Location.DEVICE):
    raise ValueError(
      f"save_inputs: expected 'device', 'host', 'nvme' or 'host,nvme', got {save_inputs!r}"
    )

  input_site = new_site_id()  # the saved inputs' site (counted: one load per entry)

  def step(embed_params, stack, head_params, batch, sums=None):
    lay = _check_stack(stack, "stack")
    sum_lay = _sum_layout(lay, sum_dtype, lay.location if sum_loc is None else sum_loc)
    if sums is not None:
      embed_sum, stack_sum, head_sum = _check_sums(sums, sum_lay, embed_params, head_params)
    num_layers = lay.num_layers

    def save(x):
      if save_loc is Location.DEVICE:
        return x
      return store_p.bind(
        x, site=input_site, tier=TIER_CODES[save_loc], name="layer_stream.input", uses=None
      )[1]

    def restore(saved, like):
      if save_loc is Location.DEVICE:
        return saved
      aval = jax.core.ShapedArray(like.shape, like.dtype)
      return load_p.bind(
        saved, aval=aval, site=input_site, tier=TIER_CODES[save_loc], name="layer_stream.input"
      )

    def block(p, x):
      y = block_fn(p, x)
      if not (hasattr(y, "shape") and y.shape == x.shape and y.dtype == x.dtype):
        got = f"{y.dtype}{list(y.shape)}" if hasattr(y, "shape") else type(y).__name__
        raise ValueError(
          f"block_fn must return an array shaped like its input x ({x.dtype}{list(x.shape)}), "
          f"got {got}"
        )
      return y

    def add(i, g, after=None):
      """Layer ``i``'s gradient into the sum: its new entries (per leaf), and a token of the old
      sum's loads (None without sums) that the next layer's loads wait for (``after``): the
      engine predicts a stack's loads from their order, which XLA would otherwise choose."""
      g = [x.astype(sum_dtype) for x in jax.tree.leaves(g)]
      token = None
      if sums is not None:
        old = _load_layer(stack_sum, i, sum_pass, consume=in_place, after=[after])
        old = jax.tree.leaves(old)
        token = _token(old)
        g = [o.astype(sum_dtype) + x for o, x in zip(old, g)]
      return _store_layer(sum_lay, jax.tree.unflatten(sum_lay.treedef, g), store_pass), token

    x0, embed_vjp = jax.vjp(lambda ep: embed_fn(ep, batch), embed_params)
    # Forward: layer i computes while layer i + 1's parameters load (the carry holds both).
    # the sums' loads and stores go down the layers with the backward pass
    fwd_pass, bwd_pass, sum_pass, store_pass = new_pass(1), new_pass(-1), new_pass(-1), new_pass(-1)
    p = _load_layer(stack, 0, fwd_pass)
    saved = None
    x = x0
    if num_layers > 1:

      def fwd(carry, i):
        x, p = carry
        p_next = _load_layer(stack, _after(i, _token32(jax.tree.leaves(p))) + 1, fwd_pass)
        return (block(p, x), p_next), save(x)

      (x, p), saved = jax.lax.scan(fwd, (x, p), jnp.arange(num_layers - 1, dtype=jnp.int32))
    y, last_vjp = jax.vjp(block, p, x)  # the last layer: its vjp serves the backward pass
    loss, head_vjp = jax.vjp(lambda hp, y: head_fn(hp, y, batch), head_params, y)
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise ValueError(
        f"head_fn must return a floating scalar loss, got {jnp.result_type(loss)}{list(jnp.shape(loss))}"
      )
    g_head, ct = head_vjp(jnp.ones_like(loss))
    # Backward: layer i's gradient into the sum while layer i - 1's parameters load.
    # The backward pass's first parameter load after the forward pass (after ct): it holds one
    # layer less on the device than a load XLA would move up.
    turn_after = ct
    g, ct = last_vjp(ct)
    last, token = add(num_layers - 1, g)
    parts = [[h[None] for h in last]]
    if num_layers > 1:
      # the other layers' stores after this one (ct waits for it): the sums' entries are stored
      # in layer order, which their loads' prediction follows; XLA would move this store
      ct = opaque_copy(ct, *last, effect=False)
      p = _load_layer(stack, num_layers - 2, bwd_pass, after=[turn_after])
      if num_layers > 2:

        def bwd(carry, xs):
          ct, p, token = carry
          i, s = xs
          p_prev = _load_layer(stack, _after(i, _token32(jax.tree.leaves(p))) - 1, bwd_pass)
          x = restore(s, x0)
          _, vjp = jax.vjp(block, p, x)
          g, ct = vjp(ct)
          new, token = add(i, g, after=token)
          return (ct, p_prev, token), new

        rows = jnp.arange(1, num_layers - 1, dtype=jnp.int32)
        (ct, p, token), middle = jax.lax.scan(bwd, (ct, p, token), (rows, saved[1:]), reverse=True)
        parts.insert(0, middle)
      # the first layer's input after the others' (loads of saved inputs come newest first,
      # as the engine predicts them on the GPU; nothing else orders this one after the scan)
      first_input, ct = jax.lax.optimization_barrier((saved[0], ct))
      _, vjp = jax.vjp(block, p, restore(first_input, x0))
      g, ct = vjp(ct)
      first, _ = add(0, g, after=token)
      parts.insert(0, [h[None] for h in first])
    (g_embed,) = embed_vjp(ct)
    new_stack_sum = _stacked(sum_lay, parts)
    cast = lambda t: jax.tree.map(lambda x: x.astype(sum_dtype), t)
    g_embed, g_head = cast(g_embed), cast(g_head)
    if sums is not None:
      g_embed = jax.tree.map(jnp.add, embed_sum, g_embed)
      g_head = jax.tree.map(jnp.add, head_sum, g_head)
    return loss, (g_embed, new_stack_sum, g_head)

  return step


def _sum_layout(lay: _Layout, sum_dtype: np.dtype, location: Location) -> _Layout:
  """The layout of a gradient sum of the stack ``lay`` (its leaves in ``sum_dtype``) at
  ``location``."""
  layer = jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(s, sum_dtype) for s in lay.shapes])
  return _make_layout(layer, lay.num_layers, location, "grad_sum", "stack")


def _check_sums(sums: Any, sum_lay: _Layout, embed_params: Any, head_params: Any):
  if not (isinstance(sums, (tuple, list)) and len(sums) == 3):
    raise TypeError(
      "sums: expected the (embed, stack, head) sums a previous micro-step returned, or None, "
      f"got {type(sums).__name__}"
    )
  embed_sum, stack_sum, head_sum = sums
  lay = _check_stack(stack_sum, "sums[1]")
  if lay != sum_lay:
    mine = f"{lay.num_layers} layers of {[f'{d.name}{list(s)}' for s, d in zip(lay.shapes, lay.dtypes)]} at {lay.location.value!r}"
    want = f"{sum_lay.num_layers} layers of {[f'{d.name}{list(s)}' for s, d in zip(sum_lay.shapes, sum_lay.dtypes)]} at {sum_lay.location.value!r}"
    raise ValueError(
      f"sums[1]: a gradient sum of {mine}, but this stack's (sum_dtype {sum_lay.dtypes[0].name}) "
      f"is {want}"
    )
  for what, s, p in (("sums[0]", embed_sum, embed_params), ("sums[2]", head_sum, head_params)):
    if jax.tree.structure(s) != jax.tree.structure(p) or any(
      np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(p))
    ):
      raise ValueError(f"{what}: its tree or shapes differ from the parameters it sums")
  return embed_sum, stack_sum, head_sum


# ---------------------------------------------------------------------------------------------
# The optimizer update, layer by layer

# Primitives that combine the elements of an array (over more than one element, a number that
# one layer's update cannot compute from that layer alone).
_MIXING = frozenset(
  {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "reduce",
    "argmax",
    "argmin",
    "dot_general",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "top_k",
    "conv_general_dilated",
    "fft",
  }
)
_PROBE_LAYERS = 3  # the stacked probe of tx.init that tells per-parameter leaves from shared ones


@dataclasses.dataclass(frozen=True)
class _OptSpec:
  """How a streamed optimizer state is made (static: the pytree's auxiliary data)."""

  treedef: Any  # of tx.init(one layer)'s state
  per_layer: tuple[bool, ...]  # per state leaf: stored per layer (else shared, on the device)
  master: bool  # a float32 master copy of the parameters is stored with the state
  params: tuple  # the stack's (treedef, shapes, dtypes, num_layers, location)


def _params_key(lay: _Layout) -> tuple:
  return (lay.treedef, lay.shapes, lay.dtypes, lay.num_layers, lay.location)


@jax.tree_util.register_pytree_node_class
class StreamedOptState:
  """An optax state of a :class:`StreamedStack`, made by :func:`init_streamed_optimizer`.

  ``per_layer``: a :class:`StreamedStack` (at the state's location) of each layer's
  per-parameter state leaves (Adam's moments, momentum, ...) and, with master weights, the
  layer's float32 master copy (``per_layer`` layer tree ``{"master": ..., "state": [...]}``).
  ``shared``: the state's small leaves, one for the whole stack, on the device (a step count,
  a schedule's count, injected hyperparameters). A pytree: pass it to ``jax.jit`` and donate it.
  """

  def __init__(self, per_layer: StreamedStack, shared: tuple, spec: _OptSpec):
    self.per_layer = per_layer
    self.shared = tuple(shared)
    self.spec = spec

  def tree_flatten(self):
    return (self.per_layer, self.shared), self.spec

  @classmethod
  def tree_unflatten(cls, spec, children):
    return cls(children[0], children[1], spec)

  @property
  def master_weights(self) -> bool:
    return self.spec.master

  def layer_state(self, per_layer_leaves: list[Any]) -> Any:
    """One layer's optax state from its per-layer leaves and the shared ones."""
    per, shared = iter(per_layer_leaves), iter(self.shared)
    leaves = [next(per) if p else next(shared) for p in self.spec.per_layer]
    return jax.tree.unflatten(self.spec.treedef, leaves)

  def __repr__(self) -> str:
    return (
      f"StreamedOptState({len(self.spec.per_layer)} state leaves, "
      f"{sum(self.spec.per_layer)} per layer, master_weights={self.spec.master}, "
      f"{self.per_layer!r})"
    )


def _check_tx(tx: Any) -> None:
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")


def _opt_params(lay: _Layout, master: bool) -> Any:
  """One layer's tree that ``tx`` updates: the parameters, or their float32 master copy."""
  if not master:
    return lay.layer_struct()
  leaves = [
    jax.ShapeDtypeStruct(s, np.float32 if jnp.issubdtype(d, jnp.floating) else d)
    for s, d in zip(lay.shapes, lay.dtypes)
  ]
  return jax.tree.unflatten(lay.treedef, leaves)


def _mixing_eqns(jaxpr: Any, found: list) -> None:
  """Equations of ``jaxpr`` (and the jaxprs inside it) that combine the elements of an array
  of more than one element."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _MIXING:
      sizes = [int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.invars]
      if max(sizes, default=0) > 1:
        found.append((eqn.primitive.name, [tuple(v.aval.shape) for v in eqn.invars]))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _mixing_eqns(inner, found)


_SPECS: dict = {}  # (tx, layout, master) -> _OptSpec: tracing tx.update once per optimizer


def _opt_spec(tx: Any, lay: _Layout, master: bool) -> _OptSpec:
  try:
    key = (tx, _params_key(lay), master)
    hash(key)
  except TypeError:
    return _make_opt_spec(tx, lay, master)
  if key not in _SPECS:
    _SPECS[key] = _make_opt_spec(tx, lay, master)
  return _SPECS[key]


def _make_opt_spec(tx: Any, lay: _Layout, master: bool) -> _OptSpec:
  """Which leaves of ``tx``'s state are per parameter, once ``tx`` is checked to update each
  parameter from its own gradient, state and value and shared scalars only (else a ValueError
  naming the cause)."""
  params = _opt_params(lay, master)
  one = jax.eval_shape(tx.init, params)
  stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((_PROBE_LAYERS, *s.shape), s.dtype), params)
  many = jax.eval_shape(tx.init, stacked)
  flat, treedef = jax.tree_util.tree_flatten_with_path(one)
  flat_many, treedef_many = jax.tree_util.tree_flatten(many)
  if treedef != treedef_many:
    raise ValueError(
      "tx: its state's structure depends on the parameters' shapes (a per-tensor "
      "transformation such as Adafactor's factored moments), which a layer-by-layer update "
      "cannot keep per layer"
    )
  per_layer = []
  for (path, a), b in zip(flat, flat_many):
    name = jax.tree_util.keystr(path) or "<root>"
    if tuple(b.shape) == tuple(a.shape):
      per_layer.append(False)
    elif tuple(b.shape) == (_PROBE_LAYERS, *a.shape):
      per_layer.append(True)
    else:
      raise ValueError(
        f"tx: state leaf {name} ({a.dtype}{list(a.shape)} for one layer) is neither per "
        "parameter nor shared by all of them (a per-tensor transformation, such as Adafactor's "
        "factored moments): a layer-by-layer update cannot keep it per layer"
      )
  grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), lay.layer_struct())
  try:
    jaxpr = jax.make_jaxpr(lambda g, st, p: tx.update(g, st, p))(grads, one, params)
  except TypeError as err:
    raise ValueError(f"tx: its update of one layer's gradients does not trace: {err}") from err
  found: list = []
  _mixing_eqns(jaxpr.jaxpr, found)
  if found:
    prim, shapes = found[0]
    raise ValueError(
      f"tx: its update combines the elements of the gradients or parameters ({prim} over "
      f"{', '.join(str(list(s)) for s in shapes)}; {len(found)} such operation(s)), a number "
      "over all the parameters (optax.clip_by_global_norm's norm) or over a tensor (a trust "
      "ratio, Adafactor's factored moments) that a layer-by-layer update cannot compute from "
      "one layer. Only transformations that update each parameter from its own gradient, state "
      "and value and shared scalars stream exactly (adam, adamw, sgd, lion, rmsprop, schedules). "
      "For global-norm clipping, remove optax.clip_by_global_norm from tx and pass "
      "clip_global_norm=max_norm to apply_streamed_update (it computes the norm over the stack "
      "first, layer by layer)"
    )
  return _OptSpec(treedef, tuple(per_layer), master, _params_key(lay))


def _opt_layout(spec: _OptSpec, lay: _Layout, one_state: Any, location: Location) -> _Layout:
  leaves = jax.tree.leaves(one_state)
  layer = {"state": [x for x, p in zip(leaves, spec.per_layer) if p]}
  if spec.master:
    layer["master"] = _opt_params(lay, True)
  return _make_layout(layer, lay.num_layers, location, "opt_state", "tx's state")


def init_streamed_optimizer(
  tx: Any, stack: StreamedStack, *, master_weights: bool | None = None, location: Any = None
) -> StreamedOptState:
  """The optax state of ``tx`` for a streamed stack, made layer by layer at ``location``
  (``None``, the default: where the stack lives; else ``"device"`` or a store location).

  Each layer's state is ``tx.init`` of that layer's parameters (with ``master_weights``, of
  their float32 master copy, which is stored per layer with the state); its per-parameter
  leaves (Adam's moments, ...) are stored per layer, as a :class:`StreamedStack`'s, and its
  small shared leaves (a step count, a schedule's) are kept once, on the device: one count for
  the whole stack, as optax keeps for a whole tree. ``master_weights``: ``None`` (default) keeps
  a master copy where the stack has floating-point leaves narrower than float32 (bfloat16).
  Initialise the stack in float32 to start the master copy from full-precision values, then
  cast it (``map_stack(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), stack,
  kind="params")``): the update writes the parameters as the master copy in their dtype.

  ``tx`` must update each parameter from its own gradient, state and value and shared scalars
  (adam, adamw, sgd with momentum, lion, rmsprop, with schedules); one that needs a number over
  all the parameters or a tensor (``clip_by_global_norm``, trust ratios, Adafactor) is refused
  with the cause (global-norm clipping: ``apply_streamed_update(clip_global_norm=...)``).
  Pure: ``jax.eval_shape`` of it gives the state's structure.

  A stack whose parameters, master copy, state and gradients' sum (where the stack lives) cannot
  fit the store even updated in place with a bfloat16 sum (the least room:
  :func:`check_streamed_room`) is refused here, before anything is stored, with
  :class:`StreamedRoomError`'s arithmetic; call :func:`check_streamed_room` with the training's
  own settings for the exact peak.
  """
  _check_tx(tx)
  lay = _check_stack(stack, "stack")
  loc = lay.location if location is None else _parse_location(location)
  master_weights = master_weights_of(lay, master_weights)
  check_streamed_room(
    stack,
    tx,
    sum_dtype=jnp.bfloat16,
    master_weights=master_weights,
    in_place=True,
    state_location=loc,
    name="stack",
  )
  spec = _opt_spec(tx, lay, master_weights)
  return _opt_init_jit(tx, spec, loc, stack)


@jax.jit(static_argnums=(0, 1, 2))
def _opt_init_jit(tx, spec, location, stack):
  lay = stack.layout
  one = jax.eval_shape(tx.init, _opt_params(lay, spec.master))
  per_lay = _opt_layout(spec, lay, one, location)

  init_pass = new_pass(1)

  def layer_state(i):
    p = _load_layer(stack, i, init_pass)
    if spec.master:
      p = jax.tree.map(lambda x, s: x.astype(s.dtype), p, _opt_params(lay, True))
    leaves = jax.tree.leaves(tx.init(p))
    out = {"state": [x for x, k in zip(leaves, spec.per_layer) if k]}
    if spec.master:
      out["master"] = p
    return out

  per = _scan_layers(per_lay, layer_state)
  zeros = _zeros(_opt_params(lay, spec.master))  # one layer (its per-layer leaves unused)
  shared = [x for x, k in zip(jax.tree.leaves(tx.init(zeros)), spec.per_layer) if not k]
  return StreamedOptState(per, tuple(shared), spec)


def _zeros(struct: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), struct)


def _check_opt_state(state: Any, lay: _Layout) -> _OptSpec:
  if not isinstance(state, StreamedOptState):
    raise TypeError(
      f"tx_state: expected the StreamedOptState that init_streamed_optimizer made, got "
      f"{type(state).__name__}"
    )
  if state.spec.params != _params_key(lay):
    raise ValueError(
      "tx_state: made for another stack (its layers' structure, shapes, dtypes, depth or "
      "location differ from this stack's)"
    )
  _check_stack(state.per_layer, "tx_state.per_layer")
  return state.spec


def _check_scalar(value: Any, what: str) -> Any:
  if value is None:
    return None
  if jnp.ndim(value) != 0:
    raise ValueError(f"{what}: expected a scalar, got shape {list(jnp.shape(value))}")
  return jnp.asarray(value, jnp.float32)


def _sum_of_squares(stack_sum: StreamedStack, scale: Any) -> Any:
  """The sum over all layers and leaves of ``(x * scale)**2`` in float32: a scan of loads and
  reductions (one layer on the device)."""
  norm_pass = new_pass(1)

  def body(carry, i):
    acc, token = carry
    leaves = jax.tree.leaves(_load_layer(stack_sum, _after(i, token), norm_pass))
    for x in leaves:
      acc = acc + jnp.sum(jnp.square(x.astype(jnp.float32) * scale))
    return (acc, _token32(leaves)), None

  rows = jnp.arange(stack_sum.num_layers, dtype=jnp.int32)
  zero = jnp.zeros((), jnp.float32)
  (total, _), _ = jax.lax.scan(body, (zero, jnp.zeros((1,), jnp.float32)), rows)
  return total


def streamed_global_norm(stack_sum: StreamedStack, side_sums: Any = None, *, scale: Any = 1.0):
  """The global L2 norm of the mean gradients ``scale * sum`` (float32): of a streamed stack's
  gradient sum, computed layer by layer (one pass of loads and reductions), and of
  ``side_sums`` (a pytree on the device: the embedding's and head's sums) with it. Pass it as
  ``global_norm`` to :func:`apply_streamed_update` and :func:`apply_device_update` to clip the
  whole model's gradients by one norm, as ``optax.clip_by_global_norm`` on the whole tree."""
  _check_stack(stack_sum, "stack_sum")
  return _global_norm_jit(stack_sum, side_sums, _check_scalar(scale, "scale"))


@jax.jit
def _global_norm_jit(stack_sum, side_sums, scale):
  total = _sum_of_squares(stack_sum, scale)
  for x in jax.tree.leaves(side_sums):
    total = total + jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32) * scale))
  return jnp.sqrt(total)


def _mean_grad(s: Any, like_dtype: Any, scale: Any) -> Any:
  """A sum's mean (``s * scale`` in the sum's dtype) cast to the parameter's dtype (as
  ``optax.MultiSteps`` and :func:`jax_ssdtrain.accumulate_gradients` hand ``tx`` the mean)."""
  s = jnp.asarray(s)
  return (s * scale.astype(s.dtype)).astype(like_dtype)


def _clip(g: Any, norm: Any, max_norm: Any) -> Any:
  """``optax.clip_by_global_norm``'s arithmetic given the norm."""
  return jax.tree.map(
    lambda t: jnp.where(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm.astype(t.dtype)),
    g,
  )


def apply_streamed_update(
  tx: Any,
  stack: StreamedStack,
  stack_sum: StreamedStack,
  tx_state: StreamedOptState,
  *,
  scale: Any = 1.0,
  clip_global_norm: Any = None,
  global_norm: Any = None,
  in_place: bool = False,
):
  """``tx``'s update of a streamed stack, layer by layer: returns ``(new_stack, new_tx_state)``.

  A ``lax.scan`` over the layers loads layer ``i``'s gradient sum, its optimizer state and master
  copy (or, without master weights, its parameters) while layer ``i - 1`` updates (read ahead
  one layer, as the forward pass); the mean ``sum * scale`` (``scale = 1 / k`` after ``k``
  micro-batches) is cast to the parameters' dtype (as ``optax.MultiSteps`` and
  :func:`jax_ssdtrain.accumulate_gradients` do), ``tx.update`` and ``optax.apply_updates`` run on
  that layer, and the new state, master copy and parameters (the master copy in the
  parameters' dtype) are stored where they were (the parameters where the stack lives, the
  state and master copy at the state's location). The device holds two layers. The shared
  leaves of the state (the step count) advance once for the whole stack. Call it under
  ``jax.jit`` or not; donate the old stack, sum and state.

  ``clip_global_norm``: clip the mean gradients to this global norm as
  ``optax.clip_by_global_norm`` does (keep it out of ``tx``): the norm is ``global_norm`` where
  given (:func:`streamed_global_norm` of the stack's sum and the embedding's and head's: the
  whole model's), else the stack's own, computed first in a pass of loads and reductions.

  ``in_place``: the loads of the old sum, state, master copy and parameters are their entries'
  last, so that the store holds one version of each (with master weights the old parameters
  are read for that alone: 2 bytes a parameter over the link, so that the new ones take their
  room instead of adding theirs to the peak); an update that fails part way then leaves no
  consistent state (see :func:`map_stack`). Otherwise, with master weights, the old parameters
  are not read: sweeps release them once no array holds their handles (donate the stack). The
  results equal the same update with ``location="device"`` bit for bit, and ``tx`` applied to
  the whole stacked tree within XLA's reassociation.
  """
  _check_tx(tx)
  _check_bool(in_place, "in_place")
  lay = _check_stack(stack, "stack")
  spec = _check_opt_state(tx_state, lay)
  if _opt_spec(tx, lay, spec.master) != spec:
    raise ValueError(
      "tx: its state differs from tx_state's (init_streamed_optimizer of another tx)"
    )
  sum_lay = _check_stack(stack_sum, "stack_sum")
  if (sum_lay.treedef, sum_lay.shapes, sum_lay.num_layers) != (
    lay.treedef,
    lay.shapes,
    lay.num_layers,
  ):
    raise ValueError(
      f"stack_sum: a sum of {sum_lay.num_layers} layers whose leaves or shapes differ from the "
      f"stack's ({lay.num_layers} layers)"
    )
  scale = _check_scalar(scale, "scale")
  max_norm = _check_scalar(clip_global_norm, "clip_global_norm")
  norm = _check_scalar(global_norm, "global_norm")
  if norm is not None and max_norm is None:
    raise ValueError("global_norm: given without clip_global_norm")
  return _update_jit(tx, in_place, stack, stack_sum, tx_state, scale, max_norm, norm)


@jax.jit(static_argnums=(0, 1))
def _update_jit(tx, in_place, stack, stack_sum, state, scale, max_norm, norm):
  import optax  # an optional dependency (the demo extra): needed only by the update

  spec, lay, per = state.spec, stack.layout, state.per_layer
  if max_norm is not None and norm is None:
    norm = jnp.sqrt(_sum_of_squares(stack_sum, scale))

  def last_of(tree):
    return _token(jax.tree.leaves(tree)) if _chain_loads() else None

  # a pass per stack read (a sum made by map_stack from the parameters shares their sites)
  sum_pass, state_pass, params_pass, store_pass = (new_pass(1) for _ in range(4))

  def load(i):
    # sum, state (and master copy), parameters: chained (one read order); all after the norm's
    # loads (in_place consumes the sum)
    s = _load_layer(stack_sum, i, sum_pass, consume=in_place, after=[norm])
    st = _load_layer(per, i, state_pass, consume=in_place, after=[last_of(s)])
    p = None
    if not spec.master or in_place:  # in place with master weights: read to release their room
      p = _load_layer(stack, i, params_pass, consume=in_place, after=[last_of(st)])
    return s, st, p

  dtypes = jax.tree.unflatten(lay.treedef, list(lay.dtypes))

  def compute(loaded):
    s, st, p = loaded
    params = st["master"] if spec.master else p
    g = jax.tree.map(lambda x, d: _mean_grad(x, d, scale), s, dtypes)
    if max_norm is not None:
      g = _clip(g, norm, max_norm)
    updates, new = tx.update(g, state.layer_state(st["state"]), params)
    new_params = optax.apply_updates(params, updates)
    leaves = jax.tree.leaves(new)
    if len(leaves) != len(spec.per_layer):
      raise ValueError("tx: its update changed the state's structure")
    out = {"state": [x for x, k in zip(leaves, spec.per_layer) if k]}
    shared = tuple(x for x, k in zip(leaves, spec.per_layer) if not k)
    if spec.master:
      out["master"] = new_params
      new_params = jax.tree.map(lambda m, d: m.astype(d), new_params, dtypes)
    return new_params, out, shared

  parts_p, parts_st = [], []
  loaded = load(0)
  if lay.num_layers > 1:

    def body(carry, i):
      cur, token = carry
      # layer i + 1's loads after layer i's, and its stores (next iteration) after layer i's
      nxt = load(_after(i, _token32(jax.tree.leaves(cur)), token) + 1)
      new_p, new_st, _ = compute(cur)
      stored = (_store_layer(lay, new_p, store_pass), _store_layer(per.layout, new_st, store_pass))
      return (nxt, _token32(jax.tree.leaves(stored))), stored

    rows = jnp.arange(lay.num_layers - 1, dtype=jnp.int32)
    start = (loaded, jnp.zeros((1,), jnp.float32))
    (loaded, _), (rows_p, rows_st) = jax.lax.scan(body, start, rows)
    parts_p.append(rows_p)
    parts_st.append(rows_st)
  new_p, new_st, shared = compute(loaded)
  parts_p.append([h[None] for h in _store_layer(lay, new_p, store_pass)])
  parts_st.append([h[None] for h in _store_layer(per.layout, new_st, store_pass)])
  for old, new in zip(state.shared, shared):
    if jnp.shape(old) != jnp.shape(new) or jnp.result_type(old) != jnp.result_type(new):
      raise ValueError("tx: its update changed a shared state leaf's shape or dtype")
  new_state = StreamedOptState(_stacked(per.layout, parts_st), shared, spec)
  return _stacked(lay, parts_p), new_state


def apply_device_update(
  tx: Any,
  params: Any,
  sums: Any,
  state: Any,
  *,
  scale: Any = 1.0,
  clip_global_norm: Any = None,
  global_norm: Any = None,
):
  """The same update of parameters on the device (the embedding's and head's), with
  ``tx``'s ordinary state (``tx.init(params)``): the mean ``sums * scale`` cast to each
  parameter's dtype, clipped as :func:`apply_streamed_update` clips (``global_norm``: the whole
  model's, from :func:`streamed_global_norm`; else these sums' own), ``tx.update`` and
  ``optax.apply_updates``. Returns ``(new_params, new_state)``. Called once per update with the
  streamed stack's, its step count advances with the stack's (both start at 0)."""
  import optax  # an optional dependency (the demo extra): needed only by this function

  _check_tx(tx)
  scale = _check_scalar(scale, "scale")
  max_norm = _check_scalar(clip_global_norm, "clip_global_norm")
  norm = _check_scalar(global_norm, "global_norm")
  if norm is not None and max_norm is None:
    raise ValueError("global_norm: given without clip_global_norm")
  g = jax.tree.map(lambda s, p: _mean_grad(s, jnp.result_type(p), scale), sums, params)
  if max_norm is not None:
    if norm is None:
      norm = jnp.sqrt(
        sum(
          jnp.sum(jnp.square(jnp.asarray(s).astype(jnp.float32) * scale))
          for s in jax.tree.leaves(sums)
        )
      )
    g = _clip(g, norm, max_norm)
  updates, state = tx.update(g, state, params)
  return optax.apply_updates(params, updates), state


# ---------------------------------------------------------------------------------------------
# The room a streamed model needs in the store: refused before its first step where it does not
# fit (issue 35, must-have 5)


_ENTRY_ALIGN = 4096  # the engine rounds each entry up to this (xla_ffi/src/config.h: kAlign)


class StreamedRoomError(ValueError):
  """A streamed stack (its parameters, master copy, optimizer state and gradient sum) needs
  more room in the store than its location holds: raised by :func:`check_streamed_room` with
  the arithmetic."""


def _dtype_name(d: np.dtype) -> str:
  return np.dtype(d).name


def store_room(location: Location) -> tuple[int, list[str]]:
  """The room ``location`` gives a streamed stack: ``host_tier_bytes`` (``"host"``),
  ``capacity_bytes`` (``"nvme"``; unset: 90% of the store directories' free space, as the store
  takes it when it opens) or both (``"host,nvme"``); with the parts named for messages."""
  cfg = ensure_configured()
  parts, room = [], 0
  if location in (Location.HOST, Location.HOST_NVME):
    parts.append(f"host_tier_bytes {cfg.host_tier_bytes}")
    room += cfg.host_tier_bytes
  if location in (Location.NVME, Location.HOST_NVME):
    files = cfg.capacity_bytes
    if files is None:
      files = int(0.9 * free_bytes_total(store_directories()))
      parts.append(f"capacity_bytes {files} (90% of the store directories' free space)")
    else:
      parts.append(f"capacity_bytes {files}")
    room += files
  return room, parts


STACK_CLASSES = (
  "params",
  "grad_sum",
  "optimizer_state",
)  # the classes of a streamed stack's tensors
# the class each of the message's four parts (parameters, master copy, state, sum) belongs to
_STORED = ("params", "optimizer_state", "optimizer_state", "grad_sum")


def _fits(need: dict, rooms: dict) -> bool:
  """Whether bytes per store location (``need``) fit the rooms (``rooms``: the host tier's and
  the files'): each tier its own classes, and the classes that spill (``host,nvme``) the rest."""
  host, files = need.get(Location.HOST, 0), need.get(Location.NVME, 0)
  spill = need.get(Location.HOST_NVME, 0)
  h, f = rooms.get(Location.HOST, 0), rooms.get(Location.NVME, 0)
  return host <= h and files <= f and host + files + spill <= h + f


def read_ahead_sizes(
  stack: Any,
  tx: Any = None,
  *,
  sum_dtype: Any = jnp.float32,
  master_weights: bool | None = None,
  in_place: bool = False,
  sum_location: Any = None,
  state_location: Any = None,
  layers_ahead: int = 2,
) -> dict:
  """The store's read-ahead budget and each GPU's staging arena that let a streamed stack's
  passes read whole layers ahead: ``{"prefetch_bytes", "staging_bytes"}``, for
  ``ssd.configure`` (the defaults, 1 GiB each, hold a fraction of a large model's layer).

  Per layer, each pass loads from the store what of it lives there: the forward pass the
  parameters, the backward pass the parameters and the old gradient sum, the update the sum,
  the optimizer state and master copy (and the parameters where it reads them: no master copy,
  or ``in_place``). The forward and backward passes read ``layers_ahead`` layers ahead (their
  compute hides the loads); the update one (the link binds it: it computes little). The
  read-ahead into staging takes at most half the arena (the stores of the same step, a layer
  of new sums or of new parameters and state, keep the other half): the arena is twice the
  read-ahead, each rounded up to a MiB. Arguments as :func:`check_streamed_room`'s; a stack
  wholly on the device needs none (zeros)."""
  if isinstance(layers_ahead, bool) or not isinstance(layers_ahead, int) or layers_ahead < 1:
    raise ValueError(f"layers_ahead: expected an integer >= 1, got {layers_ahead!r}")
  lay, sum_dtype, master_weights, where = _room_args(
    stack, tx, sum_dtype, master_weights, in_place, sum_location, state_location
  )
  arithmetic = room_arithmetic(
    lay, tx, sum_dtype, master_weights, in_place, where, "stack", refuse=False
  )
  per_layer = {c: b if where[c].in_store else 0 for c, b in arithmetic["layer_bytes"].items()}
  p, s, m = (per_layer[c] for c in STACK_CLASSES)
  forward, backward = p, p + s
  update = s + m + (p if (not master_weights or in_place) else 0)
  ahead = max(layers_ahead * max(forward, backward), update)
  mib = lambda b: -(-b // (1 << 20)) * (1 << 20)  # noqa: E731
  return dict(prefetch_bytes=mib(ahead), staging_bytes=2 * mib(ahead))


def check_streamed_room(
  stack: Any,
  tx: Any = None,
  *,
  sum_dtype: Any = jnp.float32,
  master_weights: bool | None = None,
  in_place: bool = False,
  sum_location: Any = None,
  state_location: Any = None,
  name: str = "model",
) -> dict:
  """Refuses a streamed stack that does not fit the store, before anything is stored or run.

  ``stack``: a :class:`StreamedStack`, or its structure before it is made (``jax.eval_shape``
  of :func:`init_streamed`: nothing stored). ``tx``: the optax transformation that
  :func:`apply_streamed_update` will run (``None``: no optimizer state); ``master_weights`` as
  :func:`init_streamed_optimizer`'s (``None``: a float32 copy where the parameters are
  narrower); ``sum_dtype`` and ``in_place`` as :func:`value_and_grad_streamed`'s and
  :func:`apply_streamed_update`'s; ``sum_location`` (the gradients' sum) and ``state_location``
  (the optimizer state and master copy): each class's location where it is not the stack's
  (``None``: the stack's).

  Per parameter, the store holds the parameters (bfloat16: 2 B), the master copy (4 B), the
  optimizer state's per-parameter leaves (Adam's moments: 8 B) and the gradients' running sum
  (``sum_dtype``: 4 or 2 B), each class where it lives (a class on the device takes no room in
  the store). Unless ``in_place``, the update writes the new parameters, master copy and state
  beside the old ones at its peak (with master weights the old parameters are not read: they
  stay until swept), and a micro-step the new sum beside the old one. The peak (each entry, a
  layer's leaf, rounded up to the store's 4 KiB alignment; plus one layer of each class: the
  entries in flight; old versions released as soon as no array holds them: ``ssd.collect()``
  after each call) must fit the rooms (``store_room``) at both moments: ``host_tier_bytes``
  (``"host"``), ``capacity_bytes`` (``"nvme"``; where it is not configured, 90% of the store
  directories' free space, as the store takes it when it opens), both for the classes at
  ``"host,nvme"`` (what the others leave). Where it does not, raises :class:`StreamedRoomError`
  with the arithmetic. Returns the arithmetic (a dict: bytes per parameter per class, each
  class's location, the peak and the room) where it fits; with every class on the device the
  store holds nothing (``room_bytes`` ``None``). The activations saved in the store
  (``save_inputs``, policies) come on top of it."""
  lay, sum_dtype, master_weights, where = _room_args(
    stack, tx, sum_dtype, master_weights, in_place, sum_location, state_location
  )
  return room_arithmetic(lay, tx, sum_dtype, master_weights, in_place, where, name)


def _room_args(stack, tx, sum_dtype, master_weights, in_place, sum_location, state_location):
  """:func:`check_streamed_room`'s arguments checked: ``(layout, sum dtype, master weights,
  each class's location)``."""
  lay = _check_stack(stack, "stack")
  _check_bool(in_place, "in_place")
  sum_dtype = np.dtype(sum_dtype)
  if not jnp.issubdtype(sum_dtype, jnp.floating):
    raise ValueError(f"sum_dtype: expected a floating dtype, got {sum_dtype}")
  if tx is not None:
    _check_tx(tx)
  master_weights = master_weights_of(lay, master_weights)
  return lay, sum_dtype, master_weights, _class_locations(lay, sum_location, state_location)


def room_arithmetic(
  lay: _Layout,
  tx: Any,
  sum_dtype: np.dtype,
  master_weights: bool,
  in_place: bool,
  where: dict,
  name: str,
  refuse: bool = True,
  activation_bytes: int = 0,
) -> dict:
  """:func:`check_streamed_room`'s arithmetic for a stack's layout (its location aside) with
  each class at ``where[class]`` (a :class:`Location` per name of ``STACK_CLASSES``): the planner
  weighs placements of a stack not yet made with it. ``refuse=False``: returns the arithmetic
  with ``fits`` instead of raising where it does not fit. ``activation_bytes``: the layer inputs
  a micro-step saves (``save_inputs``), at ``where["activations"]`` during a micro-step."""
  count = sum(int(np.prod(s)) for s in lay.shapes) * lay.num_layers  # parameters
  L = lay.num_layers

  def entries(arrays) -> tuple[int, int]:
    """Bytes of one layer's entries for ``(size, itemsize)`` arrays, times the layers: as
    they are, and as the store holds them (each entry rounded up to its 4 KiB alignment)."""
    raw = sum(n * b for n, b in arrays)
    return raw * L, sum(-(-(n * b) // _ENTRY_ALIGN) * _ENTRY_ALIGN for n, b in arrays) * L

  sizes = [int(np.prod(s)) for s in lay.shapes]
  params = entries([(n, d.itemsize) for n, d in zip(sizes, lay.dtypes)])
  master = (0, 0)
  if master_weights:
    master = entries(
      [(n, 4 if jnp.issubdtype(d, jnp.floating) else d.itemsize) for n, d in zip(sizes, lay.dtypes)]
    )
  state, state_what = (0, 0), "none"
  if tx is not None:
    spec = _opt_spec(tx, lay, master_weights)
    one = jax.eval_shape(tx.init, _opt_params(lay, master_weights))
    state = entries(
      [
        (int(np.prod(x.shape)), np.dtype(x.dtype).itemsize)
        for x, k in zip(jax.tree.leaves(one), spec.per_layer)
        if k
      ]
    )
    state_what = f"{sum(spec.per_layer)} arrays per layer of {len(lay.shapes)} parameter arrays"
  grad_sum = entries([(n, sum_dtype.itemsize) for n in sizes])
  (params, params_held), (master, master_held) = params, master
  (state, state_held), (grad_sum, sum_held) = state, grad_sum
  # bytes each class holds in the store: resident, at a micro-step's peak, at the update's
  twice = 1 if in_place else 2
  held = dict(params=params_held, grad_sum=sum_held, optimizer_state=master_held + state_held)
  moments = dict(
    micro=dict(held, grad_sum=sum_held * twice),
    update=dict(held, params=params_held * twice, optimizer_state=held["optimizer_state"] * twice),
  )
  if activation_bytes:
    moments["micro"]["activations"] = activation_bytes  # released at their loads

  def by_location(per_class: dict) -> dict:
    out: dict = {}
    for c, b in per_class.items():
      if where[c].in_store:
        out[where[c]] = out.get(where[c], 0) + b + held.get(c, 0) // L  # one layer in flight
    return out

  stored = lambda per_class: sum(b for c, b in per_class.items() if where[c].in_store)  # noqa: E731
  resident = stored(held)
  micro_peak, update_peak = stored(moments["micro"]), stored(moments["update"])
  peak = max(micro_peak, update_peak) + resident // L  # one layer in flight
  per = lambda b: b / count  # noqa: E731 - bytes per parameter
  out = dict(
    parameters=count,
    num_layers=lay.num_layers,
    location=lay.location.value,
    locations={c: loc.value for c, loc in where.items()},
    bytes_per_parameter=dict(
      params=per(params), master=per(master), optimizer_state=per(state), grad_sum=per(grad_sum)
    ),
    # one layer's bytes per class (the optimizer state's with the master copy), unaligned
    layer_bytes=dict(
      params=params // L, grad_sum=grad_sum // L, optimizer_state=(master + state) // L
    ),
    resident_bytes=resident,
    micro_step_peak_bytes=micro_peak,
    update_peak_bytes=update_peak,
    peak_bytes=peak,
    room_bytes=None,
    in_place=in_place,
  )
  used = {where[c] for c in moments["micro"] if where[c].in_store}
  out["fits"], out["room_parts"] = True, []
  if not used:
    return out
  tiers = set()
  for loc in used:
    tiers |= {Location.HOST, Location.NVME} if loc is Location.HOST_NVME else {loc}
  rooms, parts = {}, []
  for tier in (Location.HOST, Location.NVME):
    if tier in tiers:
      rooms[tier], named = store_room(tier)
      parts += named
  room = sum(rooms.values())
  out["room_bytes"], out["room_parts"] = room, parts
  need = {m: by_location(moments[m]) for m in moments}
  out["fits"] = all(_fits(n, rooms) for n in need.values())
  if out["fits"] or not refuse:
    return out
  GB = 1e9
  p = out["bytes_per_parameter"]
  apart = len({where[c] for c in STACK_CLASSES}) > 1
  at = lambda c: f" at {where[c].value!r}" if apart else ""  # noqa: E731
  classes = [
    f"parameters {p['params']:g} B ({'/'.join(sorted({_dtype_name(d) for d in lay.dtypes}))})"
    + at("params"),
    f"master copy {p['master']:g} B"
    + ("" if master_weights else " (none)")
    + at("optimizer_state"),
    f"optimizer state {p['optimizer_state']:g} B ({state_what})" + at("optimizer_state"),
    f"gradient sum {p['grad_sum']:g} B ({sum_dtype.name})" + at("grad_sum"),
  ]
  if in_place:
    when = "each new version takes its old one's room (in place)"
  elif update_peak >= micro_peak:
    when = "the update writes the new parameters, master copy and state beside the old"
  else:
    when = "a micro-step writes the new gradient sum beside the old one"
  worst = need["update"] if update_peak >= micro_peak else need["micro"]
  over = [
    f"{loc.value!r} {b} bytes ({b / GB:.3g} GB)"
    for loc, b in sorted(worst.items(), key=lambda kv: kv[0].value)
  ]
  placed = (
    f"location={lay.location.value!r}"
    if not apart
    else "its classes' locations ("
    + ", ".join(f"{c} {where[c].value!r}" for c in STACK_CLASSES)
    + ")"
  )
  hints = ["configure more room (ssd.configure(host_tier_bytes=..., capacity_bytes=...))"]
  if used != {Location.HOST_NVME}:
    hints.append("use location='host,nvme' (the host tier spilling to the files)")
  if not in_place:
    hints.append("in_place=True (one version of the sum, state, master copy and parameters)")
  if sum_dtype.itemsize > 2:
    hints.append("sum_dtype=bfloat16 (2 B per parameter)")
  hints.append("or fewer or narrower layers")
  in_store = [c for c, k in zip(classes, _STORED) if where[k].in_store]  # the parts stored
  stored_bytes = sum(
    b for b, k in zip((params, master, state, grad_sum), _STORED) if where[k].in_store
  )
  raise StreamedRoomError(
    f"{name}: its streamed stack of {lay.num_layers} layers, {count} parameters "
    f"({count / 1e9:.3g}B), does not fit {placed}. Per parameter the "
    f"store holds {', '.join(in_store)} = {per(stored_bytes):g}"
    f" B ({resident / GB:.3g} GB with each entry's alignment); at its "
    f"peak {when}: {per(peak):.4g} B per parameter with one layer in flight, {peak} bytes "
    f"({peak / GB:.3g} GB)"
    + (f", by location {', '.join(over)}" if len(worst) > 1 else "")
    + f", more than {' + '.join(parts)} = {room} bytes ({room / GB:.3g} GB). "
    f"Ways out: {'; '.join(hints)}"
  )
