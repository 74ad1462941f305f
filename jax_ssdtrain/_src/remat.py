"""Hooks that let ``jax.checkpoint`` send tagged activations to the store.

``jax.checkpoint`` splits its body into a forward (known) and a backward (staged) jaxpr in
``partial_eval._partial_eval_jaxpr_custom_cached``, asking the policy about each equation. We
wrap that function: only when the policy is an :class:`OffloadPolicy` are the
``checkpoint_name`` tags it sends to the store rewritten into ``tag_p``, whose partial-eval rule
emits ``store`` on the known side and ``load`` on the staged side. Every other policy reaches
JAX untouched, so it behaves identically by construction.

Under ``jax_remat3`` tags bind ``CheckpointName`` instead; its ``remat`` method gets the same
treatment.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import threading

from jax._src import ad_checkpoint
from jax._src.interpreters import partial_eval as pe
from jax._src.util import weakref_lru_cache

from jax_ssdtrain._src.policies import OffloadPolicy, StoreDecision, name_p
from jax_ssdtrain._src.primitives import TIER_CODES, load_p, store_p, tag_p

_site_ids = itertools.count(1)
_site_lock = threading.Lock()


def new_site_id() -> int:
  with _site_lock:
    return next(_site_ids)


def install() -> None:
  """Installs the hooks once (idempotent); raises ImportError if JAX moved the internals."""
  current = getattr(pe, "_partial_eval_jaxpr_custom_cached", None)
  if current is None:
    raise ImportError("jax_ssdtrain: this JAX has no partial_eval._partial_eval_jaxpr_custom_cached;"
                      f" jax {_jax_version()} is not supported")
  if getattr(current, "_ssdtrain_hook", False):
    return
  _check_call_site()
  pe._partial_eval_jaxpr_custom_cached = _make_hook(current)
  _install_remat3()


def _check_call_site() -> None:
  # The cached function hides its signature; check how JAX calls it instead.
  caller = getattr(pe, "partial_eval_jaxpr_stateful", None)
  try:
    source = inspect.getsource(caller) if caller is not None else ""
  except (OSError, TypeError):
    source = ""
  if "_partial_eval_jaxpr_custom_cached(" not in source or "saveable)" not in source:
    raise ImportError("jax_ssdtrain: partial_eval.partial_eval_jaxpr_stateful no longer calls "
                      "_partial_eval_jaxpr_custom_cached(jaxpr, in_unknowns, in_inst, "
                      "ensure_out_unknowns, ensure_out_inst, saveable); jax "
                      f"{_jax_version()} is not supported")


def _make_hook(original):
  @weakref_lru_cache
  def offloading(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst, policy):
    return original(_rewrite_tags(jaxpr, policy), in_unknowns, in_inst, ensure_out_unknowns,
                    ensure_out_inst, policy)

  def hook(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst, saveable):
    if isinstance(saveable, OffloadPolicy):
      return offloading(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst,
                        saveable)
    return original(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, ensure_out_inst,
                    saveable)

  hook._ssdtrain_hook = True
  hook._ssdtrain_original = original
  return hook


def _rewrite_tags(jaxpr, policy: OffloadPolicy):
  """Turns the tags that ``policy`` sends to the store into ``tag_p`` equations."""
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    if eqn.primitive is name_p:
      decision = policy(name_p, eqn.invars[0].aval, **eqn.params)
      if isinstance(decision, StoreDecision):
        eqn = eqn.replace(primitive=tag_p, params=dict(
            name=eqn.params["name"], site=new_site_id(), tier=TIER_CODES[decision.location]))
        changed = True
    eqns.append(eqn)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _install_remat3() -> None:
  cls = getattr(ad_checkpoint, "CheckpointName", None)
  if cls is None or getattr(cls.remat, "_ssdtrain_hook", False):
    return
  original = cls.remat

  @functools.wraps(original)
  def remat(self, policy_or_trace, x):
    # jax 0.10 passes the policy, jax 0.11 the RematTrace that holds it.
    policy = getattr(policy_or_trace, "policy", policy_or_trace)
    if not isinstance(policy, OffloadPolicy):
      return original(self, policy_or_trace, x)
    name, aval = self.params["name"], self.in_avals[0]
    decision = policy(name_p, aval, name=name)
    if isinstance(decision, StoreDecision):
      params = dict(site=new_site_id(), tier=TIER_CODES[decision.location], name=name)
      x, handle = store_p.bind(cls(name, aval)(x), **params)
      return x, functools.partial(_reload, handle, aval, params)
    if decision:
      return x, functools.partial(ad_checkpoint.primal_left_tangent_right, x)
    return x, lambda x_recomputed: x_recomputed

  remat._ssdtrain_hook = True
  cls.remat = remat


def _reload(handle, aval, params, x_recomputed):
  # The value comes from the store; the tangent flows through the recomputed input.
  loaded = load_p.bind(handle, aval=aval, **params)
  return ad_checkpoint.primal_left_tangent_right(loaded, x_recomputed)


def _jax_version() -> str:
  import jax
  return jax.__version__
