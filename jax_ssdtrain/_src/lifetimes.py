"""How long a stored tensor lives: counted at compile time, swept at run time.

The rule: **a stored tensor lives while a load can still reach it.** Inside the XLA execution
that stored it, that is until its last load there, which is counted when the program is
compiled; a handle that leaves its execution (returned from a jit, e.g. by ``jax.vjp`` across
jits, or made by an eager store) keeps its tensor while a live ``jax.Array`` holds that handle.

Counting (:func:`analyze`). When JAX lowers a program (``mlir.lower_jaxpr_to_module``, wrapped
here) its top-level jaxpr is walked: values carry the store sites whose handles they may hold
(a handle flows through the vmap rule's broadcast, scan stacking, slicing, calls, ...; a load
ends it), and every equation runs a known number of times per execution (a scan body ``length``
times). For each site, ``uses`` = load executions / store executions: how many loads each
stored entry gets. The store's custom call carries it; the engine releases an entry after that
many loads (0: right after the store, never written). The count is given up (``-1``) when the
handle reaches the program's outputs (it escapes), a store or load sits inside ``cond`` /
``while`` / a higher-order primitive not known here, the ratio is not an integer, or a site is
stored in places that run different numbers of times.

Sweeping (:func:`collect`). Entries with ``uses == -1`` stay until a sweep. A sweep reads the
engine's next entry number, waits for every live ``jax.Array`` to be ready, reads the handles
in those arrays (uint32 arrays whose last dimension is 2, every addressable shard) and tells the
engine to release every older entry whose handle none of them holds. Why this is safe: a handle
that can still be loaded is either held by a live array, or is internal to an execution that
was dispatched earlier; waiting for the live arrays waits for every such execution whose result
anyone can observe (an execution with no live outputs is unobservable: its loads may fail
harmlessly). A daemon thread sweeps when the engine has made enough uncounted entries since
the last sweep; ``ssd.flush()`` and ``ssd.collect()`` sweep at once. The daemon's sweeps can fall
inside a dispatch, where that reasoning does not hold: they only retire (see :func:`_sweep`).

The same walk at lowering lists a program's stores and their sizes (:func:`program_stores`),
from which the staging arena is sized when the program first runs (``config.py``).

This module sits below the primitives it counts and imports none of them: they are arguments
(:func:`analyze`, :func:`install_lowering_hook`, which the package's ``__init__`` calls with
``primitives.store_p`` and ``primitives.LOAD_PRIMITIVES``), as ``sharded.py`` is handed them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Any

import jax
import numpy as np

from jax_ssdtrain._src import attributes, native
from jax_ssdtrain._src import jax_internals as ji

# A store's ``uses`` not counted: released by sweeps (the header's SSDTRAIN_USES_UNCOUNTED).
UNCOUNTED = attributes.USES_UNCOUNTED
# A store's ``uses`` given, not counted: only later executions load its entries, in store order
# (an optimizer's state). Swept as UNCOUNTED; the engine makes its host copy at once (its
# oldest entries are loaded first: keeping the newest in device staging would serve no load).
LATER_IN_ORDER = attributes.USES_LATER_IN_ORDER
# A store's ``uses`` to count where the program loads every entry it stores, and LATER_IN_ORDER
# where the handle leaves it (a layer stack's entries: later programs load them layer by layer).
COUNTED_OR_LATER = "counted_or_later"


# ---------------------------------------------------------------------------------------------
# Compile-time counts


@dataclasses.dataclass
class _Site:
  store_runs: list[int] = dataclasses.field(default_factory=list)  # executions per store eqn
  load_runs: int = 0  # load executions in all
  uncertain: bool = False  # a store or load of it runs an unknown number of times
  escapes: bool = False  # its handle reaches the program's outputs

  def uses(self) -> int:
    if self.escapes or self.uncertain or not self.store_runs:
      return UNCOUNTED
    if len(set(self.store_runs)) != 1:  # stored in places that run differently often
      return UNCOUNTED
    stores = sum(self.store_runs)
    if stores == 0 or self.load_runs % stores:  # 0: in a scan of no iterations
      return UNCOUNTED
    return self.load_runs // stores


def analyze(jaxpr: Any, *, store_p: Any, load_ps: tuple[Any, ...], copy_p: Any) -> dict[int, int]:
  """``{site: uses}`` for every store site in a top-level program (see the module doc).
  ``store_p``: the store primitive; ``load_ps``: the primitives that load its entries (their
  first operand is the handle); ``copy_p``: the ordering copy (its first operand's value)."""
  sites: dict[int, _Site] = collections.defaultdict(_Site)
  empty: frozenset = frozenset()

  def walk(jaxpr, ins, runs, uncertain, record):
    jaxpr = ji.open_jaxpr(jaxpr)
    env: dict[Any, frozenset] = {}

    def read(v):
      return env.get(v, empty) if isinstance(v, ji.Var) else empty

    for v, t in zip(jaxpr.invars, ins):
      env[v] = t
    for eqn in jaxpr.eqns:
      in_t = [read(v) for v in eqn.invars]
      if eqn.primitive is store_p:
        site = eqn.params["site"]
        if record:
          sites[site].store_runs.append(runs)
          sites[site].uncertain |= uncertain
        out_t = [in_t[0], frozenset([site])]
      elif eqn.primitive in load_ps:
        if record:
          for site in in_t[0]:
            sites[site].load_runs += runs
            sites[site].uncertain |= uncertain
        out_t = [empty]
      elif eqn.primitive is copy_p:
        out_t = in_t[:1]  # an ordering copy (opaque_copy): x's value; the others are not read
      else:
        out_t = _higher_order(eqn, in_t, runs, uncertain, record, walk)
      for v, t in zip(eqn.outvars, out_t):
        if isinstance(v, ji.Var):
          env[v] = t
    return [read(v) for v in jaxpr.outvars]

  top = ji.open_jaxpr(jaxpr)
  outs = walk(top, [empty] * len(top.invars), 1, False, True)
  for t in outs:
    for site in t:
      sites[site].escapes = True
  return {site: s.uses() for site, s in sites.items()}


def _union(taints):
  out = frozenset()
  for t in taints:
    out |= t
  return out


def _higher_order(eqn, in_t, runs, uncertain, record, walk):
  """Output taints of an equation (walking its sub-jaxprs, if any)."""
  params = eqn.params
  name = eqn.primitive.name
  n_out = len(eqn.outvars)
  if name == "scan":
    body = params["jaxpr"]
    n_consts, n_carry = ji.scan_layout(eqn)
    consts, carry, xs = (
      in_t[:n_consts],
      in_t[n_consts : n_consts + n_carry],
      in_t[n_consts + n_carry :],
    )
    while True:  # carries' taints to a fixpoint (they only grow)
      out = walk(body, consts + carry + xs, runs * params["length"], uncertain, False)
      grown = [c | o for c, o in zip(carry, out[:n_carry])]
      if grown == carry:
        break
      carry = grown
    return walk(body, consts + carry + xs, runs * params["length"], uncertain, record)
  if name == "while":
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    body_consts, carry = in_t[n_cond : n_cond + n_body], in_t[n_cond + n_body :]
    while True:
      out = walk(params["body_jaxpr"], body_consts + carry, runs, True, False)
      grown = [c | o for c, o in zip(carry, out)]
      if grown == carry:
        break
      carry = grown
    walk(params["cond_jaxpr"], in_t[:n_cond] + carry, runs, True, record)
    return walk(params["body_jaxpr"], body_consts + carry, runs, True, record)
  if name == "cond":
    outs = [walk(branch, in_t[1:], runs, True, record) for branch in params["branches"]]
    return [_union(ts) for ts in zip(*outs)]
  subs = [p for p in _jaxprs_in(params)]
  if not subs:
    if name in _ONE_TO_ONE and n_out == len(in_t):
      return list(in_t)
    return [_union(in_t)] * n_out
  if len(subs) == 1:
    sub = ji.open_jaxpr(subs[0])
    if len(sub.invars) == len(in_t) and len(sub.outvars) == n_out:  # a call: one to one
      return walk(sub, in_t, runs, uncertain, record)
  # Unknown higher-order primitive: every sub-jaxpr may run any number of times and see every
  # input; every output may carry any handle.
  all_in = _union(in_t)
  seen = [all_in]
  for sub in subs:
    sub = ji.open_jaxpr(sub)
    seen += walk(sub, [all_in] * len(sub.invars), runs, True, record)
  return [_union(seen)] * n_out


# Multi-operand primitives whose i-th output is the i-th operand's value (remat3 puts the
# handle through an optimization barrier beside the forward's values).
_ONE_TO_ONE = {"optimization_barrier"}


def _jaxprs_in(params):
  out = []
  for value in params.values():
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
      if hasattr(ji.open_jaxpr(v), "eqns"):
        out.append(v)
  return out


# The analysis of the module being lowered on this thread (a stack: lowerings nest).
_local = threading.local()


def program_stores(
  jaxpr: Any, *, store_p: Any, counted: dict[int, int] | None = None
) -> list[tuple[str, int, int]]:
  """The stores of a program that are in flight while it runs, ``(name, bytes, tier)`` in
  program order (a sub-jaxpr's, such as a scan body's, listed once however often it runs): what the
  staging arena's size under ``staging_bytes="auto"`` is computed from (``options/staging.py``).
  Those a load of the same execution takes (``uses`` > 0, from ``counted``: :func:`analyze`'s)
  and those whose loads are not counted (a handle that leaves the program); not those only
  later executions load in store order (an optimizer's state: their host copy is made at once)
  nor those no load takes. The bytes are the stored value's whole (global) shape's."""
  counted = counted or {}
  out: list[tuple[str, int, int]] = []

  def visit(j):
    for eqn in ji.open_jaxpr(j).eqns:
      if eqn.primitive is store_p:
        site, uses = eqn.params["site"], eqn.params.get("uses")
        if uses is None or uses == COUNTED_OR_LATER:
          later = uses == COUNTED_OR_LATER and counted.get(site, UNCOUNTED) == UNCOUNTED
          uses = LATER_IN_ORDER if later else counted.get(site, UNCOUNTED)
        if uses > 0 or uses == UNCOUNTED:
          aval = eqn.invars[0].aval
          nbytes = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
          out.append((str(eqn.params.get("name") or site), nbytes, eqn.params["tier"]))
      for sub in _jaxprs_in(eqn.params):
        visit(sub)

  visit(jaxpr)
  return out


def current_stores() -> list[tuple[str, int, int]]:
  """:func:`program_stores` of the program being lowered on this thread (empty outside one)."""
  stack = getattr(_local, "stores", None)
  return list(stack[-1]) if stack else []


def current_uses(site: int) -> int:
  """``uses`` of a store site in the program being lowered (-1 outside a known lowering)."""
  stack = getattr(_local, "stack", None)
  if not stack:
    return UNCOUNTED
  return stack[-1].get(site, UNCOUNTED)


def install_lowering_hook(*, store_p: Any, load_ps: tuple[Any, ...], copy_p: Any) -> None:
  """Wraps ``mlir.lower_jaxpr_to_module`` (JAX internal, named in jax_internals) once, counting
  the entries of ``store_p`` loaded by ``load_ps`` (see :func:`analyze`)."""
  module = ji.MLIR_MODULE
  original = getattr(module, ji.LOWER_JAXPR_TO_MODULE)
  if getattr(original, "_ssdtrain_hook", False):
    return

  @functools.wraps(original)
  def lower_jaxpr_to_module(module_name, jaxpr, *args, **kwargs):
    stack = _local.__dict__.setdefault("stack", [])
    stores = _local.__dict__.setdefault("stores", [])
    has_store = _contains(jaxpr, store_p)
    counted = analyze(jaxpr, store_p=store_p, load_ps=load_ps, copy_p=copy_p) if has_store else {}
    stack.append(counted)
    stores.append(program_stores(jaxpr, store_p=store_p, counted=counted) if has_store else [])
    try:
      return original(module_name, jaxpr, *args, **kwargs)
    finally:
      stack.pop()
      stores.pop()

  lower_jaxpr_to_module._ssdtrain_hook = True
  setattr(module, ji.LOWER_JAXPR_TO_MODULE, lower_jaxpr_to_module)


def _contains(jaxpr, primitive) -> bool:
  def visit(j):
    for eqn in ji.open_jaxpr(j).eqns:
      if eqn.primitive is primitive:
        return True
      if any(visit(s) for s in _jaxprs_in(eqn.params)):
        return True
    return False

  return visit(jaxpr)


# ---------------------------------------------------------------------------------------------
# Run-time sweeps


def collect() -> int:
  """Releases every stored tensor no program can load any more (see the module doc); returns
  how many were released. Blocks until the live arrays are ready. Call it from the thread that
  dispatches the steps (between steps): see :func:`_sweep` for sweeps on other threads."""
  return _sweep(background=False)


def _sweep(background: bool) -> int:
  """A sweep. One on the dispatching thread sees every array a later program can take. One on
  another thread (the background sweeper) can run while a step is being dispatched: the step
  has taken (donated) the arrays that held the handles it will load, and its results do not
  exist yet, so that no live array holds those handles. Such a sweep takes only what the sweep
  before it also found unreferenced (and older than that sweep's start), and it only *retires*
  it: a load still finds a retired entry, whose room goes to the next store that needs it
  (oldest first). Where XLA runs a program while dispatching it (GPU; CPU without async
  dispatch) a dispatch lasts as long as the step's blocking copies and writes: several sweeps
  can fall inside it."""
  global _previous
  with _sweep_lock:
    seq_limit = int(native.stats()["next_seq"])
    arrays = ready_live_arrays(strict=True)
    if arrays is None:  # a program took arrays of the snapshot: the next sweep sees its results
      return 0
    try:
      pairs = _handle_pairs(arrays)
    except RuntimeError:
      if any(a.is_deleted() for a in arrays):  # donated between the wait and the read
        return 0
      raise
    if any(a.is_deleted() for a in arrays):  # taken by a program dispatched since
      return 0
    if not background:
      return native.sweep(pairs, seq_limit)
    previous, _previous = _previous, (pairs, seq_limit)
    if previous is None:
      return 0
    return native.sweep(np.concatenate([pairs, previous[0]]), previous[1], retire=True)


# The background sweeper's last (pairs, seq_limit) (see _sweep).
_previous: tuple[np.ndarray, int] | None = None


def _may_hold_handles(a) -> bool:
  return a.dtype == np.uint32 and a.ndim > 0 and a.shape[-1] == 2


_sweep_lock = threading.Lock()


def ready_live_arrays(*, strict: bool = False):
  """Waits for every live ``jax.Array`` and returns those that hold a value. An array whose
  program failed (an error its caller has seen, or will see when it reads the array) holds no
  handle a program could load, and must not make every later wait raise that error again.

  An array donated or deleted since the snapshot is left out too; with ``strict`` (a sweep)
  the answer is None instead (a stale snapshot): a program dispatched after the snapshot took
  it and may still load the entries it held, and that program's results were not waited for."""
  arrays = live_arrays()
  try:
    jax.block_until_ready(arrays)
  except jax.errors.JaxRuntimeError:
    pass
  else:
    return arrays
  ready = []
  for a in arrays:
    try:
      a.block_until_ready()
    except RuntimeError as e:  # JaxRuntimeError included
      if a.is_deleted():
        if strict:
          return None
        continue
      if isinstance(e, jax.errors.JaxRuntimeError):
        continue  # its program failed
      raise
    ready.append(a)
  return ready


def live_arrays():
  """Every live ``jax.Array`` on the platforms this process uses."""
  arrays = []
  for platform in _platforms():
    try:
      arrays += jax.live_arrays(platform)
    except RuntimeError:  # no such backend
      continue
  return [a for a in arrays if not a.is_deleted()]


def _platforms():
  names = []
  for platform in (None, "cpu"):  # the default backend, and the host's if it is enabled
    try:
      devices = jax.devices(platform)
    except RuntimeError:  # e.g. JAX_PLATFORMS=cuda: no cpu backend
      continue
    for device in devices:
      if device.platform not in names:
        names.append(device.platform)
  return names


def _handle_pairs(arrays) -> np.ndarray:
  """Every (id, check) uint32 pair held by a live array that could hold handles."""
  chunks = []
  for a in arrays:
    if not _may_hold_handles(a):
      continue
    for shard in a.addressable_shards:  # a handle declared replicated differs per device
      chunks.append(np.asarray(shard.data).reshape(-1, 2))
  if not chunks:
    return np.zeros((0, 2), np.uint32)
  return np.ascontiguousarray(np.concatenate(chunks), dtype=np.uint32)


class _Sweeper:
  """A daemon thread that sweeps when the engine asks for it (enough uncounted entries)."""

  POLL_S = 0.2

  def __init__(self):
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()

  def start(self) -> None:
    global _previous
    with _sweep_lock:  # a new engine numbers its entries from 1: the last snapshot is stale
      _previous = None
    if self._thread is not None and self._thread.is_alive():
      return
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="jax_ssdtrain-sweeper", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    thread, self._thread = self._thread, None
    if thread is not None and thread is not threading.current_thread():
      thread.join(timeout=5 * self.POLL_S)

  def _run(self) -> None:
    while not self._stop.wait(self.POLL_S):
      try:
        if native.sweep_requested():
          _sweep(background=True)
      except Exception:  # noqa: BLE001 - the engine is being replaced or shut down
        time.sleep(self.POLL_S)


sweeper = _Sweeper()
