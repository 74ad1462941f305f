"""Analyse: which stored leaves each equation of the program reads, and what may run on a chunk.

Pure functions of a :class:`~jax_ssdtrain._src.optimizer.trace.Program` (no store, no device):

* :func:`dependencies`: the equations partitioned by the stored leaves they read (union-find: an
  equation that reads two stored leaves joins their groups; Adam's ``mu`` and ``nu`` of one
  parameter form one group). An equation that reads no stored leaf (a global norm of the
  gradients, a schedule, the step count) is of the *device part*.
* :func:`pull_into_groups`: an elementwise equation of the device part that feeds groups alone
  runs in them (on the chunk in the one group it feeds; a scalar one in each group that uses it),
  so that each group holds the same chain of operations as ``tx``'s own program.
* :func:`elementwise`: whether a group's equations are all elementwise over one shape
  (:data:`ELEMENTWISE`): elementwise operations give the same bits on a slice of rows as on the
  whole, so such a group runs chunk by chunk.
* :func:`cuttable`: a full reduction of one leaf's value to a scalar (a sum, a maximum, a dot
  product of two flattened leaves), which a reduction pass can compute chunk by chunk
  (``plan.two_pass``): the partials of the chunks joined in chunk order.
* :func:`coupling_error`: the refusal of a group that reads the state of several parameters
  together, naming the transformation and the operation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.trace import Eqn, Program, is_var

# Elementwise primitives: on rows [r0, r1) of every operand they give rows [r0, r1) of the result.
ELEMENTWISE = frozenset(
  """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy
  copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
  is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
  reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor""".split()
)


# A full reduction to a scalar and how the partials of its chunks are joined.
PARTIAL_REDUCTIONS = {
  "reduce_sum": "add",
  "reduce_max": "max",
  "reduce_min": "min",
  "dot_general": "add",
}


@dataclasses.dataclass
class Dependencies:
  """The stored leaves behind each value of a program, and the groups they join (union-find over
  the stored leaves' indices)."""

  parent: dict[int, int]
  passed: set[int]  # stored leaves the update returns unchanged
  deps: dict[Any, frozenset[int]]  # var -> the stored leaves it is computed from
  eqn_deps: list[frozenset[int]]  # per equation: the stored leaves it reads

  def find(self, i: int) -> int:
    """The root of ``i``'s group."""
    parent = self.parent
    while parent.setdefault(i, i) != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  def union(self, ids) -> None:
    """Joins the groups of ``ids`` (the smallest root stays)."""
    roots = sorted({self.find(i) for i in ids})
    for r in roots[1:]:
      self.parent[r] = roots[0]


def dependencies(prog: Program, stored_in: dict, stored_out: dict) -> Dependencies:
  """The groups of ``prog``'s stored leaves: ``stored_in`` maps an input var to its stored leaf,
  ``stored_out`` a stored leaf to the var of its new value. Each equation joins the leaves it
  reads, and each new value the leaves it is computed from."""
  passed = {i for i, v in stored_out.items() if is_var(v) and stored_in.get(v) == i}
  deps: dict[Any, frozenset[int]] = {v: frozenset({i}) for v, i in stored_in.items()}
  found = Dependencies({}, passed, deps, [])
  for eqn in prog.eqns:
    d = frozenset().union(*(deps.get(v, frozenset()) for v in eqn.invars if is_var(v)))
    found.union(d)
    for v in eqn.outvars:
      if d:
        deps[v] = d
    found.eqn_deps.append(d)
  for i, v in stored_out.items():
    if i not in passed:
      found.union({i} | deps.get(v, frozenset()) if is_var(v) else {i})
  return found


def pull_into_groups(prog: Program, found: Dependencies, flatten: bool = False) -> list[set[int]]:
  """Per equation, the roots of the groups that run it (empty: the device part runs it).

  An elementwise equation that reads no stored leaf and feeds groups alone runs in them: one on
  the chunk (0.1 * g in Adam's first moment) in the one group it feeds, a scalar one (a bias
  correction 1 - b ** count) in each group that uses it. Then each group holds the same chain
  of operations as tx's own program from its inputs on, and XLA can rewrite it as it rewrites
  tx's (x / s into x * (1 / s), say): the results stay within ulps of tx's. ``flatten`` (the
  reduction pass): a leaf's flattening for a dot product runs in its group too, on the chunk."""
  eqn_deps = found.eqn_deps
  owners: list[set[int]] = [{found.find(next(iter(d)))} if d else set() for d in eqn_deps]
  stored_eqn = [bool(d) for d in eqn_deps]
  consumers: dict[Any, set] = {}
  for k, eqn in enumerate(prog.eqns):
    for v in eqn.invars:
      if is_var(v):
        consumers.setdefault(v, set()).add(k)
  outputs = {v for v in prog.outvars if is_var(v)}
  for k in range(len(prog.eqns) - 1, -1, -1):
    eqn = prog.eqns[k]
    if stored_eqn[k] or any(v in outputs for v in eqn.outvars):
      continue
    if not (pullable(eqn) or (flatten and flattening(eqn))):
      continue
    users = [owners[j] for v in eqn.outvars for j in consumers.get(v, ())]
    if not users or any(not u for u in users):  # the device part needs it too
      continue
    groups_using = set().union(*users)
    scalar = all(tuple(v.aval.shape) == () for v in eqn.outvars)
    if scalar or len(groups_using) == 1:  # a scalar is recomputed by each group that uses it
      owners[k] = groups_using
  return owners


def flattening(eqn: Eqn) -> bool:
  """A ``reshape`` of an array into a vector (``jnp.vdot``'s ``ravel``)."""
  if eqn.primitive is None or eqn.primitive.name != "reshape":
    return False
  shape, out = tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape)
  return len(shape) > 1 and out == (math.prod(shape),)


