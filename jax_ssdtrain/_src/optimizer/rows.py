"""Rows: the optimizer's analysis of ``tx`` for an update run row by row (a streamed stack's).

A streamed stack's update (``jax_ssdtrain._src.layer_stream``) runs ``tx.update`` one layer at
a time: each layer is a row of every stacked leaf (the gradients, the parameters and the
per-layer state), and only one layer is on the device. :func:`check_rows` decides whether that
gives ``tx``'s results with the analysis that ``offload_optimizer``'s plan makes
(``trace.py``, ``analyse.py``, ``plan.py``): ``tx.update`` of the stacked tree traced once, its
equations grouped by the stored leaves they read, where the stored leaves are the per-layer
state and, as the stack streams them too, the gradients and the parameters (one row each, a
layer, per chunk). Then:

* a group that reads several parameters' leaves together (a global norm of the gradients, a
  sum over every parameter's state) is refused with ``offload_optimizer``'s message
  (``analyse.coupling_error``), naming the transformation and the operation; unlike
  ``offload_optimizer``, whose gradients are whole on the device (a norm of them is its device
  part) and which can run a reduction pass first (``plan.two_pass``), the stack has one pass;
* a group that reads one parameter's leaves but not elementwise over its rows (a trust ratio, a
  norm of one tensor, Adafactor's factored moments) is refused: one layer alone does not give it;
* so is an array of the stacked shape that the device part makes from no stored leaf (noise
  from a shared random key): each layer's update would make it anew, the same in every layer.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.optimizer.analyse import coupling_error, dependencies, elementwise
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.layout import LeafLayout, owner_of
from jax_ssdtrain._src.optimizer.plan import make_plan
from jax_ssdtrain._src.optimizer.trace import Traced, is_var

# What a streamed stack's refusal of a coupling transformation proposes.
ROWS_FIX = (
  "A streamed stack's update runs one layer at a time and sees only that layer's gradients, "
  "state and parameters: remove that transformation from tx. For global-norm clipping, remove "
  "optax.clip_by_global_norm from tx and pass clip_global_norm=max_norm to apply_gradients (it "
  "computes the norm over the stack first, layer by layer, or takes the whole model's as "
  "global_norm=)."
)


def describe(tx: Any, caller: str) -> str:
  """A name for ``tx`` in messages: optax's factory (``adamw``, ``chain``) where it shows, and
  the function it was given to (``offload_optimizer``, ``init_streamed_optimizer``)."""
  qual = getattr(getattr(tx, "init", None), "__qualname__", "") or type(tx).__name__
  factory = qual.split(".<locals>")[0] if ".<locals>" in qual else qual
  return f"the transformation {factory!r} ({caller}'s tx)"


def check_rows(fn, grads: Any, state: Any, params: Any, per_row: tuple[bool, ...], name: str):
  """Refuses (``OptimizerOffloadError``, a ``ValueError``) an update ``fn(grads, state,
  params)`` that does not run row by row. ``grads``, ``params``: abstract trees whose leaves
  are stacked along their first axis (the rows); ``state``: the abstract state of ``params``
  (``tx.init``'s); ``per_row``: per state leaf, whether it is stacked (per layer) or shared
  (kept whole on the device, a step count); ``name``: ``tx`` in messages."""
  g_flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  p_flat = jax.tree_util.tree_flatten_with_path(params)[0]
  s_flat, s_def = jax.tree_util.tree_flatten_with_path(state)
  rows = g_flat[0][1].shape[0] if g_flat else 1
  bounds = tuple((r, r + 1) for r in range(rows))  # one layer per chunk
  param_paths = [tuple(p) for p, _ in p_flat]

  def leaf(prefix, path, x, owner, stored=True):
    return LeafLayout(
      prefix + jax.tree_util.keystr(path),
      tuple(x.shape),
      x.dtype,
      bounds=bounds if stored else (),
      owner=owner,
    )

  leaves = [leaf("grads", p, x, j) for j, (p, x) in enumerate(g_flat)]
  leaves += [
    leaf("", p, x, owner_of(tuple(p), param_paths), k)
    for (p, x), k in zip(s_flat, per_row, strict=True)
  ]
  leaves += [leaf("params", p, x, j) for j, (p, x) in enumerate(p_flat)]
  n_g, n_s = len(g_flat), len(s_flat)
  g_def = jax.tree_util.tree_structure(grads)
  p_def = jax.tree_util.tree_structure(params)

  def traced(all_leaves):
    g = g_def.unflatten(all_leaves[:n_g])
    st = s_def.unflatten(all_leaves[n_g : n_g + n_s])
    p = p_def.unflatten(all_leaves[n_g + n_s :])
    updates, new_state = fn(g, st, p)
    # the gradients and parameters are returned as they are: leaves the update leaves unchanged
    new = all_leaves[:n_g] + jax.tree_util.tree_leaves(new_state) + all_leaves[n_g + n_s :]
    return jax.tree_util.tree_leaves(updates), new

  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in g_flat + s_flat + p_flat]
  closed = jax.make_jaxpr(traced)(avals)
  n_updates = len(closed.jaxpr.outvars) - len(leaves)
  traced_update = Traced(closed, [None] * len(leaves), 0, n_updates)
  prog, stored_out, plan = make_plan(traced_update, leaves, name, passes=1, fix=ROWS_FIX)
  stored_in = {prog.invars[i]: i for i, lf in enumerate(leaves) if lf.stored}
  found = None
  made = {v: e for e in plan.device_eqns for v in e.outvars}  # the device part's values
  for group in plan.groups:
    members = sorted({i for _, i in group.loads} | set(group.stores))
    if not group.eqns:
      continue
    if len({leaves[i].owner for i in members} - {-1}) > 1:
      found = found or dependencies(prog, stored_in, stored_out)
      raise coupling_error(name, group.eqns, found.deps, leaves, members, fix=ROWS_FIX)
    arrays = [v for v in group.reads if v in made and tuple(v.aval.shape) != ()]
    if arrays:
      raise _device_array_error(name, made[arrays[0]], arrays[0])
    if not group.chunked:
      raise _whole_error(name, group, leaves, members)


def _origin(eqn) -> str:
  where = ji.equation_origin(eqn.origin) if eqn.origin is not None else None
  if not where:
    return ""
  return f"the transformation {where.split('.<locals>')[0].split(' (')[0]!r} ({where}) in "


def _device_array_error(name: str, eqn, var):
  """The refusal of an array of the stacked layers' shape that reads no layer's leaves (random
  noise from a shared key): made per layer, it would be another (the same in every layer)."""
  prim = eqn.primitive.name if eqn.primitive is not None else "copy"
  return OptimizerOffloadError(
    f"{_origin(eqn)}{name} cannot be streamed layer by layer: its {prim} operation makes an "
    f"array of the stacked layers' shape ({list(var.aval.shape)}) from no layer's leaves (noise "
    "from a shared random key, say), which each layer's update would make anew, the same in "
    "every layer: apply that transformation to the parameters kept on the device."
  )


def _whole_error(name: str, group, leaves, members: list[int]):
  """The refusal of a group that reads one parameter's leaves, but not elementwise over the
  layers: its first such equation, the transformation that traced it and the leaves."""
  shape = leaves[members[0]].shape
  cause = next((e for e in group.eqns if not elementwise([e], shape)), None)
  paths = ", ".join(leaves[i].path for i in members[:6]) + (", ..." if len(members) > 6 else "")
  what, inner = "its update", ""
  if cause is not None:
    prim = cause.primitive.name if cause.primitive is not None else "copy"
    shapes = ", ".join(str(list(v.aval.shape)) for v in cause.invars if is_var(v))
    what = f"its {prim} operation (over {shapes})"
    inner = _origin(cause)
  return OptimizerOffloadError(
    f"{inner}{name} cannot be streamed layer by layer: {what} reads one parameter's leaves "
    f"({paths}) across its layers, not layer by layer: a number over a whole tensor (a trust "
    "ratio, a norm of one parameter, Adafactor's factored moments) that one layer alone does "
    "not give. Only transformations that update each element from its own gradient, state and "
    "value and shared scalars stream layer by layer exactly (adam, adamw, sgd, lion, rmsprop, "
    "schedules); apply the others to the parameters kept on the device."
  )
