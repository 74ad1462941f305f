"""Trace: ``tx.update`` (or ``tx.init``) traced once to a jaxpr, and that jaxpr as a flat program.

``tx.update`` is traced once, as it is, on the whole trees, and its equations are split, not
rewritten: :class:`Program` is the traced jaxpr with nested jit calls (and custom-derivative
calls: the update is not differentiated) expanded in place, each call with its own variables,
so that the plan (``plan.py``) sees primitives. A ``cond`` that the plan finds decided before
any stored state is read is expanded here too: both branches run and a ``select_n`` picks (the
same values). :func:`eval_eqn` runs one equation of it; the stream (``stream.py``) runs the
device part and each group with it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError

if TYPE_CHECKING:
  from jax_ssdtrain._src.optimizer.layout import Layout
  from jax_ssdtrain._src.optimizer.state import OffloadedState


@dataclasses.dataclass
class Traced:
  """A traced ``tx`` function and the values of its inputs.

  ``in_values``: one per input of ``closed`` (None for a stored leaf, which the groups load);
  ``first_state_in``: the index of the state's first leaf among the inputs (None for init);
  ``n_updates``: the outputs before the state's (the updates; 0 for init); ``updates_tree``:
  the structure of the updates ``tx`` returns (lookahead's differs from the gradients')."""

  closed: Any
  in_values: list[Any]
  first_state_in: int | None
  n_updates: int
  updates_tree: Any = None


def trace_update(fn, updates, params, state: OffloadedState, layout: Layout, name: str) -> Traced:
  """``fn(updates, tx_state, params)`` traced on the whole trees, the state's leaves abstract."""
  leaves = layout.leaves
  state_avals = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]

  updates_tree = []  # the structure of the updates tx returns (lookahead's differs from g's)

  def traced(updates, state_leaves, params):
    new_updates, new_state = fn(updates, layout.treedef.unflatten(state_leaves), params)
    updates_tree.append(jax.tree_util.tree_structure(new_updates))
    new_leaves, treedef = jax.tree_util.tree_flatten(new_state)
    if treedef != layout.treedef:
      raise OptimizerOffloadError(
        f"{name}: update returned a state of another structure than init made "
        f"({treedef} against {layout.treedef})"
      )
    return jax.tree_util.tree_leaves(new_updates), new_leaves

  closed = jax.make_jaxpr(traced)(updates, state_avals, params)
  flat_updates = jax.tree_util.tree_leaves(updates)
  device_leaves = iter(state.device)
  state_values = [None if leaf.stored else next(device_leaves) for leaf in leaves]
  in_values = flat_updates + state_values + jax.tree_util.tree_leaves(params)
  n_updates = len(closed.jaxpr.outvars) - len(leaves)
  return Traced(closed, in_values, len(flat_updates), n_updates, updates_tree[0])


def trace_init(fn, params) -> Traced:
  """``fn(params)`` (``tx.init``) traced, its state's leaves the outputs."""
  closed = jax.make_jaxpr(lambda p: jax.tree_util.tree_leaves(fn(p)))(params)
  return Traced(closed, jax.tree_util.tree_leaves(params), None, 0)


@dataclasses.dataclass
class Eqn:
  primitive: Any  # None: an alias (outvars[0] = invars[0])
  params: dict
  invars: list[Any]
  outvars: list[Any]
  origin: Any = None  # the traced equation this one comes from (its source, for messages)


