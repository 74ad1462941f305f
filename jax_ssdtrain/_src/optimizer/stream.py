"""Stream: the device part, then each group, chunk by chunk, through the chunk I/O.

:func:`stream` runs a traced ``tx.update`` (or ``tx.init``) on an :class:`OffloadedState`: the
program's device part first (``plan.py``), then every group (:func:`run_groups`) with a
*per-device runner*: :func:`on_one_device` runs them as they are, :func:`on_each_device` in one
``shard_map`` over the layout's mesh, each device on its own blocks (sharded state). Loads and
stores go through the layout's chunk I/O (``chunk_io.py``): the store, or the device reference.

A chunked group runs as a ``lax.scan`` over its uniform chunks (one copy of the group's
operations, as in ``tx``'s own program) and its last, shorter chunk after it. Chunks are
pipelined: the loads of chunk ``k`` wait for the stores of chunk ``k - 2`` (an optimization
barrier; ``layout.PIPELINE_DEPTH``), so at most three chunks' state is on the device at once; on
the CPU a chunk's loads are chained in the group's order through copies of their handles
(XLA:CPU runs independent custom calls in any order).

Exactness. Elementwise operations give the same bits on a slice as on the whole, though XLA may
fuse and rewrite the streamed program differently from ``tx``'s own (a few ulps). The same
program with the state on the device, ``location="device"``, agrees bit for bit: there each load
and store is a copy XLA cannot see through (``primitives.opaque_copy``), and in both the values a
group reads and its results cross one, so that the group's arithmetic is a region bounded by
custom calls that XLA compiles alike (:func:`run_chunk`).

Sharded state: the device part (a global norm) stays in the partitioned program. A group that
is not elementwise (a norm of one whole leaf, as LAMB's trust ratio) would see only a block and
is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.chunk_io import ChunkIO, StoreIO, chunk_io
from jax_ssdtrain._src.optimizer.layout import Layout
from jax_ssdtrain._src.optimizer.plan import Plan, make_plan, mark_applied
from jax_ssdtrain._src.optimizer.state import OffloadedState
from jax_ssdtrain._src.optimizer.trace import eval_eqn, is_var, read, trace_init, trace_update
from jax_ssdtrain._src.primitives import opaque_copy


def stream(fn, args, layout: Layout, state: OffloadedState | None, name: str, apply=False):
  """Update (``state`` given): runs ``fn(updates, tx_state, params)`` with ``tx_state``'s stored
  leaves loaded and the new ones stored chunk by chunk; returns ``(updates, new state)``, with
  ``apply`` ``(new params, new state)``, the updates of the streamed groups added to the
  parameters chunk by chunk in place. Init (``state`` None): runs ``fn(params)`` and stores its
  stored leaves; returns ``(None, state)``."""
  leaves = layout.leaves
  stored_ids = [i for i, leaf in enumerate(leaves) if leaf.stored]
  if state is not None:
    updates, params = args
    traced = trace_update(fn, updates, params, state, layout, name)
  else:
    (params,) = args
    traced = trace_init(fn, params)
  n_updates = traced.n_updates
  prog, stored_out, plan = make_plan(traced, leaves, name)
  applied = set()
  if apply:
    first_param_in = traced.first_state_in + len(leaves)
    applied = mark_applied(plan, prog, prog.invars[first_param_in:], n_updates)

  env = dict(prog.consts)
  for v, x in zip(prog.invars, traced.in_values):
    if x is not None:
      env[v] = x
  handles_in = dict(zip(stored_ids, state.handles)) if state is not None else {}
  runner = on_one_device if layout.mesh is None else on_each_device
  after: list[Any] = []
  io = chunk_io(layout.location)
  if plan.first is not None:  # 0. a two-pass stream: the reduction pass (stores nothing)
    # Each pass loads entries the other loads too: every load reads its handle (the engine's
    # prediction of ordered loads assumes each entry is loaded once, in store order).
    io = dataclasses.replace(io, ordered=False) if isinstance(io, StoreIO) else io
    for eqn in plan.first.device_eqns:
      eval_eqn(eqn, env)
    run = functools.partial(run_groups, plan.first, leaves, {}, io)
    numbers = runner(run, plan.first, layout, env, handles_in, name)[1]
    env.update(numbers)
    after = list(numbers.values())  # what the update pass's loads wait for (run_groups)
  for eqn in plan.device_eqns:  # 1. what reads no stored leaf, as tx runs it
    if not all(v in env for v in eqn.outvars if not isinstance(v, ji.DropVar)):
      eval_eqn(eqn, env)  # (unless the reduction pass ran it)

  new_handles: dict[int, Any] = {}
  for group in plan.groups:  # a leaf the update leaves as it is: the same entries
    new_handles.update({i: handles_in[i] for i in group.passed})
  consume = layout.in_place and state is not None  # in place: each load is its entry's last
  run = functools.partial(run_groups, plan, leaves, stored_out, io, consume=consume)
  # 2. each group, chunk by chunk (sharded state: each device runs every group on its blocks)
  handles, group_outs = runner(run, plan, layout, env, handles_in, name, after)
  new_handles.update(handles)
  env.update(group_outs)

  outs = [None if k - n_updates in stored_out else read(env, v) for k, v in enumerate(prog.outvars)]
  device_state = [
    _placed(outs[n_updates + i], leaf, layout.mesh)
    for i, leaf in enumerate(leaves)
    if not leaf.stored
  ]
  new_state = OffloadedState(device_state, [new_handles[i] for i in stored_ids], layout)
  if state is None:
    return None, new_state
  if apply:  # the parameters: updated in place where applied, else as optax.apply_updates
    new_params = [
      outs[k] if v in applied else jnp.asarray(p + outs[k]).astype(p.dtype)
      for k, (v, p) in enumerate(zip(prog.outvars[:n_updates], jax.tree_util.tree_leaves(params)))
    ]
    return jax.tree_util.tree_structure(params).unflatten(new_params), new_state
  new_updates = traced.updates_tree.unflatten(outs[:n_updates])
  return new_updates, new_state


def _placed(x, leaf, mesh):
  """A leaf kept on the device, sharded state: constrained to its parameter's sharding (the
  layout's spec; replicated where it mirrors none), as optax's own state lies. Left to the
  partitioner, init's zeros come out replicated and XLA gathers them every step."""
  if mesh is None or leaf.spec is None:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, leaf.spec))


