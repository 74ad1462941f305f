"""What an optax transformation's state of one layer holds, and whether ``tx`` streams at all.

Owns the analysis that :func:`~jax_ssdtrain.init_streamed_optimizer`, the update and the room
arithmetic share (:func:`_opt_spec`, cached per ``tx`` and stack): which leaves of ``tx.init``'s
state of one layer are per parameter (stored per layer) and which are shared scalars (kept once,
on the device), found by probing ``tx.init`` of a stacked layer; and the refusal of a ``tx``
that a layer-by-layer update cannot run exactly: its update reads several parameters' leaves
together or one parameter across its layers (decided by the optimizer's analysis,
``optimizer/rows.py``, as ``offload_optimizer``'s plan decides its groups, with the same
messages), its state's structure depends on the shapes, or it is
:func:`~jax_ssdtrain.offload_optimizer`'s, whose state lives in the store already. Also the
master copy's default (:func:`master_weights_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream.stack import _check_bool, _Layout

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


def _check_tx(tx: Any) -> None:
  """Refuses what is not an optax transformation, and one of ``offload_optimizer`` (by name:
  its state would be an OffloadedState of the stack's handles)."""
  if not _is_tx(tx):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")
  if _offloaded(tx):
    raise TypeError(
      "tx: a transformation of offload_optimizer (or one wrapping it), whose state is an "
      "OffloadedState in the store; a streamed stack's optimizer state is streamed already "
      "(init_streamed_optimizer stores it per layer, at its location=): pass the plain optax "
      "transformation, e.g. init_streamed_optimizer(optax.adam(lr), stack) rather than "
      "init_streamed_optimizer(offload_optimizer(optax.adam(lr)), stack)"
    )


def _is_tx(tx: Any) -> bool:
  return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def _offloaded(tx: Any, depth: int = 0) -> bool:
  """Whether ``tx`` is :func:`~jax_ssdtrain.offload_optimizer`'s transformation or wraps one:
  ``optax.MultiSteps`` (its ``_opt``), or a wrapper whose ``init`` closes over it (``chain``,
  ``accumulate_gradients``). Its ``init`` is ``offload_optimizer``'s local ``init_fn`` (read by
  name: the optimizer package imports this one)."""
  init = getattr(tx, "init", None)
  name = getattr(init, "__qualname__", "")
  if name.startswith("offload_optimizer.<locals>.") and getattr(init, "__module__", "").startswith(
    "jax_ssdtrain."
  ):
    return True
  if depth >= 4:
    return False
  inner = [getattr(getattr(init, "__self__", None), "_opt", None)]
  for cell in getattr(init, "__closure__", None) or ():
    try:
      value = cell.cell_contents
    except ValueError:  # an empty cell
      continue
    many = isinstance(value, (tuple, list)) and not _is_tx(value)  # optax's are NamedTuples
    inner += list(value) if many else [value]
  return any(t is not tx and _is_tx(t) and _offloaded(t, depth + 1) for t in inner)


def _opt_params(lay: _Layout, master: bool) -> Any:
  """One layer's tree that ``tx`` updates: the parameters, or their float32 master copy."""
  if not master:
    return lay.layer_struct()
  leaves = [
    jax.ShapeDtypeStruct(s, np.float32 if jnp.issubdtype(d, jnp.floating) else d)
    for s, d in zip(lay.shapes, lay.dtypes)
  ]
  return jax.tree.unflatten(lay.treedef, leaves)


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
  # Whether each layer's update is tx's: the optimizer's analysis (optimizer/rows.py) of
  # tx.update on the stacked probe, the gradients, parameters and per-layer state streamed
  # (imported here: the optimizer package imports this one).
  from jax_ssdtrain._src.optimizer.rows import check_rows, describe

  grads = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct((_PROBE_LAYERS, *s.shape), s.dtype), lay.layer_struct()
  )
  try:
    check_rows(
      tx.update, grads, many, stacked, tuple(per_layer), describe(tx, "init_streamed_optimizer")
    )
  except TypeError as err:
    raise ValueError(
      f"tx: its update of the stacked layers' gradients does not trace: {err}"
    ) from err
  return _OptSpec(treedef, tuple(per_layer), master, _params_key(lay))


def master_weights_of(lay: _Layout, master_weights: bool | None) -> bool:
  """``master_weights`` checked, or where None its default: a float32 master copy where the
  stack has floating-point leaves narrower than float32."""
  if master_weights is None:
    master_weights = any(jnp.issubdtype(d, jnp.floating) and d.itemsize < 4 for d in lay.dtypes)
  _check_bool(master_weights, "master_weights")
  return master_weights