@dataclasses.dataclass
class Program:
  invars: list[Any]
  outvars: list[Any]
  eqns: list[Eqn]
  consts: dict[Any, Any]

  @classmethod
  def inline(cls, closed, expand: frozenset = frozenset()) -> Program:
    """``closed`` with nested jit calls (and custom-derivative calls: the update is not
    differentiated) expanded in place, so that the plan sees primitives. Each ``cond`` equation
    in ``expand`` (ids of traced equations) becomes its branches, each run, and a ``select_n``
    of their results by its index: the same values, for a condition the plan found decided
    before any stored state is read, whose branches would otherwise join the state of every
    parameter they touch into one group."""
    prog = cls(list(closed.jaxpr.invars), list(closed.jaxpr.outvars), [], {})
    prog.consts.update(zip(closed.jaxpr.constvars, closed.consts))
    prog._add(closed.jaxpr, {}, None, expand)
    return prog

  def _add(self, jaxpr, rename: dict, scoped: dict | None, expand: frozenset) -> None:
    """Appends ``jaxpr``'s equations. ``rename``: its inputs' outer values. ``scoped`` (None at
    the top level): this inlining's own variables, so that one body inlined twice (a cached
    trace called twice, e.g. a bias correction for each moment) keeps its values apart."""

    def key(v):
      if not is_var(v) or isinstance(v, ji.DropVar):
        return v
      if v in rename:
        return rename[v]
      return v if scoped is None else scoped.setdefault(v, _Scoped(v))

    for eqn in jaxpr.eqns:
      inner = ji.called_jaxpr(eqn)
      if inner is not None:
        results = self._inline_body(inner, [key(v) for v in eqn.invars], expand)
        for out, res in zip(eqn.outvars, results):
          if not isinstance(out, ji.DropVar):
            self.eqns.append(Eqn(None, {}, [res], [key(out)], eqn))
        continue
      if id(eqn) in expand:
        index, *operands = [key(v) for v in eqn.invars]
        results = [self._inline_body(b, operands, expand) for b in ji.cond_branches(eqn)]
        for k, out in enumerate(eqn.outvars):
          if not isinstance(out, ji.DropVar):
            cases = [r[k] for r in results]
            self.eqns.append(Eqn(ji.select_n_p, {}, [index, *cases], [key(out)], eqn))
        continue
      self.eqns.append(
        Eqn(
          eqn.primitive,
          eqn.params,
          [key(v) for v in eqn.invars],
          [key(v) for v in eqn.outvars],
          eqn,
        )
      )

  def _inline_body(self, closed, args: list[Any], expand: frozenset) -> list[Any]:
    """Appends ``closed``'s equations with its inputs bound to ``args`` (outer values), in a
    scope of its own; returns the values of its outputs."""
    body, scope = closed.jaxpr, {}
    rename = dict(zip(body.invars, args))
    for cv, c in zip(body.constvars, closed.consts):
      rename[cv] = scope.setdefault(cv, _Scoped(cv))
      self.consts[rename[cv]] = c
    self._add(body, rename, scope, expand)
    out = []
    for res in body.outvars:
      if is_var(res):
        res = rename[res] if res in rename else scope.setdefault(res, _Scoped(res))
      out.append(res)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _Scoped:
  """A variable of one inlined call (compared by identity: one per variable and inlining)."""

  var: Any

  @property
  def aval(self):
    return self.var.aval


def is_var(v) -> bool:
  """A variable, not a literal."""
  return not isinstance(v, ji.Literal)


def read(env, v):
  """The value of ``v`` in ``env`` (a literal's own value)."""
  return v.val if isinstance(v, ji.Literal) else env[v]


def eval_eqn(eqn: Eqn, env: dict, rows: tuple[int, ...] | None = None) -> None:
  """Runs ``eqn`` on the values in ``env`` and puts its results there. ``rows``: the shape of a
  group's chunk (a ``broadcast_in_dim`` of a scalar then makes a chunk, not the whole leaf, and
  the flattening of a leaf flattens the chunk: ``analyse.elementwise`` allows no other)."""
  invals = [read(env, v) for v in eqn.invars]
  if eqn.primitive is None:
    outs = invals
  elif rows is not None and eqn.primitive.name == "broadcast_in_dim":
    outs = [jax.lax.broadcast_in_dim(invals[0], rows, ())]
  elif rows is not None and eqn.primitive.name == "reshape":  # a chunk flattened (a dot product's)
    outs = [invals[0].reshape(-1)]
  else:
    outs = ji.bind_equation(eqn.primitive, eqn.params, invals)
  for v, x in zip(eqn.outvars, outs):
    if not isinstance(v, ji.DropVar):
      env[v] = x
