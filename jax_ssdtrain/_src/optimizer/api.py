"""The API: ``offload_optimizer``, ``apply_gradients``, ``optimizer_state`` and their checks.

``offload_optimizer(tx)`` is an optax wrapper: it returns a ``GradientTransformationExtraArgs``
whose ``init`` makes the layout (``layout.py``) and stores ``tx.init``'s state chunk by chunk,
and whose ``update`` runs ``tx.update`` through the stream (``stream.py``). It composes as
optax's wrappers do: ``offload_optimizer(optax.MultiSteps(tx, k))`` is built as
``MultiSteps(offload_optimizer(tx), k)``, and ``accumulate_gradients`` wraps its result.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream import (
  StreamedOptState,
  StreamedStack,
  apply_device_update,
  update_stack,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.chunk_io import chunk_io
from jax_ssdtrain._src.optimizer.layout import (
  DEFAULT_CHUNK_BYTES,
  DEFAULT_MIN_BYTES,
  Layout,
  Options,
  auto_location,
  check_room,
  make_layout,
  storable_dtype,
)
from jax_ssdtrain._src.optimizer.rows import describe
from jax_ssdtrain._src.optimizer.state import OffloadedState, check_state
from jax_ssdtrain._src.optimizer.stream import stream


def offload_optimizer(
  tx: Any,
  *,
  location: str | Location = "host",
  min_bytes: int = DEFAULT_MIN_BYTES,
  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
  in_place: bool = False,
  param_shardings: Callable[[Any], Any] | None = None,
):
  """Wraps an optax transformation so that its state lives in the store.

  Args:
    tx: an optax ``GradientTransformation`` (chains, ``masked``, schedules,
      ``clip_by_global_norm``, ...), or anything with optax's ``init``/``update``.
      For gradient accumulation wrap the result: ``accumulate_gradients(offload_optimizer(tx),
      k)`` streams the state once per ``k`` micro-batches (``optax.MultiSteps`` around it
      streams it at every micro-batch).
    location: ``"host"`` (pinned host memory), ``"nvme"`` (the store files) or ``"host,nvme"``
      (the host tier while it has room, then the files); ``"auto"``: chosen by ``init`` from the
      state's size and the store's, by the rule of every ``"auto"`` (the host tier where an
      update's versions fit three quarters of it, else the host tier spilling to the files;
      :func:`~jax_ssdtrain.choose_placement` weighs the device too); ``"device"`` runs the same
      streamed program with the state on the device (a reference: the store's results equal it
      bit for bit).
    min_bytes: state leaves smaller than this stay on the device (scalars always do: a step
      count is read by every parameter's update).
    chunk_bytes: rows of a leaf streamed at once (a leaf is cut along its first axis).
    in_place: the update reads each chunk of the state for the last time and writes the new
      chunk into its room, so the store holds one version of the state instead of two (half
      the host memory or disk: what lets the largest models fit). The state an update was given
      is then gone (donate it to the jitted step; using it again raises), and an update that
      fails part way (a write error, say) leaves no consistent state: resume from a checkpoint.
      Default ``False``: the new version is written beside the old, and a failed update leaves
      the old one intact.
    param_shardings: for ``init`` under ``jit``, whose parameters (tracers) carry no sharding:
      a function of ``init``'s argument (as given, ``nnx.Param`` variables included) returning
      the parameters' NamedShardings (the tree of ``init``'s parameters, or None for none): the
      state is then sharded as for parameters placed so (docs/optimizer.md, "Sharded state").
      Default: the parameters' own shardings.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` runs ``tx``'s operations (its
    results are those of ``location="device"`` bit for bit, and within a few ulps of ``tx`` on
    the device, see docs/optimizer.md, "Exactness"), and whose state is an
    :class:`OffloadedState`.
  """
  import optax  # an optional dependency (the demo extra)

  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")
  if _offloaded(tx):
    raise TypeError(
      "tx: the transformation given is one that offload_optimizer made (or accumulate_gradients "
      "around one): its state is in the store already, and offload_optimizer(offload_optimizer("
      "tx)) would stream only the inner one's handles (none in the store). Call "
      "offload_optimizer once, on the optax transformation itself: offload_optimizer(tx)"
    )
  auto = location == "auto"
  expected = f"location: expected 'host', 'nvme', 'host,nvme', 'auto' or 'device', got {location!r}"
  try:
    loc = Location.HOST if auto else Location.parse(location, what="location")
  except ValueError:
    raise ValueError(expected) from None
  if not loc.in_store and loc is not Location.DEVICE:
    raise ValueError(expected)
  if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
    raise ValueError(f"min_bytes: expected an integer >= 0, got {min_bytes!r}")
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
    raise ValueError(f"chunk_bytes: expected an integer >= 4096, got {chunk_bytes!r}")
  if not isinstance(in_place, bool):
    raise ValueError(f"in_place: expected True or False, got {in_place!r}")
  multi = _multisteps(tx)
  if multi is not None:  # as optax.MultiSteps(offload_optimizer(inner), k): see _multisteps
    inner = offload_optimizer(
      multi._opt,
      location=location,
      min_bytes=min_bytes,
      chunk_bytes=chunk_bytes,
      in_place=in_place,
      param_shardings=param_shardings,
    )
    return optax.MultiSteps(
      inner,
      multi._every_k_schedule,
      use_grad_mean=multi._use_grad_mean,
      should_skip_update_fn=multi._should_skip_update_fn,
      accumulator_dtype=multi._accumulator_dtype,
    ).gradient_transformation()
  opts = Options(location=loc, min_bytes=min_bytes, chunk_bytes=chunk_bytes, in_place=in_place)
  name = _describe(tx)
  warned = []

  def init_fn(params):
    _refuse_stacks(params, "params", "init")
    shardings = param_shardings(params) if param_shardings is not None else None
    params = _plain(params)
    shapes = jax.eval_shape(tx.init, params)
    layout = make_layout(shapes, opts, name, params, shardings)
    if not layout.stores_anything and loc is not Location.DEVICE and not warned:
      warned.append(True)
      warnings.warn(_stores_nothing(layout, name, min_bytes), stacklevel=2)
    where = auto_location(layout) if auto else loc
    if where is not loc:
      layout = dataclasses.replace(layout, location=where)
    check_room(layout, where, name)
    # Under jit: a stored leaf is made and stored chunk by chunk, never whole next to the others.
    # keep_unused: the parameters (which zeros do not read) stay arguments, so that the state is
    # committed to their device as theirs is (as optax's own init's; an uncommitted state made
    # a step jitted with out_shardings, whose outputs are committed, compile twice).
    init = jax.jit(lambda p: stream(tx.init, (p,), layout, None, name)[1], keep_unused=True)
    return init(params)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, OffloadedState):
      raise TypeError(
        f"state: expected the OffloadedState that offload_optimizer(...).init made, got "
        f"{type(state).__name__}"
      )
    _refuse_stacks(updates, "updates", "update")
    _refuse_stacks(params, "params", "update")
    _check_made_for(tx, state, params if params is not None else updates, name)
    fn = lambda g, s, p: tx.update(g, s, p, **extra_args) if extra_args else tx.update(g, s, p)
    return stream(fn, (updates, params), state.layout, state, name)

  def apply_fn(updates, state, params, **extra_args):  # apply_gradients' streamed form
    if not isinstance(state, OffloadedState):
      raise TypeError(
        f"opt_state: expected the OffloadedState that offload_optimizer(...).init made, got "
        f"{type(state).__name__}"
      )
    _refuse_stacks(params, "params", "apply_gradients")
    _refuse_stacks(updates, "grads", "apply_gradients")
    _check_made_for(tx, state, params, name)
    fn = lambda g, s, p: tx.update(g, s, p, **extra_args) if extra_args else tx.update(g, s, p)
    return stream(fn, (updates, params), state.layout, state, name, apply=True)

  update_fn.apply_gradients = apply_fn
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def apply_gradients(tx: Any, grads: Any, opt_state: Any, params: Any, **extra_args):
  """One optimizer step: ``tx.update`` and ``optax.apply_updates``; returns ``(new params, new
  opt_state)``.

  With a transformation made by :func:`offload_optimizer`, the updates of the streamed state are
  added to the parameters inside the stream, chunk by chunk, in place: no array of updates is
  ever whole on the device (4 bytes per float32 parameter less than ``update`` followed by
  ``optax.apply_updates``; donate the parameters to the jitted step, or XLA copies them once).
  The results equal the same call with ``location="device"`` bit for bit, and ``update`` +
  ``apply_updates`` to float32 rounding (XLA fuses the two programs differently: an ulp).
  ``accumulate_gradients(offload_optimizer(tx), k)`` does the same at its k-th micro-step. Any
  other transformation runs as ``update`` + ``apply_updates``.

  With the state of a streamed layer stack (:func:`init_streamed_optimizer`), ``params`` the
  :class:`StreamedStack` and ``grads`` its gradients' running sum (or mean) from
  :func:`value_and_grad_streamed`, it is the stack's update layer by layer: the sum, the state
  and the master copy stream from the store with ``tx`` (any optax transformation, not one of
  :func:`offload_optimizer`'s), and the keyword arguments are ``scale=1 / k`` after ``k``
  micro-batches, ``clip_global_norm``, ``global_norm`` and ``in_place`` (the old entries' loads
  their last: one version of each in the store).

  With parameters on the device and a plain optax state, ``scale``, ``clip_global_norm`` and
  ``global_norm`` mean the same: ``grads`` is a running sum, the update takes its mean
  ``grads * scale`` cast to each parameter's dtype, clipped to ``clip_global_norm`` by
  ``global_norm`` (the whole model's, :func:`streamed_global_norm`, where a stack's gradients
  are part of it) or by its own norm. So one call order serves every kind of parameters.
  """
  import optax  # an optional dependency (the demo extra)

  streamed = getattr(getattr(tx, "update", None), "apply_gradients", None)
  if isinstance(opt_state, StreamedOptState):
    return _apply_to_stack(tx, grads, opt_state, params, extra_args, streamed is not None)
  if streamed is not None:
    return streamed(grads, opt_state, params, **extra_args)
  _refuse_stacks_without_their_state(params, grads, opt_state)
  mean_options = {k: extra_args.pop(k) for k in _MEAN_OPTIONS if k in extra_args}
  if mean_options:
    if extra_args:
      raise TypeError(
        f"apply_gradients: {', '.join(sorted(mean_options))} make grads a running sum to "
        f"average and clip; tx.update's extra arguments ({', '.join(sorted(extra_args))}) are "
        "not passed with them: call tx.update yourself, or drop them"
      )
    return apply_device_update(tx, params, grads, opt_state, **mean_options)
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state


# apply_gradients' options that make grads a running sum of micro-batches' gradients (the mean
# ``grads * scale``, clipped to ``clip_global_norm`` by ``global_norm`` or its own norm), for
# device parameters as for a streamed stack
_MEAN_OPTIONS = ("scale", "clip_global_norm", "global_norm")


_STACK_UPDATE_OPTIONS = ("scale", "clip_global_norm", "global_norm", "in_place")


def _apply_to_stack(
  tx: Any, grads: Any, opt_state: StreamedOptState, params: Any, options: dict, offloaded: bool
):
  """:func:`apply_gradients` of a streamed stack: :func:`update_stack`'s arguments
  (``offloaded``: ``tx`` comes from :func:`offload_optimizer`)."""
  unknown = sorted(set(options) - set(_STACK_UPDATE_OPTIONS))
  if unknown:
    raise TypeError(
      f"apply_gradients: with a streamed stack's state (StreamedOptState) it takes "
      f"the stack's update options {', '.join(_STACK_UPDATE_OPTIONS)}, not "
      f"{', '.join(unknown)} (tx.update's extra arguments do not reach a stack's update)"
    )
  if offloaded:
    raise TypeError(
      "apply_gradients: tx comes from offload_optimizer, whose state is an OffloadedState; a "
      "streamed stack's state (init_streamed_optimizer) is in the store already: pass the optax "
      "transformation itself"
    )
  names = ("params", "grads", "opt_state", "apply_gradients(tx, grads, opt_state, params)")
  return update_stack(tx, params, grads, opt_state, names=names, **options)


def optimizer_state(state: OffloadedState) -> Any:
  """``tx``'s own state, every stored leaf loaded onto the device (for inspection, tests and
  small models: it needs the whole state's device memory). Checkpoints do not need it."""
  check_state(state, "state")
  return jax.jit(_materialize)(state)


def _materialize(state: OffloadedState) -> Any:
  """``tx``'s state tree from ``state``: the device leaves as they are, each stored leaf whole
  on the device (sharded state: on each device its block), through the chunk I/O."""
  layout, device, handles = state.layout, iter(state.device), iter(state.handles)
  io = chunk_io(layout.location)
  leaves = []
  for leaf in layout.leaves:
    if not leaf.stored:
      leaves.append(next(device))
    else:
      leaves.append(io.to_device(leaf, next(handles), layout.mesh))
  return layout.treedef.unflatten(leaves)


def floating_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
  """``dtype`` as a dtype where it is a floating-point one (bfloat16 included), else a
  ValueError naming ``what`` and the value given (for anything ``jnp.dtype`` refuses too)."""
  try:
    out = jnp.dtype(dtype)
  except TypeError:
    out = None
  if out is None or not jnp.issubdtype(out, jnp.floating):
    raise ValueError(f"{what}: expected a floating-point dtype, got {dtype!r}")
  return out


def _stores_nothing(layout: Layout, name: str, min_bytes: int) -> str:
  sized = [leaf for leaf in layout.leaves if storable_dtype(leaf.dtype) and leaf.shape]
  largest = max(sized, key=lambda leaf: leaf.nbytes, default=None)
  biggest = (
    f"the largest is {largest.path}, {largest.nbytes} bytes"
    if largest
    else "its leaves are scalars"
  )
  return (
    f"{name} stores nothing: every leaf of its state is under min_bytes={min_bytes} ({biggest}), "
    "so the whole state stays on the device (state.location says 'device'); lower min_bytes "
    "(offload_optimizer(tx, min_bytes=...)) to stream it"
  )


def _plain(params: Any) -> Any:
  """``params`` with Flax NNX variables replaced by their values (``nnx.as_pure``):
  ``nnx.Optimizer`` hands ``init`` the ``nnx.Param`` variables and ``update`` plain arrays, and
  the state's structure must be the same for both. Other trees are returned as they are."""
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None)
  if variable is None:
    return params
  leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, variable))
  if not any(isinstance(x, variable) for x in leaves):
    return params
  return nnx.as_pure(params)


