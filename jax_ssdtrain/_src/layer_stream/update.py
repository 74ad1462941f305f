"""The streamed optimizer: an optax transformation's update of a streamed stack, layer by layer.

Owns :class:`StreamedOptState` (the state: per-parameter leaves and the float32 master copy
stored per layer at the state's location, shared scalars such as the step count once on the
device), :func:`init_streamed_optimizer`, :func:`update_stack` (a ``lax.scan`` read ahead
one layer: ``apply_gradients`` with a stack's state, and ``apply_streamed_update``, the name it
replaced), :func:`streamed_global_norm` (a pass of loads and reductions, for global-norm
clipping, which ``tx`` itself cannot do per layer) and :func:`apply_device_update` (the same
update of the parameters on the device, the embedding's and head's, with ``tx``'s ordinary
state). Both apply ``tx`` through one function (:func:`_tx_apply`: the mean of the sums, the
clip, ``tx.update`` and ``optax.apply_updates``), a stack layer by layer, the device parameters
whole, and share the checks of their options and the norm's arithmetic. Which ``tx`` streams
and what its state holds is ``spec.py``'s; the room it needs, ``room.py``'s; every layer's
loads and stores go through ``stack.py`` to ``stored_io.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_ssdtrain._src.layer_stream.room import check_streamed_room
from jax_ssdtrain._src.layer_stream.spec import (
  _check_tx,
  _opt_params,
  _opt_spec,
  _OptSpec,
  _params_key,
  master_weights_of,
)
from jax_ssdtrain._src.layer_stream.stack import (
  StreamedStack,
  _after,
  _chain_loads,
  _check_bool,
  _check_role,
  _check_stack,
  _Layout,
  _load_layer,
  _make_layout,
  _parse_location,
  _scan_layers,
  _stacked,
  _store_layer,
  _token,
  _token32,
  new_pass,
)
from jax_ssdtrain._src.location import Location


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
  lay = _check_stack(stack, "stack", role="params")
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


def _check_opt_state(state: Any, lay: _Layout, what: str = "tx_state") -> _OptSpec:
  if not isinstance(state, StreamedOptState):
    raise TypeError(
      f"{what}: expected the StreamedOptState that init_streamed_optimizer made, got "
      f"{type(state).__name__}: make it with init_streamed_optimizer(tx, stack) (tx.init's own "
      "state, of the stacked tree or of the stack's handles, is not a streamed stack's)"
    )
  if state.spec.params != _params_key(lay):
    raise ValueError(
      f"{what}: made for another stack (its layers' structure, shapes, dtypes, depth or "
      "location differ from this stack's)"
    )
  _check_stack(state.per_layer, f"{what}.per_layer")
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
      acc = acc + _squares(x, scale)
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
  _check_stack(stack_sum, "stack_sum", role="grad_sum")
  return _global_norm_jit(stack_sum, side_sums, _check_scalar(scale, "scale"))


@jax.jit
def _global_norm_jit(stack_sum, side_sums, scale):
  total = _sum_of_squares(stack_sum, scale)
  for x in jax.tree.leaves(side_sums):
    total = total + _squares(x, scale)
  return jnp.sqrt(total)


def _squares(x: Any, scale: Any) -> Any:
  """The sum of ``(x * scale)**2`` in float32: one array's part of the global norm's square."""
  return jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32) * scale))


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


def _check_mean_options(scale: Any, clip_global_norm: Any, global_norm: Any) -> tuple:
  """``(scale, max_norm, norm)`` as float32 scalars (None where not given), checked: the
  options that make the gradients a running sum to average and clip, the stack's and the
  device parameters' alike."""
  scale = _check_scalar(scale, "scale")
  max_norm = _check_scalar(clip_global_norm, "clip_global_norm")
  norm = _check_scalar(global_norm, "global_norm")
  if norm is not None and max_norm is None:
    raise ValueError("global_norm: given without clip_global_norm")
  return scale, max_norm, norm