def on_one_device(
  run, plan: Plan, layout: Layout, env: dict, handles_in: dict, name: str, after=()
):
  """State on one device: ``run`` (every group) as it is (its loads after ``after``)."""
  return run(env, handles_in, after=list(after))


def on_each_device(
  run, plan: Plan, layout: Layout, env: dict, handles_in: dict, name: str, after=()
):
  """Sharded state: one ``shard_map`` over the layout's mesh runs ``run`` (every group) on each
  device's blocks: its own handles, its block of each state leaf and of the gradients and
  parameters of the same shape (resharded by XLA where they come sharded otherwise); scalars
  (a learning rate, a clipping factor of the device part, the reduction pass's numbers that
  the loads wait for: ``after``) replicated."""
  P = jax.sharding.PartitionSpec
  leaves, io, mesh = layout.leaves, chunk_io(layout.location), layout.mesh
  read_specs: dict[Any, Any] = {}
  out_specs: dict[Any, Any] = {}
  joins: dict[Any, tuple[str, tuple[str, ...]]] = {}  # a partial: (how joined, mesh axes)
  for group in plan.groups:
    members = sorted(set(group.stores) | {i for _, i in group.loads})
    if not members:
      continue
    specs = {leaves[i].spec for i in members}
    if not group.chunked or len(specs) > 1:
      paths = ", ".join(leaves[i].path for i in members[:6])
      raise OptimizerOffloadError(
        f"{name} cannot stream sharded state: its update of {paths} "
        + (
          "is not elementwise (a norm or a reshape of one parameter's state needs the whole "
          "leaf, and each device holds a block of it)"
          if not group.chunked
          else f"reads leaves sharded differently ({sorted(map(str, specs))})"
        )
        + "; keep that state on the devices, or place the parameters unsharded before init"
      )
    (spec,) = specs
    for v in group.reads:
      want = P() if tuple(v.aval.shape) == () else spec
      if read_specs.setdefault(v, want) != want:
        raise OptimizerOffloadError(
          f"{name} cannot stream sharded state: a value of shape {list(v.aval.shape)} is read by "
          f"updates of state sharded {read_specs[v]} and {want}"
        )
    for v in group.outputs:
      out_specs[v] = P() if tuple(v.aval.shape) == () else spec
    for v, kind in group.partials.items():  # each device's partial, joined over the mesh
      joins[v] = (kind, tuple(a for part in spec if part for a in _names(part)))
  reads, out_vars = list(read_specs), list(out_specs)
  loaded = sorted({i for g in plan.groups for _, i in g.loads})
  stored = sorted({i for g in plan.groups for i in g.stores})
  placed = lambda i: io.spec(leaves[i], mesh)  # noqa: E731 (handles: e.g. one row per device)

  def body(read_values, hs, after):
    local_hs = {i: io.local(h) for i, h in zip(loaded, hs)}
    handles, outs = run(dict(zip(reads, read_values)), local_hs, after=after)
    for v, (kind, axes) in joins.items():  # a full reduction: every block's partial
      if axes:
        outs[v] = _COLLECTIVE[kind](outs[v], axes)
    new = [io.from_local(handles[i]) for i in stored]
    return new, [outs[v] for v in out_vars]

  # check_vma off: the store's calls have no replication rule (their handles differ per device).
  each = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=([read_specs[v] for v in reads], [placed(i) for i in loaded], [P()] * len(after)),
    out_specs=([placed(i) for i in stored], [out_specs[v] for v in out_vars]),
    check_vma=False,
  )
  new, outs = each([env[v] for v in reads], [handles_in[i] for i in loaded], list(after))
  return dict(zip(stored, new)), dict(zip(out_vars, outs))


