"""Float32 master weights in the optimizer state: ``with_master_weights(tx)``.

The model trains on low-precision parameters (bfloat16: 2 bytes each on the device, and
gradients of that dtype); the optimizer state keeps a float32 copy of every floating-point
parameter, ``tx`` updates that copy, and the update returned moves each parameter to the new
copy's rounding. Under ``offload_optimizer`` the copy streams through the device with ``tx``'s
own state, chunk by chunk, so that the device holds 4 bytes per parameter (parameters and
gradients) and the store 12 per version (the copy and Adam's two moments).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_ssdtrain._src.optimizer import floating_dtype


class MasterWeightsState(NamedTuple):
  """``master``: the high-precision copy of the parameters; ``inner``: ``tx``'s state."""

  master: Any
  inner: Any


def with_master_weights(tx: Any, dtype: Any = jnp.float32):
  """Wraps an optax transformation so that it updates a ``dtype`` copy of the parameters.

  ``init`` takes the parameters at full precision (initialise them in float32, call ``init``,
  then cast them to bfloat16 for training); every floating-point leaf's copy is made in
  ``dtype``, other leaves are kept as they are. ``update(grads, state, params)`` runs ``tx`` on
  the copy (``tx`` sees the copy as its ``params``: weight decay decays the float32 values) and
  returns, for each floating-point parameter, the update that ``optax.apply_updates`` (or
  :func:`jax_ssdtrain.apply_gradients`) turns into the new copy rounded to the parameter's
  dtype: the parameters then equal ``state.master`` cast to their dtype. Not always exactly: an
  update is a float32 difference added to the old parameter, and where a value shrinks more
  than about 2**15-fold in one step (near zero, crossing it) that difference rounds, and the
  parameter lands a few of its dtype's spacings from the copy's rounding. The copy is not
  affected, and the next step starts again from it. Non-floating leaves get zero updates.

  Compose it inside :func:`jax_ssdtrain.offload_optimizer` to stream the copy with the rest of
  the state: ``offload_optimizer(with_master_weights(tx), location="host")``.
  """
  import optax  # an optional dependency (the demo extra): needed only by this function

  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")
  dtype = floating_dtype(dtype)

  def init_fn(params):
    master = jax.tree.map(lambda p: _master_copy(p, dtype), params)
    return MasterWeightsState(master, tx.init(master))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, MasterWeightsState):
      raise TypeError(
        f"state: expected the MasterWeightsState that with_master_weights(...).init made, got "
        f"{type(state).__name__}"
      )
    if params is None:
      raise ValueError(
        "params: with_master_weights needs the parameters the model trains on, to compute "
        "the updates that move them to the new master copy"
      )
    inner_updates, inner = tx.update(updates, state.inner, state.master, **extra_args)
    master = optax.apply_updates(state.master, inner_updates)
    moves = jax.tree.map(_move_to, master, params)
    return moves, MasterWeightsState(master, inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _master_copy(p, dtype):
  p = jnp.asarray(p)
  return p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p


def _move_to(master, param):
  """The update that takes ``param`` to ``master`` rounded to ``param``'s dtype, in ``master``'s
  dtype: ``param + update`` there is that rounding, which ``optax.apply_updates`` casts back."""
  param = jnp.asarray(param)
  if not jnp.issubdtype(param.dtype, jnp.floating):
    return jnp.zeros_like(param)
  return master.astype(param.dtype).astype(master.dtype) - param.astype(master.dtype)