def _tx_apply(tx: Any, sums: Any, state: Any, params: Any, dtypes: Any, scale, max_norm, norm):
  """One application of ``tx``, to one layer of a stack or to the parameters on the device:
  the mean ``sums * scale`` cast to ``dtypes`` (the parameters' dtypes: a tree like ``sums``),
  clipped by ``norm`` to ``max_norm`` (where given), ``tx.update`` of ``state`` with ``params``
  (the parameters, or their master copy) and ``optax.apply_updates``. Returns
  ``(new params, new state)``."""
  import optax  # an optional dependency (the demo extra): needed only by the update

  g = jax.tree.map(lambda x, d: _mean_grad(x, d, scale), sums, dtypes)
  if max_norm is not None:
    g = _clip(g, norm, max_norm)
  updates, new = tx.update(g, state, params)
  return optax.apply_updates(params, updates), new


def apply_streamed_update(
  tx: Any, stack: StreamedStack, stack_sum: StreamedStack, tx_state: StreamedOptState, **options
):
  """:func:`update_stack` (replaced by ``apply_gradients(tx, stack_sum, tx_state, stack,
  ...)``, the one call order whatever the parameters are)."""
  return update_stack(tx, stack, stack_sum, tx_state, **options)


# the arguments' names in apply_streamed_update's messages: stack, stack_sum, tx_state, the order
_OWN_NAMES = (
  "stack",
  "stack_sum",
  "tx_state",
  "apply_streamed_update(tx, stack, stack_sum, tx_state)",
)


def update_stack(
  tx: Any,
  stack: StreamedStack,
  stack_sum: StreamedStack,
  tx_state: StreamedOptState,
  *,
  scale: Any = 1.0,
  clip_global_norm: Any = None,
  global_norm: Any = None,
  in_place: bool = False,
  names: tuple[str, str, str, str] = _OWN_NAMES,
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

  ``names``: the stack's, the sum's and the state's argument names and the call's order, for the
  errors (:func:`~jax_ssdtrain.apply_gradients` passes its own).
  """
  stack_name, sum_name, state_name, order = names
  _check_tx(tx)
  _check_bool(in_place, "in_place")
  lay = _check_stack(stack, stack_name)
  sum_lay = _check_stack(stack_sum, sum_name)
  _check_role(lay, "params", stack_name, order, other=(sum_name, sum_lay))
  _check_role(sum_lay, "grad_sum", sum_name, order)
  spec = _check_opt_state(tx_state, lay, state_name)
  if _opt_spec(tx, lay, spec.master) != spec:
    raise ValueError(
      f"tx: its state differs from {state_name}'s (init_streamed_optimizer of another tx)"
    )
  if (sum_lay.treedef, sum_lay.shapes, sum_lay.num_layers) != (
    lay.treedef,
    lay.shapes,
    lay.num_layers,
  ):
    raise ValueError(
      f"{sum_name}: a sum of {sum_lay.num_layers} layers whose leaves or shapes differ from "
      f"those of {stack_name} ({lay.num_layers} layers)"
    )
  scale, max_norm, norm = _check_mean_options(scale, clip_global_norm, global_norm)
  return _update_jit(tx, in_place, stack, stack_sum, tx_state, scale, max_norm, norm)


@jax.jit(static_argnums=(0, 1))
def _update_jit(tx, in_place, stack, stack_sum, state, scale, max_norm, norm):
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
    layer_state = state.layer_state(st["state"])
    new_params, new = _tx_apply(tx, s, layer_state, params, dtypes, scale, max_norm, norm)
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
  _check_tx(tx)
  scale, max_norm, norm = _check_mean_options(scale, clip_global_norm, global_norm)
  if max_norm is not None and norm is None:  # these sums' own norm
    norm = jnp.sqrt(sum(_squares(s, scale) for s in jax.tree.leaves(sums)))
  dtypes = jax.tree.map(jnp.result_type, params)
  return _tx_apply(tx, sums, state, params, dtypes, scale, max_norm, norm)