_COLLECTIVE = {"add": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}
_JOIN = {"add": jnp.sum, "max": jnp.max, "min": jnp.min}


def _names(part) -> tuple[str, ...]:
  """The mesh axes of one entry of a PartitionSpec."""
  return tuple(part) if isinstance(part, tuple) else (part,)


def run_groups(
  plan: Plan,
  leaves,
  stored_out: dict,
  io: ChunkIO,
  env: dict,
  handles_in: dict,
  consume=False,
  after=(),
):
  """Runs ``plan``'s groups one after the other; returns ``({stored leaf: new handles},
  {output var: value})``. ``env`` holds every value a group reads; ``consume``: each load is its
  entry's last (``in_place``); ``after``: values every load waits for (a two-pass stream's
  numbers: the reduction pass's loads of an entry come before the update pass's, which may be
  the entry's last: ``ChunkIO.wait_for``)."""
  env = dict(env)
  new_handles: dict[int, Any] = {}
  outputs: dict[Any, Any] = {}
  last: list[Any] = []  # the newest store handles, which the next group's loads wait for
  for group in plan.groups:
    if not group.loads and not group.stores:
      continue
    hs_in = {i: handles_in[i] for _, i in group.loads}
    if after:
      hs_in = {i: io.wait_for(h, after) for i, h in hs_in.items()}
    if last:  # this group's loads start once the last group's stores are under way
      hs_in, _ = jax.lax.optimization_barrier((hs_in, last))
    run = functools.partial(run_chunk, group, leaves, env, stored_out, io, consume=consume)
    if not group.chunked:
      handles, outs = run(None, hs_in, None)
      new_handles.update({i: h for i, h in handles.items()})
      outputs.update(outs)
      last = list(handles.values())
      continue
    # Uniform chunks in a scan (one copy of the group's operations, as in tx's own program, and
    # a program whose size does not grow with the state), the last, shorter one after it.
    rows = group.chunks[0][1] - group.chunks[0][0]
    full = sum(1 for r0, r1 in group.chunks if r1 - r0 == rows)
    stacked_h: dict[int, list[Any]] = {i: [] for i in group.stores}
    stacked_o: dict[Any, list[Any]] = {v: [] for v in group.outputs}
    zero = jnp.zeros((max(len(group.stores), 1), 2), jnp.uint32)

    # Parameters updated in place (apply_gradients) are carried whole, the others stacked.
    applied = group.applied
    carried = {p: env[p] for p in applied.values()}
    for v in applied:
      del stacked_o[v]

    def split(outs, applied=applied):
      return {p: outs[u] for u, p in applied.items()}, {
        v: o for v, o in outs.items() if v not in applied
      }

    # The scan's carry and outputs are lists in these orders (pytree dicts need sortable keys).
    params_order, outs_order = list(carried), list(stacked_o)

    def body(carry, c, run=run, rows=rows, hs_in=hs_in, split=split, order=params_order):
      before_last, newest, carried = carry
      carried = dict(zip(order, carried))
      handles, outs = run(c, hs_in, rows, wait=before_last, carried=carried)
      mine = io.newest(handles, zero)
      carried, outs = split(outs)
      return (newest, mine, [carried[p] for p in order]), (handles, [outs[v] for v in outs_order])

    if full > 1:
      (_, newest, carried), (hs, os) = jax.lax.scan(
        body, (zero, zero, [carried[p] for p in params_order]), jnp.arange(full, dtype=jnp.int32)
      )
      carried = dict(zip(params_order, carried))
      for i, h in hs.items():
        stacked_h[i].append(io.scanned(h, full * rows))
      for v, o in zip(outs_order, os):
        stacked_o[v].append(o if v in group.partials else o.reshape((full * rows,) + o.shape[2:]))
    else:  # one full chunk: no scan (its arithmetic is bounded by custom calls all the same)
      handles, outs = run(0, hs_in, rows, start=0, carried=carried)
      carried, outs = split(outs)
      for i, h in handles.items():
        stacked_h[i].append(io.single(h))
      stacked_o.update({v: [o[None] if v in group.partials else o] for v, o in outs.items()})
      newest = io.newest(handles, zero)
    last = [newest]
    if full < len(group.chunks):  # the rest of the rows
      r0, r1 = group.chunks[full]
      handles, outs = run(full, hs_in, r1 - r0, wait=newest, start=r0, carried=carried)
      carried, outs = split(outs)
      for i, h in handles.items():
        stacked_h[i].append(io.single(h))
      for v, o in outs.items():
        stacked_o[v].append(o[None] if v in group.partials else o)
      last = list(handles.values())
    for i, parts in stacked_h.items():
      new_handles[i] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    for v, parts in stacked_o.items():
      outputs[v] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
      if v in group.partials:  # the chunks' partials of a full reduction, joined
        outputs[v] = _JOIN[group.partials[v]](outputs[v]).astype(v.aval.dtype)
    outputs.update({u: carried[p] for u, p in applied.items()})
  return new_handles, outputs


