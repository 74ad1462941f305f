"""Hooks that let ``jax.checkpoint`` send tagged activations to the store.

``jax.checkpoint`` splits its body into a forward (known) and a backward (staged) jaxpr in
``partial_eval._partial_eval_jaxpr_custom_cached``, asking the policy about each equation. We
wrap that function: only when the policy is ours (an :class:`OffloadPolicy`, or JAX's
``save_from_both_policies`` with one of ours inside, see :class:`ComposedPolicy`) are the
``checkpoint_name`` tags it sends to the store rewritten into ``tag_p``, whose partial-eval
rule emits ``store`` on the known side and ``load`` on the staged side. Every other policy
reaches JAX untouched, so it behaves identically by construction.

Under ``jax_remat3`` tags bind ``CheckpointName`` (and ``CheckpointNameFwd``) instead; their
``remat`` methods get the same treatment.

``saved_residuals`` / ``print_saved_residuals`` name our residuals: ``named 'qkv' -> nvme``,
and, for the handles a scan returns stacked over its iterations, ``named 'qkv' -> nvme from
<where the tag is>, output of scan from <where the scan is>``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import sys
import threading
import warnings
import weakref

import jax

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.location import TIER_CODES, TIER_NAMES
from jax_ssdtrain._src.policies import StoreDecision, as_offloading, name_p, nbytes
from jax_ssdtrain._src.primitives import load_p, reload_p, store_p, tag_p

_site_ids = itertools.count(1)
_site_lock = threading.Lock()


def new_site_id() -> int:
  """A new site for a program's activations: positive, counted up from 1."""
  with _site_lock:
    return next(_site_ids)


def derived_site(key: tuple) -> int:
  """The store site of entries that later programs load (a streamed stack's leaves, an
  offloaded optimizer state's chunks), derived from ``key`` (what they hold: a tuple whose
  ``repr`` is stable), never from a counter, so that two inits of one model make equal layouts.
  Negative: never one of :func:`new_site_id`'s."""
  digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
  return -2 - (int.from_bytes(digest, "little") >> 2)


def install() -> None:
  """Installs the hooks once (idempotent); raises ImportError if JAX moved the internals."""
  pe = ji.PE_MODULE
  current = getattr(pe, ji.PARTIAL_EVAL_CUSTOM_CACHED)
  if not getattr(current, "_ssdtrain_hook", False):
    ji.check_partial_eval_call_site()
    setattr(pe, ji.PARTIAL_EVAL_CUSTOM_CACHED, _make_hook(current))
  for cls in ji.CHECKPOINT_NAME_CLASSES:
    _install_remat3(cls)
  _install_program_end()
  if ji.CHECKPOINT_NAME_CLASSES:
    _install_trace_release()
  _install_saved_residuals()


def _make_hook(original):
  @ji.weakref_lru_cache
  def offloading(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst, policy, nested):
    return original(
      _rewrite_tags(jaxpr, policy, nested),
      in_unknowns,
      in_inst,
      ensure_out_unknowns,
      ensure_out_inst,
      policy,
    )

  def hook(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst, saveable):
    ours = as_offloading(saveable)
    if ours is not None:
      _note_checkpoint(jaxpr, ours)
      # nested: a differentiation encloses this one (grad(grad(f)), jvp(grad(f))): the
      # backward then reloads with the recomputed value's tangent (primitives.reload_p).
      return offloading(
        jaxpr,
        in_unknowns,
        in_inst,
        ensure_out_unknowns,
        ensure_out_inst,
        ours,
        ji.under_differentiation(),
      )
    return original(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst, saveable)

  hook._ssdtrain_hook = True
  hook._ssdtrain_original = original
  return hook


def _rewrite_tags(jaxpr, policy, nested=False):
  """Turns the tags that ``policy`` sends to the store into ``tag_p`` equations."""
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    if eqn.primitive is name_p:
      decision = policy(name_p, eqn.invars[0].aval, **eqn.params)
      if isinstance(decision, StoreDecision):
        eqn = eqn.replace(
          primitive=tag_p,
          params=dict(
            name=eqn.params["name"],
            site=new_site_id(),
            tier=TIER_CODES[decision.location],
            nested=nested,
          ),
        )
        changed = True
    eqns.append(eqn)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


# ---------------------------------------------------------------------------------------------
# Policies that do less than they say: warned once per (policy, what it missed)
#
# Each checkpoint whose policy is ours adds what its body holds (every tag, at any depth; the
# tags the policy stores; those too small for it) to the record of its policy in the program
# being traced: the outermost jaxpr trace above it (jit's), whose ``to_jaxpr`` ends the program
# and checks the record, or, for a checkpoint applied eagerly, the checkpoint alone. A policy
# that lists a tag for the store that no checkpoint of the program has (eagerly: none of its
# tags is in the checkpoint), or whose tags all stay on the device for ``min_bytes``, or part of
# them, warns. JAX's own policies record nothing.


