"""Plan: the device part and the groups of a traced program, and which conditions to expand.

The equations that read no stored leaf (the *device part*) run first, on the device, exactly as
``tx`` would run them; the others form groups (``analyse.py``), each run on its own, one after
the other, loading its leaves and storing the new ones (``stream.py``).

A group whose equations are all elementwise over one shape is *chunked*: it runs chunk by chunk,
on rows ``[r0, r1)`` of every operand of that shape (scalars as they are). Any other group runs
whole (its leaves loaded at once): one parameter's leaves of several shapes (sm3's per-axis
accumulators, adafactor's factored moments, galore's projector). One that reads the state of
several parameters together is split where a ``lax.cond`` decided before any stored state is
read joins them (:func:`make_plan` expands it: both branches run and ``select_n`` picks, see
``Program.inline``), and otherwise refused, naming the transformation and the operation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.optimizer.analyse import (
  OFFLOAD_FIX,
  coupling_error,
  cuttable,
  dependencies,
  elementwise,
  partial_kind,
  pull_into_groups,
)
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.trace import Eqn, Program, Traced, is_var


@dataclasses.dataclass
class Group:
  eqns: list[Eqn]
  loads: list[tuple[Any, int]]  # (var, stored leaf): the stored inputs the group reads
  stores: list[int]  # stored leaves whose new value the group computes
  passed: list[int]  # stored leaves the update returns unchanged
  reads: list[Any]  # device-part vars (and inputs) the group reads
  outputs: list[Any]  # the group's results that stay on the device (updates, small leaves)
  shape: tuple[int, ...]
  chunked: bool
  chunks: tuple[tuple[int, int], ...]
  # apply_gradients: {update var: parameter var} whose sum the group writes into the parameter,
  # chunk by chunk in place (the value under the update var is then the new parameter)
  applied: dict = dataclasses.field(default_factory=dict)
  kept: frozenset = frozenset()  # loaded leaves the update returns unchanged (never consumed)
  # The reduction pass: {output var: "add" | "max" | "min"}, a full reduction of one leaf to a
  # scalar, each chunk's partial joined in chunk order (analyse.PARTIAL_REDUCTIONS)
  partials: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Plan:
  device_eqns: list[Eqn]
  groups: list[Group]
  # A two-pass stream: the reduction pass, run first (its groups load and store nothing new:
  # the scalars built from the whole stored state that every group of this plan reads)
  first: Plan | None = None


def make_plan(
  traced: Traced, leaves, name: str, passes: int = 2, fix: str = OFFLOAD_FIX
) -> tuple[Program, dict, Plan]:
  """``traced``'s program (its conditions expanded where the plan needs), ``{stored leaf: the
  var of its new value}`` and its plan (with a reduction pass first where a number built from
  the whole stored state feeds every parameter's update: :func:`two_pass`). ``passes`` 1: no
  reduction pass (the state of several parameters that such numbers join is one group, run
  whole, or refused where its leaves' shapes differ). ``fix``: what a refusal proposes."""
  stored_ids = [i for i, leaf in enumerate(leaves) if leaf.stored]
  expand: frozenset = frozenset()
  while True:  # each pass expands the conditions the last plan found decided on the device
    prog = Program.inline(traced.closed, expand)
    stored_in = {}
    if traced.first_state_in is not None:
      stored_in = {prog.invars[traced.first_state_in + i]: i for i in stored_ids}
    stored_out = {i: prog.outvars[traced.n_updates + i] for i in stored_ids}
    plan = _plan(prog, stored_in, stored_out, leaves, name, passes == 2, fix=fix)
    if isinstance(plan, _Cut):
      try:
        return prog, stored_out, two_pass(prog, stored_in, stored_out, leaves, name, plan)
      except OptimizerOffloadError as err:
        # the state of several parameters of one shape may still run whole, as one group
        try:
          single = _plan(prog, stored_in, stored_out, leaves, name, cut_allowed=False)
        except OptimizerOffloadError:
          raise err from None
        assert isinstance(single, Plan)  # its conditions were expanded above
        return prog, stored_out, single
    if not isinstance(plan, frozenset):
      return prog, stored_out, plan
    expand |= plan  # the conditions to expand first


@dataclasses.dataclass(frozen=True)
class _Cut:
  """What :func:`_plan` found: groups that join the state of several parameters through full
  reductions of single leaves (``reductions``: their equations) and ``errors`` (the refusal of
  each such group, should a reduction pass not resolve it)."""

  reductions: tuple[Eqn, ...]
  errors: tuple[OptimizerOffloadError, ...]


def two_pass(prog: Program, stored_in: dict, stored_out: dict, leaves, name: str, cut: _Cut):
  """A two-pass stream of ``prog``: a reduction pass computes ``cut``'s reductions (each a full
  reduction of one parameter's stored state, or of a value computed from it elementwise, to a
  scalar: prodigy's sum of ``|s|``, D-Adaptation's dot products, DoG's distance from the initial
  parameters), chunk by chunk, loading the state it reads and storing nothing; the update pass
  is ``prog`` with those scalars as inputs, whose groups then each read one parameter's state.
  The reduction pass reads the state it needs once more (its cost: one more read of those
  leaves per step). Refused where the update pass would still read several parameters' state
  together (a reduction of a value built from another global number: more than two passes)."""
  cut_ids = {id(e) for e in cut.reductions}
  # The reduction pass: the equations the reductions need, the reductions its outputs.
  first_out = [v for e in cut.reductions for v in e.outvars]
  first_prog = Program(prog.invars, first_out, _needed(prog.eqns, first_out), prog.consts)
  first = _plan(first_prog, stored_in, {}, leaves, name, partials=cut.reductions)
  # The update pass: what the outputs need, the reductions' results as inputs.
  rest_eqns = [e for e in prog.eqns if id(e) not in cut_ids]
  rest = Program(prog.invars, prog.outvars, _needed(rest_eqns, prog.outvars), prog.consts)
  plan = _plan(rest, stored_in, stored_out, leaves, name)
  if not isinstance(first, Plan) or not isinstance(plan, Plan):  # more than two passes
    raise cut.errors[0]
  plan.first = first
  return plan


def _needed(eqns: list[Eqn], outvars) -> list[Eqn]:
  """The equations of ``eqns`` that ``outvars`` are computed from, in their order."""
  live = {v for v in outvars if is_var(v)}
  kept = []
  for eqn in reversed(eqns):
    if any(v in live for v in eqn.outvars):
      kept.append(eqn)
      live.update(v for v in eqn.invars if is_var(v))
  return kept[::-1]


def _plan(
  prog: Program,
  stored_in: dict,
  stored_out: dict,
  leaves,
  name: str,
  cut_allowed: bool = True,
  partials: tuple[Eqn, ...] = (),
  fix: str = OFFLOAD_FIX,
) -> Plan | frozenset | _Cut:
  """The device part and the groups of ``prog``; or the ids of the ``cond`` equations that join
  the state of several parameters and are decided before any stored state is read, which
  ``Program.inline`` must expand first; or (``cut_allowed``) the full reductions of single
  leaves that join them (:class:`_Cut`, for :func:`two_pass`). ``partials``: the reduction
  pass's reductions (a chunked group joins each one's partials over its chunks)."""
  found = dependencies(prog, stored_in, stored_out)
  find, passed, deps = found.find, found.passed, found.deps
  owners = pull_into_groups(prog, found, flatten=bool(partials))
  device_eqns, by_root = [], {}
  for eqn, roots in zip(prog.eqns, owners):
    if not roots:
      device_eqns.append(eqn)
    for root in roots:
      by_root.setdefault(root, []).append(eqn)
  # Results that stay on the device: every output but the stored leaves' new values (a var that
  # is also returned elsewhere, e.g. as an update, stays too).
  stored_vars = {id(v) for v in stored_out.values()}
  device_out = [
    v
    for v in prog.outvars
    if is_var(v) and (id(v) not in stored_vars or sum(o is v for o in prog.outvars) > 1)
  ]
  groups = []
  cuts: list[Eqn] = []
  errors: list[OptimizerOffloadError] = []
  partial_ids = {id(e) for e in partials}
  roots = sorted({find(i) for i in stored_out if i not in passed} | set(by_root))
  for root in roots:
    eqns = by_root.get(root, [])
    members = [i for i in stored_out if find(i) == root and i not in passed]
    members += [i for i in stored_in.values() if find(i) == root and i not in members]
    # A leaf the update returns unchanged is loaded where its group reads it (and kept: its
    # entries stay the state's), never stored again.
    read_vars = {v for e in eqns for v in e.invars if is_var(v)}
    loads = [
      (v, i)
      for v, i in stored_in.items()
      if find(i) == root and (i not in passed or v in read_vars)
    ]
    defined = {v for e in eqns for v in e.outvars} | {v for v, _ in loads}
    reads = []
    for v in [v for e in eqns for v in e.invars] + [
      stored_out[i] for i in members if i in stored_out
    ]:
      if is_var(v) and v not in defined and v not in reads:
        reads.append(v)
    shapes = {leaves[i].shape for i in members}
    param_owners = {leaves[i].owner for i in members} - {-1}
    if len(param_owners) > 1:  # the state of several parameters together: split it, or refuse
      conds = [
        e.origin
        for e in eqns
        if e.primitive is not None
        and e.primitive.name == ji.COND_PRIMITIVE
        and not (is_var(e.invars[0]) and deps.get(e.invars[0]))  # a literal index too
      ]
      if conds:  # decided before any stored state is read: run both branches, select
        return frozenset(id(e) for e in conds)
      reductions = [e for e in eqns if cuttable(e, deps, leaves)]
      if reductions and cut_allowed:  # joined by full reductions of single leaves: two passes
        cuts += reductions
        errors.append(coupling_error(name, eqns, deps, leaves, sorted(members), passes=2))
        continue
      if len(shapes) > 1:
        raise coupling_error(name, eqns, deps, leaves, sorted(members), fix=fix)
    shape = leaves[members[0]].shape if len(shapes) > 1 else next(iter(shapes))
    bounds = {leaves[i].bounds for i in members}
    # One parameter's leaves of several shapes (sm3's per-axis accumulators, adafactor's
    # factored moments, galore's projector) run whole, as one group.
    ends = {e.outvars[0]: partial_kind(e) for e in eqns if id(e) in partial_ids}
    chunked = len(shapes) == 1 and len(bounds) == 1 and elementwise(eqns, shape, ends)
    chunks = next(iter(bounds)) if chunked else ((0, shape[0] if shape else 0),)
    outputs = [v for v in dict.fromkeys(device_out) if v in defined]
    stores = sorted(i for i in members if i in stored_out and i not in passed)
    block = leaves[members[0]].block_shape  # what one device streams (sharded state: its block)
    kept = frozenset(i for _, i in loads if i in passed)
    groups.append(
      Group(
        eqns, loads, stores, [], reads, outputs, block, chunked, chunks, kept=kept, partials=ends
      )
    )
  if cuts:
    return _Cut(tuple({id(e): e for e in cuts}.values()), tuple(errors))
  if passed:
    groups.append(Group([], [], [], sorted(passed), [], [], (), False, ()))
  return Plan(device_eqns, groups)


def mark_applied(plan: Plan, prog: Program, param_vars: list, n_updates: int) -> set:
  """For ``apply_gradients``: each update that a chunked group computes for a parameter that no
  other group reads is added to that parameter inside the group, chunk by chunk, in place (no
  whole array of updates on the device). Returns the update vars so applied."""
  readers: dict[Any, int] = {}
  for group in plan.groups:
    for v in set(group.reads):
      readers[v] = readers.get(v, 0) + 1
  returned = [v for v in prog.outvars if is_var(v)]
  applied = set()
  for u, p in zip(prog.outvars[:n_updates], param_vars):
    if not is_var(u) or returned.count(u) != 1 or tuple(u.aval.shape) != tuple(p.aval.shape):
      continue
    group = next((g for g in plan.groups if u in g.outputs), None)
    if group is None or not group.chunked or readers.get(p, 0) > (p in group.reads):
      continue
    group.applied[u] = p
    if p not in group.reads:
      group.reads.append(p)
    applied.add(u)
  return applied
