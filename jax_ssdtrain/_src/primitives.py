"""The store/load primitive pair that carries an activation out of and back into a program.

``store(x) -> (x, handle)`` runs in the forward pass: the activation goes to the engine and
only the tiny ``handle`` (uint32[2]) stays a residual. ``load(handle) -> x`` runs in the
backward pass. Both lower to XLA FFI custom calls with ``has_side_effect=True`` (no JAX effect:
older JAX rejects effects inside remat); their order comes from the handle data dependency.
Each primitive's rules are registered right after it.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src import dispatch

from jax_ssdtrain._src import sharded

from jax_ssdtrain._src.policies import Location, name_p

HANDLE_AVAL = core.ShapedArray((2,), np.dtype(np.uint32))

# Engine tier codes, shared with xla_ffi (attribute "tier").
TIER_CODES = {Location.NVME: 0, Location.HOST: 1}

STORE_TARGET = "ssdtrain_store"
LOAD_TARGET = "ssdtrain_load"


class HigherOrderOffloadError(NotImplementedError):
  """Forward-mode differentiation through an offloaded residual."""


def _ensure_engine():
  # Imported lazily: configuring the engine creates the default store directory.
  from jax_ssdtrain._src import config
  config.ensure_configured()


# ---------------------------------------------------------------------------------------------
# store: x -> (x, handle)

store_p = core.Primitive("ssd_store")
store_p.multiple_results = True


def _store_abstract_eval(x, *, site, tier, name):
  del site, tier, name
  return [x, HANDLE_AVAL]


store_p.def_abstract_eval(_store_abstract_eval)
store_p.def_impl(lambda x, **params: dispatch.apply_primitive(store_p, x, **params))


def _store_lowering(ctx, x, *, site, tier, name):
  _ensure_engine()
  if sharded.needs_partitioning(ctx):  # each device stores its own shard
    lowered = mlir.lower_fun(functools.partial(sharded.store_handle, store_p=store_p, site=site,
                                               tier=tier, name=name), multiple_results=False)
    handle, = lowered(ctx.replace(avals_out=[HANDLE_AVAL]), x)
    return [x, handle]
  call = jax.ffi.ffi_lowering(STORE_TARGET, has_side_effect=True)
  handle, = call(ctx.replace(avals_out=[HANDLE_AVAL]), x,
                 site=np.int64(site), tier=np.int32(tier), name=name)
  # The first result is the operand itself: no copy, and XLA keeps x alive until the call.
  return [x, handle]


mlir.register_lowering(store_p, _store_lowering)
# The partitioned lowering (custom_partitioning) needs the device assignment.
dispatch.prim_requires_devices_during_lowering.add(store_p)


def _store_jvp(primals, tangents, **params):
  del primals, tangents
  raise HigherOrderOffloadError(
      f"jax_ssdtrain: forward-mode differentiation (e.g. jvp(grad(f)), hessian, grad(grad(f))) "
      f"through the SSD-offloaded activation {params['name']!r} is not supported: its tangent "
      f"would not reach the backward pass. Use a policy that saves or recomputes that tag for "
      f"higher-order derivatives.")


ad.primitive_jvps[store_p] = _store_jvp


def _store_batch(args, dims, *, site, tier, name):
  (x,), (d,) = args, dims
  x = batching.moveaxis(x, d, 0)
  y, handle = store_p.bind(x, site=site, tier=tier, name=name)
  # A batched handle makes the matching load batched too (an unbatched one would drop the axis).
  handle = jnp.broadcast_to(handle, (x.shape[0],) + handle.shape)
  return [y, handle], [0, 0]


batching.primitive_batchers[store_p] = _store_batch


def _store_dce(used_outputs, eqn):
  used_y, used_handle = used_outputs
  if used_handle:
    return [True], eqn
  if used_y:  # nobody loads it: the forward pass writes nothing, the tag stays a tag
    return [True], eqn.replace(primitive=name_p, params=dict(name=eqn.params["name"]),
                               outvars=eqn.outvars[:1])
  return [False], None


pe.dce_rules[store_p] = _store_dce


# ---------------------------------------------------------------------------------------------
# load: handle -> x

load_p = core.Primitive("ssd_load")


def _load_abstract_eval(handle, *, aval, site, tier, name):
  del handle, site, tier, name
  return aval


load_p.def_abstract_eval(_load_abstract_eval)
load_p.def_impl(lambda h, **params: dispatch.apply_primitive(load_p, h, **params))


def _load_lowering(ctx, handle, *, aval, site, tier, name):
  _ensure_engine()
  if sharded.needs_partitioning(ctx):  # each device loads its own shard
    return mlir.lower_fun(functools.partial(sharded.load, load_p=load_p, aval=aval, site=site,
                                            tier=tier, name=name), multiple_results=False)(ctx, handle)
  call = jax.ffi.ffi_lowering(LOAD_TARGET, has_side_effect=True)
  return call(ctx, handle, site=np.int64(site), tier=np.int32(tier), name=name)


mlir.register_lowering(load_p, _load_lowering)
dispatch.prim_requires_devices_during_lowering.add(load_p)


def _load_batch(args, dims, *, aval, site, tier, name):
  (handle,), (d,) = args, dims
  # handle: [B, 2], every row equal (see _store_batch); the stored tensor is the batched one.
  size = handle.shape[d]
  handle = jax.lax.index_in_dim(handle, 0, axis=d, keepdims=False)
  batched = aval.update(shape=(size,) + tuple(aval.shape))
  return load_p.bind(handle, aval=batched, site=site, tier=tier, name=name), 0


batching.primitive_batchers[load_p] = _load_batch
# The handle is integer-valued: its tangent is always a symbolic zero, so no JVP rule is
# consulted; forward-mode through a store is refused at the store (see _store_jvp).


# ---------------------------------------------------------------------------------------------
# tag: a checkpoint_name tag that the policy sends to the store (exists only during partial eval)

tag_p = core.Primitive("ssd_tag")


def _tag_abstract_eval(x, *, name, site, tier):
  del name, site, tier
  return x


tag_p.def_abstract_eval(_tag_abstract_eval)
tag_p.def_impl(lambda x, **_: x)
mlir.register_lowering(tag_p, lambda ctx, x, **_: [x])
ad.deflinear2(tag_p, lambda ct, _, **params: [ct])


def _tag_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  del saveable
  (unknown,) = unks_in
  as_name = eqn.replace(primitive=name_p, params=dict(name=eqn.params["name"]))
  del inst_in
  if unknown:  # computed in the backward pass anyway: a plain tag there
    return None, as_name, [True], [True], []
  params = eqn.params
  handle = core.Var(HANDLE_AVAL)
  (y,) = eqn.outvars
  known = eqn.replace(primitive=store_p, outvars=[y, handle],
                      params=dict(site=params["site"], tier=params["tier"], name=params["name"]))
  staged = eqn.replace(primitive=load_p, invars=[handle], outvars=[y],
                       params=dict(aval=y.aval, site=params["site"],
                                   tier=params["tier"], name=params["name"]))
  return known, staged, [False], [True], [handle]


pe.partial_eval_jaxpr_custom_rules[tag_p] = _tag_partial_eval_custom


def _tag_batch(args, dims, **params):
  return tag_p.bind(args[0], **params), dims[0]


batching.primitive_batchers[tag_p] = _tag_batch