def _offloaded(tx: Any) -> bool:
  """Whether ``tx`` comes from :func:`offload_optimizer` (or ``accumulate_gradients`` around
  one): its ``update`` carries the streamed ``apply_gradients`` form."""
  return getattr(getattr(tx, "update", None), "apply_gradients", None) is not None


def _refuse_stacks(tree: Any, what: str, where: str) -> None:
  """A TypeError where ``tree`` holds a :class:`StreamedStack`: its leaves are the store's
  handles of a layer stack, not parameters (Adam moments of them would be moments of handles).
  A walk of the tree only: pure, as ``init`` must be under ``jax.eval_shape``."""
  at = _stack_paths(tree)
  if not at:
    return
  raise TypeError(
    f"offload_optimizer(...).{where}: {what} holds a StreamedStack (at {at}): a streamed layer "
    "stack's leaves are its store handles, not parameters, and offload_optimizer does not stream "
    "them. A stack's optimizer state is made by init_streamed_optimizer(tx, stack) with the "
    "optax transformation itself (not offload_optimizer's), and applied by "
    "apply_gradients(tx, grad_sum, stack_state, stack); give offload_optimizer the parameters "
    "that are not in a stack"
  )


def _refuse_stacks_without_their_state(params: Any, grads: Any, opt_state: Any) -> None:
  """A TypeError where the parameters or gradients of a plain optax step hold a
  :class:`StreamedStack`: optax would update its handles as numbers (they would then name no
  entry of the store)."""
  for tree, what in ((params, "params"), (grads, "grads")):
    found = _stack_paths(tree)
    if found:
      raise TypeError(
        f"apply_gradients: {what} holds a StreamedStack (at {found}) but opt_state: a "
        f"{type(opt_state).__name__} is not the StreamedOptState of a stack (tx.init's own "
        "state, of the stacked tree or of the stack's handles, does not stream: tx.update would "
        "update the stack's store handles as numbers). Make the stack's state with "
        "init_streamed_optimizer(tx, params) and call apply_gradients(tx, grad_sum, "
        "stack_state, stack) for the stack, and apply_gradients(tx, grads, state, params) for "
        "the parameters that are not in a stack"
      )


