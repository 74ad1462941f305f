"""The split scan: a stack of layers scanned in two segments (the first ``split`` layers under
one ``jax.checkpoint`` policy, the rest under another), and the slicing of a stacked parameter
tree into those segments. ``Plan.scan``, the models' ``Stack`` and ``scripts/bench_planner.py``
run it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_ssdtrain._src.planner.checks import _check_int


def split_layers(params: Any, split: int) -> tuple[Any, Any]:
  """``(layers [0, split), layers [split, L))`` of ``params`` stacked on a leading axis of ``L``
  (every leaf ``(L, ...)``); an empty segment is None. Passed to :func:`split_scan` as
  arguments of their own (e.g. of a ``jax.jit``), the segments' gradients are two arrays, not
  concatenated into a second copy of the stack's (the planner's ``split_grad_copy=False``)."""
  _check_int("split", split, low=0)
  L = jax.tree.leaves(params)[0].shape[0]
  if split > L:
    raise ValueError(f"split: {split} layers > the {L} stacked layers")
  return tuple(
    jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], params) if hi > lo else None
    for lo, hi in ((0, split), (split, L))
  )


def split_scan(
  layer_fn: Callable,
  params: Any,
  x: Any,
  *,
  split: int | None,
  policies: tuple[Any, Any],
  prevent_cse: bool = False,
) -> Any:
  """A stack of layers as a split scan: layers ``[0, split)`` under ``policies[0]``, the others
  under ``policies[1]``; returns the last layer's output.

  Each segment is a ``jax.lax.scan`` of ``jax.checkpoint(layer_fn, policy=...)`` (a policy of
  None: no ``jax.checkpoint``, every residual kept), ``layer_fn(layer_params, x) -> x``. An
  empty segment is left out: ``split=0`` is one scan under ``policies[1]``, ``split=L`` one
  under ``policies[0]``. ``params``: the layers' parameters stacked on a leading axis of ``L``
  (sliced at ``split``), or with ``split=None`` the pair :func:`split_layers` returns.
  :meth:`Plan.scan` is this with the plan's split and ``Plan.policies()``; with your own scan,
  e.g.::

      first, rest = plan.policies()
      y = ssd.split_scan(layer_fn, stacked, x, split=plan.offload_layers, policies=(first, rest))

  ``prevent_cse`` is passed to ``jax.checkpoint`` (False by default, as is usual in a scan).
  """
  if len(policies) != 2:
    raise ValueError(f"policies: expected (first, rest), got {len(policies)} policies")
  segments = split_layers(params, split) if split is not None else params

  for policy, segment in zip(policies, segments):
    if segment is None:
      continue
    body = layer_fn
    if policy is not None:
      body = jax.checkpoint(layer_fn, policy=policy, prevent_cse=prevent_cse)
    x = jax.lax.scan(lambda h, p, body=body: (body(p, h), None), x, segment)[0]
  return x