@dataclasses.dataclass
class _Seen:
  names: set = dataclasses.field(default_factory=set)  # every tag of the policy's checkpoints
  stored: set = dataclasses.field(default_factory=set)  # the tags it sends to the store
  small: set = dataclasses.field(default_factory=set)  # (tag, bytes) below min_bytes


_programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root trace -> {policy: _Seen}
_programs_lock = threading.Lock()
_warned: set = set()


def _note_checkpoint(jaxpr, policy) -> None:
  names, stored, small = _tags_of(jaxpr, policy)
  root = _program_trace()
  with _programs_lock:
    records = {} if root is None else _programs.setdefault(root, {})
    seen = records.setdefault(policy, _Seen())
    seen.names |= names
    seen.stored |= stored
    seen.small |= small
  if root is None:  # applied eagerly: the checkpoint is all we see of the program
    _check_program(records, whole=False)


def _program_trace():
  """The outermost jaxpr trace above the current one (jit's, for a jitted step), or None
  outside any (a checkpoint applied eagerly)."""
  trace, root = ji.current_trace(), None
  for _ in range(1000):
    if trace is None:
      break
    if isinstance(trace, ji.DynamicJaxprTrace):
      root = trace
    trace = getattr(trace, "parent_trace", None)
  return root


def _program_traced(trace) -> None:
  with _programs_lock:
    records = _programs.pop(trace, None)
  if records:
    _check_program(records)


def _check_program(records: dict, whole: bool = True) -> None:
  """Warns for what the policies of a program missed. Not ``whole`` (one checkpoint applied
  eagerly): its policy's tags may be in the program's other checkpoints, so missing ones are
  only warned about where none of them is in it."""
  for policy, seen in records.items():
    wanted = set(policy.store_names())
    missing = sorted(wanted - seen.names)
    if missing and (whole or len(missing) == len(wanted)):
      _warn_once(
        (policy, "missing", tuple(missing)),
        f"jax_ssdtrain: the tag(s) {', '.join(map(repr, missing))} of this policy are in no "
        "checkpoint that the traced program differentiates with it, so nothing is offloaded "
        f"for them (its checkpoints' tags: {', '.join(map(repr, sorted(seen.names))) or 'none'}"
        "); check the names given to checkpoint_name",
      )
    small = sorted(seen.small)
    if not small:
      continue
    sizes = ", ".join(f"{name!r} ({n} bytes)" for name, n in small)
    floor = getattr(policy, "min_bytes", None)
    floor = f"min_bytes={floor}" if floor is not None else "min_bytes"
    if not seen.stored:
      _warn_once(
        (policy, "small", tuple(small)),
        f"jax_ssdtrain: this checkpoint offloads nothing: the tags {sizes} are below the "
        f"policy's {floor} and stay on the device; lower min_bytes (e.g. min_bytes=0) "
        "to offload them",
      )
    else:
      _warn_once(
        (policy, "partly small", tuple(small)),
        f"jax_ssdtrain: this policy offloads only part of the traced program's tagged "
        f"tensors: those of {sizes} are below its {floor} and stay on the device (offloaded: "
        f"tags {', '.join(map(repr, sorted(seen.stored)))}); lower min_bytes to offload "
        "them too",
      )


def _warn_once(key, message: str) -> None:
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(message, RuntimeWarning, stacklevel=_user_stacklevel())


_LIBRARY_DIRS = tuple(
  os.path.dirname(m.__file__) + os.sep
  for m in (jax, sys.modules[__package__.split(".")[0]], os)  # os: the standard library's
)


def _user_stacklevel() -> int:
  """The ``stacklevel`` (from _warn_once) of the first frame outside JAX and jax_ssdtrain: the
  user's line that traced the program."""
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
    frame, level = frame.f_back, level + 1
  return level if frame is not None else 2


def _install_program_end() -> None:
  """A trace's frame turns it into a jaxpr when its tracing ends (every jaxpr trace, jit's
  included): the program traced in it is checked there. Only a trace a checkpoint with our
  policy recorded is looked at."""
  cls = ji.JaxprStackFrame
  original = cls.to_jaxpr
  if getattr(original, "_ssdtrain_hook", False):
    return

  @functools.wraps(original)
  def to_jaxpr(self, trace, *args, **kwargs):
    out = original(self, trace, *args, **kwargs)
    if _programs:
      _program_traced(trace)
    return out

  to_jaxpr._ssdtrain_hook = True
  cls.to_jaxpr = to_jaxpr