def _stack_paths(tree: Any) -> str:
  """Where ``tree`` holds a :class:`StreamedStack` (``"<root>"``, ``"['blocks']"``, ...), or an
  empty string."""
  if tree is None:
    return ""
  found = [
    jax.tree_util.keystr(path) or "<root>"
    for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, StreamedStack)
    )[0]
    if isinstance(leaf, StreamedStack)
  ]
  return ", ".join(found[:4]) + (f", ... ({len(found)} stacks)" if len(found) > 4 else "")


def _multisteps(tx: Any) -> Any:
  """The ``optax.MultiSteps`` that ``tx`` is (or whose ``gradient_transformation()`` it is), or
  None. ``offload_optimizer(MultiSteps(inner, k))`` is built as ``MultiSteps(offload_optimizer(
  inner), k)``: the same results and the same store traffic, the accumulator on the device
  (streaming MultiSteps' own update would store the accumulator and read the state of every
  parameter in one lax.cond). It reads MultiSteps' constructor arguments back from its private
  attributes (optax 0.2: ``_opt``, ``_every_k_schedule``, ``_use_grad_mean``,
  ``_should_skip_update_fn``, ``_accumulator_dtype``)."""
  import optax  # an optional dependency (the demo extra)

  multi = tx if isinstance(tx, optax.MultiSteps) else getattr(tx.init, "__self__", None)
  if not isinstance(multi, optax.MultiSteps):
    return None
  needed = ("_opt", "_every_k_schedule", "_use_grad_mean", "_should_skip_update_fn")
  if not all(hasattr(multi, a) for a in needed + ("_accumulator_dtype",)):
    raise OptimizerOffloadError(
      "offload_optimizer(optax.MultiSteps(tx, k)): this optax's MultiSteps does not keep its "
      f"arguments as {needed}; wrap the other way round: optax.MultiSteps(offload_optimizer(tx), "
      "k), or jax_ssdtrain.accumulate_gradients(offload_optimizer(tx), k)"
    )
  return multi