def pullable(eqn: Eqn) -> bool:
  """An elementwise equation (what a group may run on its chunk, or recompute if scalar)."""
  if eqn.primitive is None or not eqn.outvars:
    return eqn.primitive is None
  name = eqn.primitive.name
  return name in ELEMENTWISE or (name == "broadcast_in_dim" and eqn.invars[0].aval.shape == ())


def elementwise(eqns: list[Eqn], shape: tuple[int, ...], ends: dict | None = None) -> bool:
  """Whether ``eqns`` are all elementwise over ``shape`` (scalars as they are): a group that may
  run on chunks of rows. ``ends``: the outputs of the reduction pass's full reductions, which
  may end such a group (the group then gives each chunk's partial), with the flattening of a
  leaf that a dot product reads (a chunk's rows flattened are a run of the leaf's)."""
  if not shape:
    return False
  ends = ends or {}
  flat = (math.prod(shape),)
  flat_vars = set()
  for e in eqns:
    name = e.primitive.name if e.primitive is not None else None
    if e.outvars and e.outvars[0] in ends:  # a full reduction (cuttable), given per chunk
      if any(
        is_var(v) and (v in ends or tuple(v.aval.shape) not in (shape, flat)) for v in e.invars
      ):
        return False
      continue
    if any(is_var(v) and (v in flat_vars or v in ends) for v in e.invars):
      return False  # a flattened leaf or a partial read by anything but a reduction
    if name == "reshape" and tuple(e.invars[0].aval.shape) == shape:
      if tuple(e.outvars[0].aval.shape) != flat:
        return False
      flat_vars.add(e.outvars[0])
      continue
    if name is None:
      pass
    elif name == "broadcast_in_dim":  # of a scalar only
      if tuple(e.invars[0].aval.shape) != ():
        return False
    elif name not in ELEMENTWISE:
      return False
    for v in list(e.invars) + list(e.outvars):
      if tuple(v.aval.shape) not in ((), shape):
        return False
  return True


def cuttable(eqn: Eqn, deps: dict, leaves) -> bool:
  """A full reduction to a scalar of a value computed from one parameter's stored state (a sum,
  a maximum, a dot product of two vectors: ``jnp.vdot`` of two leaves flattened), which a
  reduction pass computes chunk by chunk (:data:`PARTIAL_REDUCTIONS`)."""
  if eqn.primitive is None or eqn.primitive.name not in PARTIAL_REDUCTIONS or len(eqn.outvars) != 1:
    return False
  if tuple(eqn.outvars[0].aval.shape) != ():
    return False
  read = frozenset().union(*(deps.get(v, frozenset()) for v in eqn.invars if is_var(v)))
  if len({leaves[i].owner for i in read}) != 1:  # none, or several parameters' already
    return False
  if eqn.primitive.name == "dot_general":
    (contract, batch) = eqn.params["dimension_numbers"]
    ranks = [len(v.aval.shape) for v in eqn.invars]
    return ranks == [1, 1] and tuple(map(tuple, contract)) == ((0,), (0,)) and not any(batch)
  ndim = len(eqn.invars[0].aval.shape)
  return ndim > 0 and tuple(sorted(eqn.params["axes"])) == tuple(range(ndim))