# Our primitives in a body: a tag already on its way to the store.
_OFFLOADED = (tag_p, store_p, load_p, reload_p)


@ji.weakref_lru_cache
def _tags_of(jaxpr, policy):
  """``(names, stored, small)`` of a checkpoint's body: every tag name in it and the bodies it
  calls; those ``policy`` sends to the store; ``(name, bytes)`` of those below its min_bytes.
  A checkpoint nested in the body has its own policy: its tags count as names only."""
  names, stored, small = set(), set(), set()

  def walk(j, decide):
    for eqn in ji.open_jaxpr(j).eqns:
      if eqn.primitive in _OFFLOADED:  # a body differentiated again (grad(grad(f)))
        names.add(eqn.params["name"])
        stored.add(eqn.params["name"])
      elif eqn.primitive is name_p:
        name, aval = eqn.params["name"], eqn.invars[0].aval
        names.add(name)
        if not decide:
          pass
        elif isinstance(policy(name_p, aval, **eqn.params), StoreDecision):
          stored.add(name)
        elif policy.too_small(name, aval):
          small.add((name, nbytes(aval)))
      for sub in ji.sub_jaxprs(eqn):
        walk(sub, decide and eqn.primitive.name not in ji.REMAT_PRIMITIVE_NAMES)

  walk(jaxpr, True)
  return frozenset(names), frozenset(stored), frozenset(small)


# ---------------------------------------------------------------------------------------------
# jax_remat3


def _install_remat3(cls) -> None:
  if getattr(cls.remat, "_ssdtrain_hook", False):
    return
  original = cls.remat
  forward_only = cls is ji.CHECKPOINT_NAME_FWD  # its saved value carries no tangent

  @functools.wraps(original)
  def remat(self, policy_or_trace, x):
    policy = as_offloading(ji.remat3_policy(policy_or_trace))
    if policy is None:
      return original(self, policy_or_trace, x)
    name, aval = self.params["name"], self.in_avals[0]
    decision = policy(name_p, aval, name=name)
    x = cls(name, aval)(x)
    if isinstance(decision, StoreDecision):
      params = dict(site=new_site_id(), tier=TIER_CODES[decision.location], name=name)
      # Under an enclosing differentiation (grad(grad(f)), jvp(grad(f)), hessian) the rem takes
      # every tangent of the loaded value from the recomputed one (reload_p), so the store
      # may pass the forward's tangent through (recomputed=True). Otherwise the rem is
      # JAX's primal_left_tangent_right, whose recomputation DCE drops when no tangent needs
      # it, and the store refuses forward-mode (a jaxpr differentiated later would lose the
      # loaded value's tangent). CheckpointNameFwd's rem has no usable recomputed value.
      nested = not forward_only and ji.under_differentiation()
      x, handle = store_p.bind(x, uses=None, **params, **({"recomputed": True} if nested else {}))
      reload = functools.partial(
        _reload, aval=aval, params=params, forward_only=forward_only, nested=nested
      )
      if ji.REMAT3_RETURNS_RESIDUALS:
        return x, handle, reload
      return x, functools.partial(reload, handle)
    saved = decision is True or isinstance(decision, ji.SaveableType)
    if ji.REMAT3_RETURNS_RESIDUALS:
      if saved:
        return x, x, (lambda res, _: res) if forward_only else ji.primal_left_tangent_right
      return x, (), lambda _, x_rem: x_rem
    if saved:
      return x, (lambda _: x) if forward_only else functools.partial(
        ji.primal_left_tangent_right, x
      )
    return x, lambda x_rem: x_rem

  remat._ssdtrain_hook = True
  cls.remat = remat


def _reload(handle, x_recomputed, *, aval, params, forward_only, nested):
  # The value comes from the store; the tangent flows through the recomputed input.
  if nested:  # every level's tangent from the recomputation (see primitives.reload_p)
    return reload_p.bind(handle, x_recomputed, aval=aval, **params)
  loaded = load_p.bind(handle, aval=aval, **params)
  if forward_only:
    return loaded
  return ji.primal_left_tangent_right(loaded, x_recomputed)


# JAX's eager remat3 (remat_transform) leaves the trace it builds the backward's jaxpr in alive,
# and with it every constant of that jaxpr: our handles (from a tag's rem, or stacked by a scan's
# remat rule), so no sweep could free their entries (see ji.REMAT_TRANSFORM). When the policy is
# ours, the wrapper below invalidates that trace once remat_transform has its jaxpr: the last
# DynamicJaxprTrace whose to_jaxpr ran inside the call (remat_transform's own, after the body).
_release = threading.local()