def _check_made_for(tx: Any, state: OffloadedState, params: Any, name: str) -> None:
  """Raises OptimizerOffloadError unless ``state`` has the tree structure and leaf shapes that
  ``tx.init`` makes for ``params`` (a state of another optimizer, or of another model)."""
  want = jax.eval_shape(tx.init, params)
  layout = state.layout
  got_shapes = [leaf.shape for leaf in layout.leaves]
  want_leaves, want_def = jax.tree_util.tree_flatten(want)
  if want_def == layout.treedef and got_shapes == [tuple(x.shape) for x in want_leaves]:
    return

  def describe(paths_shapes):
    items = [f"{p}{list(sh)}" for p, sh in paths_shapes]
    return ", ".join(items[:6]) + (f", ... ({len(items)} leaves)" if len(items) > 6 else "")

  want_paths = [
    (jax.tree_util.keystr(p), tuple(x.shape))
    for p, x in jax.tree_util.tree_flatten_with_path(want)[0]
  ]
  raise OptimizerOffloadError(
    f"state: this OffloadedState was not made by {name} for these parameters: its layout has "
    f"{describe([(leaf.path, leaf.shape) for leaf in layout.leaves])}, where init would make "
    f"{describe(want_paths)}. Pass the state that this optimizer's init made (a state of "
    "another optimizer, or of another model?)"
  )


def _describe(tx: Any) -> str:
  """A name for ``tx`` in messages (as a streamed stack's: ``rows.describe``)."""
  return describe(tx, "offload_optimizer")