def partial_kind(eqn: Eqn) -> str:
  """How the partials of a cuttable reduction's chunks are joined: "add", "max" or "min"."""
  return PARTIAL_REDUCTIONS[eqn.primitive.name]


# What offload_optimizer's refusal of a coupling transformation proposes.
OFFLOAD_FIX = (
  "Keep this transformation's state on the device (apply it outside offload_optimizer, or raise "
  "min_bytes above its leaves), or for gradient accumulation wrap the streamed optimizer: "
  "optax.MultiSteps(offload_optimizer(tx), k) or jax_ssdtrain.accumulate_gradients("
  "offload_optimizer(tx), k)."
)


def coupling_error(
  name: str, eqns, deps: dict, leaves, members: list[int], passes: int = 1, fix: str = OFFLOAD_FIX
):
  """The refusal of a group that reads the state of several parameters together: it names the
  first equation that does (its operation, the transformation and line that traced it) and the
  leaves it reads, then ``fix`` (what the caller proposes). ``passes`` 2: the refusal of a
  two-pass stream (``plan.two_pass``) that does not resolve it."""
  cause, read = None, ()
  for e in eqns:
    d = frozenset().union(*(deps.get(v, frozenset()) for v in e.invars if is_var(v)))
    if len({leaves[i].owner for i in d} - {-1}) > 1:
      cause, read = e, sorted(d)
      break
  read = read or members
  paths = ", ".join(leaves[i].path for i in read[:6]) + (", ..." if len(read) > 6 else "")
  if cause is None:
    what, where = "its update", None
  else:
    what = f"its {cause.primitive.name if cause.primitive else 'copy'} operation"
    # a join of full reductions (a global norm's add of each leaf's reduce_sum): name them
    made = {v: e for e in eqns for v in e.outvars}
    reduced = {
      made[v].primitive.name
      for v in cause.invars
      if is_var(v)
      and v in made
      and made[v].primitive is not None
      and made[v].primitive.name in PARTIAL_REDUCTIONS
    }
    if reduced:
      what += f" (of each parameter's {', '.join(sorted(reduced))})"
    where = ji.equation_origin(cause.origin) if cause.origin is not None else None
  prim = cause.primitive.name if cause is not None and cause.primitive else ""
  scalar = cause is not None and all(
    tuple(getattr(v, "aval", v).shape) == () for v in cause.outvars
  )
  if passes == 2:
    why = (
      "a number built from the stored state of every parameter (a norm, a sum or a dot product "
      "over the whole tree) that feeds every parameter's update, and that cannot be computed in "
      "one reduction pass before the update pass (it needs another such number first, or its "
      "reduction is not a full sum, maximum or dot product of one parameter's state)"
    )
  elif scalar or prim.startswith("reduce") or prim in ("dot_general", "argmax", "argmin"):
    why = (
      "a number built from the stored state of every parameter (a norm, a sum or a dot product "
      "over the whole tree) that feeds every parameter's update: no parameter's state can be "
      "updated before all of it has been read"
    )
  elif prim in ("cond", "while", "switch", "scan"):
    why = (
      "a condition or a loop over the whole state whose outcome depends on the stored state "
      "itself: it cannot be decided one parameter at a time"
    )
  else:
    why = "they cannot be updated one parameter at a time"
  transformation = where.split(".<locals>")[0].split(" (")[0] if where else None
  inner = f"the transformation {transformation!r} ({where}) in " if transformation else ""
  return OptimizerOffloadError(
    f"{inner}{name} cannot be streamed: {what} reads the state of several parameters "
    f"together ({paths}): {why}. {fix}"
  )