def _install_trace_release() -> None:
  cls = ji.DynamicJaxprTrace
  original_to_jaxpr = cls.to_jaxpr
  if not getattr(original_to_jaxpr, "_ssdtrain_hook", False):

    @functools.wraps(original_to_jaxpr)
    def to_jaxpr(self, *args, **kwargs):
      out = original_to_jaxpr(self, *args, **kwargs)
      slots = getattr(_release, "slots", None)
      if slots:
        slots[-1][:] = [self]
      return out

    to_jaxpr._ssdtrain_hook = True
    cls.to_jaxpr = to_jaxpr

  for module in ji.REMAT_TRANSFORM_MODULES:
    original = getattr(module, ji.REMAT_TRANSFORM)
    if getattr(original, "_ssdtrain_hook", False):
      continue
    setattr(module, ji.REMAT_TRANSFORM, _releasing(original))


def _releasing(original):
  @functools.wraps(original)
  def remat_transform(policy, *args, **kwargs):
    if as_offloading(policy) is None:  # JAX's own policies: untouched
      return original(policy, *args, **kwargs)
    slots = _release.__dict__.setdefault("slots", [])
    slot: list = []
    slots.append(slot)
    try:
      out = original(policy, *args, **kwargs)
    finally:
      slots.pop()
    if slot:  # the jaxpr and its constants are out: nothing reads that trace any more
      slot[0].invalidate()
    return out

  remat_transform._ssdtrain_hook = True
  return remat_transform


# ---------------------------------------------------------------------------------------------
# saved_residuals / print_saved_residuals


def _install_saved_residuals() -> None:
  module = ji.SAVED_RESIDUALS_MODULE
  original = getattr(module, ji.SAVED_RESIDUALS_FN)
  if getattr(original, "_ssdtrain_hook", False):
    return

  @functools.wraps(original)
  def saved_residuals(jaxpr, *args, **kwargs):
    results = original(jaxpr, *args, **kwargs)
    return _name_stored(jaxpr, results)

  saved_residuals._ssdtrain_hook = True
  setattr(module, ji.SAVED_RESIDUALS_FN, saved_residuals)


def _name_stored(jaxpr, results):
  """Names our residuals in JAX's descriptions: ``output of ssd_store from X`` becomes
  ``named 'tag' -> tier from X``, and a handle that a scan (jit, ...) returns, ``output of scan
  from Y``, becomes ``named 'tag' -> tier from X, output of scan from Y`` (X: where the tag is,
  inside the scan's body; the handles are stacked over the scan's iterations).

  JAX lists the residuals made by equations last, in jaxpr order (looking through
  reduce_precision), so those descriptions pair with the equations' residual outputs in order.
  Where the layout is not the one we know, JAX's text is left alone."""
  subst = _precision_subst(jaxpr)
  residuals = {_look_through(subst, v) for v in jaxpr.outvars if isinstance(v, ji.Var)}
  made = [(eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars) if v in residuals]
  if len(made) > len(results):
    return results
  out = list(results)
  for j, (eqn, i) in enumerate(made, start=len(results) - len(made)):
    aval, text = out[j]
    if not text.startswith("output of ") or " from " not in text:
      continue  # a tag of JAX's own ("named ..."), or a description we do not know
    found = _find_store(eqn, i)
    if found is None:
      continue
    store, index = found
    where = f"named {store.params['name']!r}"
    if index == 1:  # the handle: the value itself is in the store
      where += f" -> {TIER_NAMES[store.params['tier']]}"
    if store is eqn:
      out[j] = (aval, f"{where} from {text.split(' from ', 1)[1]}")
    else:
      out[j] = (aval, f"{where} from {ji.summarize_source_info(store.source_info)}, {text}")
  return out


def _find_store(eqn, i, depth=0):
  """``(store equation, its output index)`` that makes ``eqn.outvars[i]``, looking into the
  bodies of scans, jits, ... (``ji.output_body``); None where no store makes it."""
  if eqn.primitive is store_p:
    return eqn, i
  body = ji.output_body(eqn)
  if body is None or depth > 32:
    return None
  v = body.outvars[i]
  if not isinstance(v, ji.Var):
    return None
  v = _look_through(_precision_subst(body), v)
  for inner in body.eqns:
    if v in inner.outvars:
      return _find_store(inner, inner.outvars.index(v), depth + 1)
  return None  # an input of the body, passed through


def _precision_subst(jaxpr) -> dict:
  """As saved_residuals: a reduce_precision's output counts as its operand."""
  return {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"}


def _look_through(subst: dict, v):
  while v in subst:
    v = subst[v]
  return v
