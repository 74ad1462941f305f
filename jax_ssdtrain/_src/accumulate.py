"""Gradient accumulation that runs the inner update only when it applies.

``optax.MultiSteps(tx, k)`` runs ``tx.update`` at every micro-step and keeps its result only at
the k-th (a ``jnp.where`` over the state): with ``tx``'s state in the store that streams the
whole state through the device at every micro-step. :func:`accumulate_gradients` accumulates the
same way (the mean, as MultiSteps' Welford update, in float32) but calls ``tx.update`` inside a
``lax.cond``, so that the state streams once per ``k`` micro-steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ssdtrain._src.optimizer import apply_gradients, floating_dtype


class AccumulateState(NamedTuple):
  mini_step: jax.Array  # int32: micro-steps accumulated since the last update
  # The running mean of the gradients (float32, or accumulate_gradients' dtype) of mini_step
  # micro-steps; at mini_step 0 the last update's mean, which the next micro-step replaces (no
  # reset: one tree).
  acc_grads: Any
  inner_state: Any  # tx's state


def accumulate_gradients(tx: Any, every_k: int, *, dtype: Any = jnp.float32):
  """Averages the gradients of ``every_k`` micro-steps and applies ``tx`` to the mean at the
  last of them (the updates are zero at the others), calling ``tx.update`` only then.

  The results are those of ``optax.MultiSteps(tx, every_k)`` (its default mean). Use it around
  :func:`offload_optimizer`: ``accumulate_gradients(offload_optimizer(tx), k)``; through
  :func:`jax_ssdtrain.apply_gradients` the inner transformation's own ``apply_gradients`` runs
  at the last micro-step (with the store, the updates added to the parameters in place).

  ``dtype``: of the running mean, which stays on the device (4 bytes per parameter in float32,
  MultiSteps' own). ``jnp.bfloat16`` halves it where bfloat16 parameters leave no room for a
  float32 tree (``with_master_weights``): each micro-step's mean then rounds to bfloat16 (the
  gradients of bfloat16 parameters are bfloat16 already), and the results no longer equal
  MultiSteps'.
  """
  import optax  # an optional dependency (the demo extra): needed only by this function

  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")
  if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
    raise ValueError(f"every_k: expected an integer >= 1, got {every_k!r}")
  dtype = floating_dtype(dtype)

  def init_fn(params):
    acc = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype), params)
    return AccumulateState(jnp.zeros((), jnp.int32), acc, tx.init(params))

  def accumulated(updates, state):
    # MultiSteps' mean: one elementwise pass that XLA runs in place on the (donated) running
    # mean. At the first micro-step MultiSteps starts from zeros, where the mean is the gradient
    # itself (0 + (g - 0) / 1), and it is selected as such: a jnp.zeros_like tree would be
    # materialized (XLA merges it with the backward pass's zero-initialized gradient buffers,
    # one broadcast with two outputs: on an H100, a second tree of the parameters' size among
    # the step's temporaries). Resetting the mean after the update would make one too.
    first = state.mini_step == 0

    def add(g, a):
      mean = (a + (g - a) / (state.mini_step + 1)).astype(dtype)
      return jnp.where(first, jnp.asarray(g).astype(dtype), mean)

    acc = jax.tree.map(add, updates, state.acc_grads)
    return acc, state.mini_step == every_k - 1

  def next_state(state, acc, inner):
    return AccumulateState((state.mini_step + 1) % every_k, acc, inner)

  def update_fn(updates, state, params=None, **extra_args):
    acc, emit = accumulated(updates, state)

    def apply(inner):
      grads = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
      return tx.update(grads, inner, params, **extra_args)

    def skip(inner):
      shapes = jax.eval_shape(apply, inner)[0]
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner

    new_updates, inner = jax.lax.cond(emit, apply, skip, state.inner_state)
    return new_updates, next_state(state, acc, inner)

  def apply_fn(updates, state, params, **extra_args):  # apply_gradients' form
    acc, emit = accumulated(updates, state)

    def apply(operands):
      inner, params = operands
      grads = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
      return apply_gradients(tx, grads, inner, params, **extra_args)

    def keep(operands):
      inner, params = operands
      return params, inner

    new_params, inner = jax.lax.cond(emit, apply, keep, (state.inner_state, params))
    return new_params, next_state(state, acc, inner)

  update_fn.apply_gradients = apply_fn
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