def run_chunk(
  group,
  leaves,
  env,
  stored_out,
  io: ChunkIO,
  c,
  hs_in,
  rows,
  wait=None,
  start=None,
  carried=None,
  consume=False,
):
  """One chunk of a group (``c``: its index, traced in the scan; ``rows``: its length), or the
  whole group (``rows`` None). Returns ``({stored leaf: handle(s)}, {output var: value})``; with
  ``group.applied``, the parameters (``carried``: the whole arrays, the chunk's rows read from
  and written back into them) are the values of their update vars."""
  carried = {} if carried is None else carried
  local: dict[Any, Any] = {} if rows is not None else dict(env)
  first = None if rows is None else start if start is not None else c * rows
  before = []  # the chunk's last load, which its next load waits for
  for v, i in group.loads:
    leaf, hs = leaves[i], hs_in[i]
    keep = consume and i not in group.kept  # in place: the load is the entry's last
    if rows is None:  # every chunk of the leaf, joined
      local[v] = io.load_leaf(hs, leaf, consume=keep)
    else:  # the chunk before last has been stored (wait): see PIPELINE_DEPTH
      local[v], before = io.load_rows(
        hs, leaf, c, first, rows, wait=wait, after=before, consume=keep
      )
  # The group's arithmetic is a region bounded by custom calls on every side, in every mode, so
  # that XLA compiles it alike whether its state comes from the store or from the device
  # (location="device") and the two agree bit for bit (an optimization barrier does not hold:
  # XLA:CPU removes it before fusing). Its state comes from loads (on the device: copies XLA
  # cannot see through, primitives.opaque_copy), the values it reads (gradients, parameters,
  # scalars of the device part) cross such a copy too, and so do its results below.
  used = {v for e in group.eqns for v in e.invars if is_var(v)}
  for v in group.reads:
    x = carried[v] if v in carried else env[v]  # a parameter updated in place: its rows
    x = jax.lax.dynamic_slice_in_dim(x, first, rows) if rows and np.ndim(x) else x
    local[v] = opaque_copy(x) if v in used else x  # else only apply_gradients adds to it
  if rows is not None:
    shape = (rows,) + group.shape[1:]
  for eqn in group.eqns:
    eval_eqn(eqn, local, shape if rows is not None else None)
  handles = {}
  for i in group.stores:  # the store's stores (on the device: copies where it has them)
    leaf, value = leaves[i], read(local, stored_out[i])
    handles[i] = io.store_leaf(value, leaf) if rows is None else io.store_rows(value, leaf)
  outs = {v: opaque_copy(jnp.asarray(read(local, v))) for v in group.outputs}
  for u, p in group.applied.items():  # as optax.apply_updates: (p + u) in p's dtype
    if rows is None:
      outs[u] = jnp.asarray(env[p] + outs[u]).astype(env[p].dtype)
    else:
      new = jnp.asarray(local[p] + outs[u]).astype(local[p].dtype)
      outs[u] = jax.lax.dynamic_update_slice_in_dim(carried[p], new, first, axis=0)
  return handles, outs
