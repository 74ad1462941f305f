"""Stored I/O: how one stored piece of training state is loaded and stored, for both wings.

A *stored leaf* (:class:`StoredLeaf`: its path, shape, dtype and store site) is kept in the
store piece by piece: a streamed stack's leaf one layer's row at a time (``layer_stream``), an
offloaded optimizer leaf one chunk of rows at a time (``optimizer``, whose ``LeafLayout`` adds
the chunks' bounds and the sharding to it). This module owns what both do with one piece:

* :func:`load` and :func:`store`: the store's primitives (``primitives.load_p`` and
  ``store_p``) bound with their attributes: the leaf's site, the location's tier, the entry's
  name (a prefix naming the wing and the class of state, then the leaf's path), how the load
  finds its entry (``exact``: True reads the handle; ``"ordered"``, chunks loaded in store
  order; a :class:`StreamPass`, a pass over a stack's layers, ``exact="stream"`` with its number
  and direction), ``consume`` (the load is the entry's last) and the store's ``uses``;
* the device reference (``location="device"``): the piece is the value itself, and where the
  store has a load or a store there is a copy XLA cannot see through
  (``primitives.opaque_copy``), so that the arithmetic between them is a region bounded by
  custom calls that XLA compiles alike in both, and the two agree bit for bit;
* the order of loads: :func:`load_next` (a sequence of loads, each after ``after``, and on
  XLA:CPU, which runs independent custom calls in any order, each after the one before it:
  the engine reads ahead in that order), :func:`ordered_after` (a value once other values are
  computed: a data dependency, which orders custom calls on every backend), and the tokens a
  later load waits for (:func:`token_of`, :func:`token`, :func:`token32`).

Which pieces a leaf's handles hold (a stack's ``[L, 2]``, an optimizer leaf's ``[chunks, 2]``,
per device where the state is sharded), the stores' sites, and the passes' order are the wings'.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.location import TIER_CODES, Location
from jax_ssdtrain._src.primitives import load_p, opaque_copy, store_p


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
  """A leaf of state as the store keeps it: ``path`` (messages, and the entries' names),
  ``shape`` and ``dtype`` (a streamed stack's: one layer's; an optimizer leaf's: the whole
  leaf's, cut into chunks of rows), and ``site``, the store site of every piece (the engine
  checks a handle's site on load; -1: a leaf kept on the device)."""

  path: str
  shape: tuple[int, ...]
  dtype: Any
  site: int = -1


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
  """A pass no other pass of a stack's loads and stores uses; the store and load primitives
  check ``direction``."""
  return StreamPass(next(_PASSES), direction)


def chain_loads() -> bool:
  """Whether a sequence of loads is chained, each after the one before (:func:`load_next`):
  XLA:CPU runs independent custom calls in any order; a GPU runs them in its stream's order,
  and a load reads its handle on the host, so that a handle made on the stream after the
  previous load would hold the host until that load's data had crossed the link."""
  return jax.default_backend() == "cpu"


def ordered_after(x: Any, *tokens: Any) -> Any:
  """``x`` once ``tokens`` are computed (they are not read): a copy that XLA cannot see through
  and does not reorder (a data dependency, which orders custom calls on every backend; XLA:CPU
  drops optimization barriers)."""
  return opaque_copy(x, *tokens, effect=False)


def token_of(x: Any) -> list[Any]:
  """What a load that comes after ``x`` waits for: one element of it (none where it is empty)."""
  return [x.reshape(-1)[:1]] if x.size else []


def token(leaves: list[Any]) -> Any:
  """A one-element slice of the last non-empty leaf (what a later load waits for), or None."""
  sized = [x for x in leaves if x.size]
  return sized[-1].reshape(-1)[:1] if sized else None


def token32(leaves: list[Any]) -> Any:
  """:func:`token` as float32[1] (zeros without a non-empty leaf): a scan's carry."""
  t = token(leaves)
  return jnp.zeros((1,), jnp.float32) if t is None else t.astype(jnp.float32)


def load(
  piece: Any,
  leaf: StoredLeaf,
  location: Location,
  prefix: str,
  *,
  shape: tuple[int, ...] | None = None,
  exact: bool | str = True,
  stream: StreamPass | None = None,
  consume: bool = False,
  after: Any = (),
) -> Any:
  """One piece of ``leaf`` (of ``shape``, by default the leaf's) out of ``location``.
  ``piece``: in the store, the piece's handle (uint32[2]); on the device, its value (copied).
  ``prefix`` + the leaf's path is the entry's name. ``exact``: how the load finds its entry
  (True reads its handle; ``"ordered"``: the engine predicts it in store order; False: an
  activation's prediction); ``stream``: the pass over a stack's layers the load belongs to
  (``exact="stream"``); ``consume``: the load is the entry's last (the engine releases it once
  its bytes are copied); ``after``: arrays the load waits for (not read; None entries ignored).
  The device reference needs no order: its ``after`` is not read."""
  if location is Location.DEVICE:  # a copy where the store has a load
    return opaque_copy(piece)
  deps = [a for a in after if a is not None]
  if deps:
    piece = ordered_after(piece, *deps)
  shape = leaf.shape if shape is None else tuple(shape)
  extra: dict[str, Any] = {"consume": True} if consume else {}
  if stream is not None:
    extra |= dict(exact="stream", stream_pass=stream.number, stream_dir=stream.direction)
  elif exact:
    extra |= {"exact": exact}
  aval = jax.core.ShapedArray(shape, np.dtype(leaf.dtype))
  return load_p.bind(
    piece, aval=aval, site=leaf.site, tier=TIER_CODES[location], name=prefix + leaf.path, **extra
  )


def load_next(
  piece: Any, leaf: StoredLeaf, location: Location, prefix: str, *, after: list, given=(), **attrs
) -> tuple[Any, list[Any]]:
  """One load of a sequence (a layer's leaves, a chunk's leaves): :func:`load` of ``piece``
  after ``after`` (what :func:`load_next` returned for the load before it) on XLA:CPU, and after
  ``given`` (what the whole sequence waits for) elsewhere (see :func:`chain_loads`). Returns
  ``(value, after)`` for the sequence's next load; on the device, ``after`` as it was (no
  order)."""
  if location is Location.DEVICE:
    return load(piece, leaf, location, prefix, **attrs), after
  deps = after if chain_loads() else list(given)
  value = load(piece, leaf, location, prefix, after=deps, **attrs)
  return value, token_of(value)


def store(
  x: Any,
  leaf: StoredLeaf,
  location: Location,
  prefix: str,
  *,
  uses: Any,
  stream: StreamPass | None = None,
) -> Any:
  """The handle (uint32[2]) of a new entry holding ``x``, one piece of ``leaf``, in ``location``
  (on the device: ``x``, copied). ``uses``: its loads in this execution
  (``lifetimes.COUNTED_OR_LATER``, ``LATER_IN_ORDER``...); ``stream``: the pass that stores this
  version of a stack (a later pass's streamed loads follow one version's entries)."""
  if location is Location.DEVICE:  # a copy where the store has a store
    return opaque_copy(x)
  extra = {} if stream is None else dict(stream_pass=stream.number, stream_dir=stream.direction)
  return store_p.bind(
    x, site=leaf.site, tier=TIER_CODES[location], name=prefix + leaf.path, uses=uses, **extra
  )[1]
