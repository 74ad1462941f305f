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
  coupling_error,
  dependencies,
  elementwise,
  pull_into_groups,
)
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


@dataclasses.dataclass
class Plan:
  device_eqns: list[Eqn]
  groups: list[Group]


def make_plan(traced: Traced, leaves, name: str) -> tuple[Program, dict, Plan]:
  """``traced``'s program (its conditions expanded where the plan needs), ``{stored leaf: the
  var of its new value}`` and its plan."""
  stored_ids = [i for i, leaf in enumerate(leaves) if leaf.stored]
  expand: frozenset = frozenset()
  while True:  # each pass expands the conditions the last plan found decided on the device
    prog = Program.inline(traced.closed, expand)
    stored_in = {}
    if traced.first_state_in is not None:
      stored_in = {prog.invars[traced.first_state_in + i]: i for i in stored_ids}
    stored_out = {i: prog.outvars[traced.n_updates + i] for i in stored_ids}
    plan = _plan(prog, stored_in, stored_out, leaves, name)
    if not isinstance(plan, frozenset):
      return prog, stored_out, plan
    expand |= plan  # the conditions to expand first


def _plan(prog: Program, stored_in: dict, stored_out: dict, leaves, name: str) -> Plan | frozenset:
  """The device part and the groups of ``prog``; or the ids of the ``cond`` equations that join
  the state of several parameters and are decided before any stored state is read, which
  ``Program.inline`` must expand first."""
  found = dependencies(prog, stored_in, stored_out)
  find, passed, deps = found.find, found.passed, found.deps
  owners = pull_into_groups(prog, found)
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
        and is_var(e.invars[0])
        and not deps.get(e.invars[0])
      ]
      if conds:  # decided before any stored state is read: run both branches, select
        return frozenset(id(e) for e in conds)
      if len(shapes) > 1:
        raise coupling_error(name, eqns, deps, leaves, sorted(members))
    shape = leaves[members[0]].shape if len(shapes) > 1 else next(iter(shapes))
    bounds = {leaves[i].bounds for i in members}
    # One parameter's leaves of several shapes (sm3's per-axis accumulators, adafactor's
    # factored moments, galore's projector) run whole, as one group.
    chunked = len(shapes) == 1 and len(bounds) == 1 and elementwise(eqns, shape)
    chunks = next(iter(bounds)) if chunked else ((0, shape[0] if shape else 0),)
    outputs = [v for v in dict.fromkeys(device_out) if v in defined]
    stores = sorted(i for i in members if i in stored_out and i not in passed)
    block = leaves[members[0]].block_shape  # what one device streams (sharded state: its block)
    kept = frozenset(i for _, i in loads if i in passed)
    groups.append(Group(eqns, loads, stores, [], reads, outputs, block, chunked, chunks, kept=kept))
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
