"""The store/load primitive pair that carries an activation out of and back into a program.

``store(x) -> (x, handle)`` runs in the forward pass: the activation goes to the engine and
only the tiny ``handle`` (uint32[2]) stays a residual. ``load(handle) -> x`` runs in the
backward pass. Both lower to XLA FFI custom calls with ``has_side_effect=True`` (no JAX effect:
older JAX rejects effects inside remat); their order comes from the handle data dependency.
Each primitive's rules are registered right after it.

Lowering opens no store: a lowering rule registers the engine's FFI handlers (loads the library,
which XLA's compiler needs) and emits the custom call with its attributes, and marks the program
as one that uses the store (``config.mark_uses_store``); the store opens when such a program
first runs (see ``config.py``). ``lifetimes.py`` and ``sharded.py`` sit below this module and
are handed the primitives they need.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import attributes, config, lifetimes, native, sharded
from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.location import TIER_CODES, TIER_NAMES  # noqa: F401 (re-exported)
from jax_ssdtrain._src.native import COPY_TARGET, LOAD_TARGET, STORE_TARGET

HANDLE_AVAL = jax.core.ShapedArray((2,), np.dtype(np.uint32))
name_p = ji.name_p  # JAX's checkpoint_name tag


class HigherOrderOffloadError(NotImplementedError):
  """Forward-mode differentiation through an offloaded residual."""


def _lowering_uses_store(ctx) -> None:
  """What a store or load lowering does besides emitting its call: registers the handlers the
  compiler looks up (no store is opened) and marks the program, whose first run opens the store
  (config.py)."""
  native.register_targets()
  config.mark_uses_store(ctx.module_context)


def opaque_copy(x, *after, effect: bool = True):
  """``x``'s value through a custom call that XLA cannot see through (a copy), run once every
  array in ``after`` is computed (they are not read). The optimizer's streamed program passes
  the values its arithmetic reads and its results through one, and its device reference
  (``location="device"``) has one where the store's program has a store or a load: XLA then
  fuses and rewrites the arithmetic alike in both, and their results agree bit for bit. Each is
  side-effecting (``effect``), as the store and the load are: XLA neither hoists, merges nor
  drops it (pure copies of the values read were hoisted unlike the store's program on JAX 0.12).
  A handle passes a pure one (``effect=False``) to order its load after another. (An
  optimization barrier does neither: XLA:CPU removes it before fusing and scheduling.)

  The side effect is XLA's alone, as the store's and the load's: JAX sees no effect, so a failed
  call's error is raised through its results and nowhere else (``jax.ffi.ffi_call`` with
  ``has_side_effect`` would give JAX an effect whose runtime token keeps the error until the
  next ``jax.effects_barrier()``, or raises it at interpreter exit)."""
  if jnp.issubdtype(x.dtype, jnp.floating):  # as a store's lowering rounds what it stores
    x = _round_to_dtype(x)
  return copy_p.bind(x, *after, effect=bool(effect))


copy_p = ji.Primitive("ssd_opaque_copy")


def _copy_abstract_eval(x, *after, effect):
  del after, effect
  return x


copy_p.def_abstract_eval(_copy_abstract_eval)
copy_p.def_impl(lambda *args, **params: ji.apply_primitive(copy_p, *args, **params))


def _copy_lowering(ctx, x, *after, effect):
  native.register_targets()
  return jax.ffi.ffi_lowering(COPY_TARGET, has_side_effect=effect)(ctx, x, *after)


ji.register_lowering(copy_p, _copy_lowering)


# ---------------------------------------------------------------------------------------------
# store: x -> (x, handle)

store_p = ji.Primitive("ssd_store")
store_p.multiple_results = True


# Params (their codes are the engine header's, ssdtrain/attributes.h, read by attributes.py):
# site (the tag site, shared with its loads), tier (TIER_CODES), name (the tag, for messages),
# uses (loads per stored entry in one execution; None: counted when the program is lowered, see
# lifetimes.py; lifetimes.UNCOUNTED: released by sweeps only; lifetimes.LATER_IN_ORDER: by
# sweeps, loaded by later executions in store order; lifetimes.COUNTED_OR_LATER: counted, or
# LATER_IN_ORDER where the program's count is not definite), stream_pass (optional, default 0:
# a layer stack's store, the pass that stores one version of the stack, which streamed loads
# follow), stream_dir (optional, default STREAM_NONE: with stream_pass, the pass's layer order,
# STREAM_UP or STREAM_DOWN, which with a streamed load's says the loads' direction in store
# order), recomputed
# (optional, default False: True where a differentiation encloses the checkpoint and the backward
# takes the loaded value's tangent from a recomputation of the tagged value (reload_p):
# forward-mode passes it through).


# A pass's layer order (the handlers' "stream_dir": enum ssdtrain_stream_dir).
_STREAM_DIRS = (attributes.STREAM_UP, attributes.STREAM_DOWN, attributes.STREAM_NONE)


def _check_stream_dir(what, name, stream_pass, stream_dir):
  given = stream_dir != attributes.STREAM_NONE
  if stream_dir not in _STREAM_DIRS or (given and not stream_pass):
    raise ValueError(
      f"{what} of {name!r}: stream_dir: expected {attributes.STREAM_UP} (layers up) or "
      f"{attributes.STREAM_DOWN} (down) with a stream_pass, else {attributes.STREAM_NONE}; got "
      f"stream_dir={stream_dir!r} with stream_pass={stream_pass!r}"
    )


def _store_abstract_eval(
  x, *, site, tier, name, uses, recomputed=False, stream_pass=0, stream_dir=0
):
  del site, tier, uses, recomputed
  _check_stream_dir("store", name, stream_pass, stream_dir)
  return [x, HANDLE_AVAL]


store_p.def_abstract_eval(_store_abstract_eval)


def _store_impl(x, **params):
  # An eager store's handle leaves its (one-primitive) execution: sweeps release it. Sweep here,
  # outside any execution, when enough of them piled up.
  if native.available() and native.sweep_requested():
    lifetimes.collect()
  return ji.apply_primitive(store_p, x, **params)


store_p.def_impl(_store_impl)


def _round_to_dtype(x):
  finfo = jnp.finfo(x.dtype)
  return jax.lax.reduce_precision(x, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)


def _store_lowering(
  ctx, x, *, site, tier, name, uses, recomputed=False, stream_pass=0, stream_dir=0
):
  del recomputed  # a differentiation matter only
  _lowering_uses_store(ctx)
  if uses is None or uses == lifetimes.COUNTED_OR_LATER:
    counted = lifetimes.current_uses(site)
    later = uses == lifetimes.COUNTED_OR_LATER and counted == lifetimes.UNCOUNTED
    uses = lifetimes.LATER_IN_ORDER if later else counted
  (aval,) = ctx.avals_in
  if jnp.issubdtype(aval.dtype, jnp.floating):
    # As JAX does for residuals saved on the device (its PR 22244): the stored value and the
    # forward pass's own uses of it are the same, rounded to the dtype. Without this, XLA may
    # keep an excess-precision (e.g. f32) value for the forward while the store gets bf16.
    (x,) = ji.lower_fun(_round_to_dtype, multiple_results=False)(ctx.replace(avals_out=[aval]), x)
  if sharded.needs_partitioning(ctx):  # each device stores its own shard
    lowered = ji.lower_fun(
      functools.partial(
        sharded.store_handle, store_p=store_p, site=site, tier=tier, name=name, uses=uses
      ),
      multiple_results=False,
    )
    (handle,) = lowered(ctx.replace(avals_out=[HANDLE_AVAL]), x)
    return [x, handle]
  call = jax.ffi.ffi_lowering(STORE_TARGET, has_side_effect=True)
  (handle,) = call(
    ctx.replace(avals_out=[HANDLE_AVAL]),
    x,
    site=np.int64(site),
    tier=np.int32(tier),
    name=name,
    uses=np.int64(uses),
    stream_pass=np.int64(stream_pass),
    stream_dir=np.int32(stream_dir),
  )
  # The first result is the operand itself: no copy, and XLA keeps x alive until the call.
  return [x, handle]


ji.register_lowering(store_p, _store_lowering)
# The partitioned lowering (custom_partitioning) needs the device assignment.
ji.prim_requires_devices_during_lowering.add(store_p)


def _store_jvp(primals, tangents, **params):
  if params.get("recomputed", False):
    # The backward reloads the value with reload_p(h, x_recomputed): only the primal comes
    # from the store, every tangent from the recomputation. So the forward's tangent passes
    # through and the handle (integers) has none.
    (x,), (tx,) = primals, tangents
    y, handle = store_p.bind(x, **params)
    return [y, handle], [tx, ji.Zero(HANDLE_AVAL.to_tangent_aval())]
  raise HigherOrderOffloadError(
    f"jax_ssdtrain: forward-mode differentiation (e.g. jvp(grad(f)), hessian, grad(grad(f))) "
    f"through the SSD-offloaded activation {params['name']!r} is not supported: its tangent "
    f"would not reach the backward pass. Use a policy that saves or recomputes that tag for "
    f"higher-order derivatives there (they work where the outer differentiation encloses the "
    f"checkpoint directly, not through a scan body differentiated twice)."
  )


ji.primitive_jvps[store_p] = _store_jvp


def _store_batch(args, dims, **params):
  (x,), (d,) = args, dims
  x = jnp.moveaxis(x, d, 0)
  y, handle = store_p.bind(x, **params)
  # A batched handle makes the matching load batched too (an unbatched one would drop the axis).
  handle = jnp.broadcast_to(handle, (x.shape[0],) + handle.shape)
  return [y, handle], [0, 0]


ji.primitive_batchers[store_p] = _store_batch


@ji.dce_rule
def _store_dce(used_outputs, eqn):
  used_y, used_handle = used_outputs
  if used_handle:
    return [True], eqn
  if used_y:  # nobody loads it: the forward pass writes nothing, the tag stays a tag
    return [True], eqn.replace(
      primitive=name_p, params=dict(name=eqn.params["name"]), outvars=eqn.outvars[:1]
    )
  return [False], None


ji.dce_rules[store_p] = _store_dce


# ---------------------------------------------------------------------------------------------
# load: handle -> x

load_p = ji.Primitive("ssd_load")


# Params: aval, site, tier, name as the store's; exact (optional, default False): the entry was
# stored by an earlier execution (optimizer state): True reads the handle on the GPU (a sync)
# instead of predicting it (a prediction looks among this execution's entries of the site);
# "ordered" also promises that the loads of a site come in the order an earlier execution stored
# its entries (a streamed update's chunks): after the execution's first exact load, which reads
# its handle, the engine predicts them and checks on the device (a mismatch fails the step,
# as for activations); "stream" (a layer stack's loads, with stream_pass, a number the
# program's other passes do not use) that the pass's loads of each site step through the
# entries one execution stored there, one at a time in one direction of store order (the
# pass's first load of the site reads its handle; with stream_dir, the pass's layer order,
# and the store pass's, the engine knows the direction and predicts the second; without, the
# second reads its handle too and shows it); consume (optional, default False): this load is
# the entry's last, the engine releases it once its bytes are copied (optimizer state updated
# in place: the new version takes the old one's room).


# The handlers' "exact" attribute (enum ssdtrain_load_order), by load_p's `exact`.
_LOAD_ORDERS = {
  False: attributes.LOAD_ACTIVATION,
  True: attributes.LOAD_READ,
  "ordered": attributes.LOAD_STORE_ORDER,
  "stream": attributes.LOAD_STREAM,
}


def _load_abstract_eval(
  handle, *, aval, site, tier, name, exact=False, consume=False, stream_pass=0, stream_dir=0
):
  del handle, site, tier, consume
  if exact not in _LOAD_ORDERS:
    raise ValueError(
      f"load of {name!r}: exact: expected one of {list(_LOAD_ORDERS)}, got {exact!r}"
    )
  if (exact == "stream") != (stream_pass != 0):
    raise ValueError(
      f"load of {name!r}: stream_pass={stream_pass!r} goes with exact='stream' alone"
    )
  _check_stream_dir("load", name, stream_pass, stream_dir)
  return aval


load_p.def_abstract_eval(_load_abstract_eval)
load_p.def_impl(lambda h, **params: ji.apply_primitive(load_p, h, **params))


def _load_lowering(
  ctx, handle, *, aval, site, tier, name, exact=False, consume=False, stream_pass=0, stream_dir=0
):
  _lowering_uses_store(ctx)
  if sharded.needs_partitioning(ctx):  # each device loads its own shard
    if exact or consume:
      raise NotImplementedError(
        f"jax_ssdtrain: {name!r}: optimizer state made for one device is used in a program "
        "partitioned over several; call offload_optimizer(...).init with the parameters already "
        "placed on the mesh (NamedSharding), outside jit, so that each device streams its own "
        "blocks"
      )
    return ji.lower_fun(
      functools.partial(sharded.load, load_p=load_p, aval=aval, site=site, tier=tier, name=name),
      multiple_results=False,
    )(ctx, handle)
  call = jax.ffi.ffi_lowering(LOAD_TARGET, has_side_effect=True)
  return call(
    ctx,
    handle,
    site=np.int64(site),
    tier=np.int32(tier),
    name=name,
    exact=np.int32(_LOAD_ORDERS[exact]),
    consume=np.int32(consume),
    stream_pass=np.int64(stream_pass),
    stream_dir=np.int32(stream_dir),
  )


ji.register_lowering(load_p, _load_lowering)
ji.prim_requires_devices_during_lowering.add(load_p)


def _load_batch(
  args, dims, *, aval, site, tier, name, exact=False, consume=False, stream_pass=0, stream_dir=0
):
  (handle,), (d,) = args, dims
  # handle: [B, 2], every row equal (see _store_batch); the stored tensor is the batched one.
  size = handle.shape[d]
  handle = jax.lax.index_in_dim(handle, 0, axis=d, keepdims=False)
  batched = aval.update(shape=(size,) + tuple(aval.shape))
  extra = ({"exact": exact} if exact else {}) | ({"consume": True} if consume else {})
  extra |= {"stream_pass": stream_pass, "stream_dir": stream_dir} if stream_pass else {}
  return load_p.bind(handle, aval=batched, site=site, tier=tier, name=name, **extra), 0


ji.primitive_batchers[load_p] = _load_batch
# The handle is integer-valued: its tangent is always a symbolic zero, so no JVP rule is
# consulted; forward-mode through a store is refused at the store (see _store_jvp).


@ji.dce_rule
def _load_dce(used_outputs, eqn):
  # A consuming load is its entry's last: it runs where nothing reads its value too (an update
  # in place reads the old parameters only to release them), or the entry stays until a sweep.
  # JAX sees no effect on a load (see opaque_copy), so without this rule it drops such a load.
  if used_outputs[0] or eqn.params.get("consume", False):
    return [True], eqn
  return [False], None


ji.dce_rules[load_p] = _load_dce


# ---------------------------------------------------------------------------------------------
# reload: (handle, recomputed) -> x, a load whose tangent is the recomputed value's
#
# For higher-order derivatives (grad(grad(f)), jvp(grad(f)), hessian): a loaded value has no
# tangent of its own (its handle is integers), so where a differentiation encloses the
# checkpoint the backward also recomputes the tagged value and takes every tangent from that
# copy, at every level (the primal output of the JVP is a reload again). Its store passes the
# forward's tangent through (recomputed=True). The recomputation costs compute, and is only
# emitted then (remat.py decides).

reload_p = ji.Primitive("ssd_reload")
reload_p.def_abstract_eval(
  lambda handle, recomputed, **params: _load_abstract_eval(handle, **params)
)
reload_p.def_impl(lambda h, r, **params: ji.apply_primitive(reload_p, h, r, **params))


def _reload_lowering(ctx, handle, recomputed, **params):
  del recomputed  # only its tangent matters
  return _load_lowering(ctx.replace(avals_in=ctx.avals_in[:1]), handle, **params)


ji.register_lowering(reload_p, _reload_lowering)
ji.prim_requires_devices_during_lowering.add(reload_p)


def _reload_jvp(primals, tangents, **params):
  (handle, recomputed), (_, t_recomputed) = primals, tangents
  y = reload_p.bind(handle, recomputed, **params)
  if type(t_recomputed) is ji.Zero:
    t_recomputed = ji.Zero(params["aval"].to_tangent_aval())
  return y, t_recomputed


ji.primitive_jvps[reload_p] = _reload_jvp


def _reload_batch(args, dims, *, aval, site, tier, name):
  (handle, recomputed), (dh, dr) = args, dims
  if dh is None:  # not mapped: the store saw an unbatched value: so did the recomputation
    raise NotImplementedError(
      f"jax_ssdtrain: tag {name!r}: vmap of a reload whose handle is not batched but whose "
      "recomputed value is; please report this with the program"
    )
  size = handle.shape[dh]
  handle = jax.lax.index_in_dim(handle, 0, axis=dh, keepdims=False)
  batched = aval.update(shape=(size,) + tuple(aval.shape))
  if dr is None:
    recomputed = jnp.broadcast_to(recomputed, batched.shape)
  else:
    recomputed = jnp.moveaxis(recomputed, dr, 0)
  return reload_p.bind(handle, recomputed, aval=batched, site=site, tier=tier, name=name), 0


ji.primitive_batchers[reload_p] = _reload_batch


# ---------------------------------------------------------------------------------------------
# tag: a checkpoint_name tag that the policy sends to the store (exists only during partial eval)

tag_p = ji.Primitive("ssd_tag")


# Params: name, site, tier as the store's; nested (optional, default False): a differentiation
# encloses the checkpoint, so the backward reloads with the recomputed value's tangent.


def _tag_abstract_eval(x, *, name, site, tier, nested=False):
  del name, site, tier, nested
  return x


tag_p.def_abstract_eval(_tag_abstract_eval)
tag_p.def_impl(lambda x, **_: x)
ji.register_lowering(tag_p, lambda ctx, x, **_: [x])
ji.deflinear2(tag_p, lambda ct, _, **params: [ct])


def _tag_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  del saveable
  (unknown,), (instantiated,) = unks_in, inst_in
  as_name = eqn.replace(primitive=name_p, params=dict(name=eqn.params["name"]))
  if unknown:  # computed in the backward pass anyway: a plain tag there
    return None, as_name, [True], [True], []
  params = eqn.params
  nested = params.get("nested", False)
  handle = ji.Var(HANDLE_AVAL)
  (y,) = eqn.outvars
  store_params = dict(site=params["site"], tier=params["tier"], name=params["name"], uses=None)
  if nested:
    store_params["recomputed"] = True
  known = eqn.replace(primitive=store_p, outvars=[y, handle], params=store_params)
  load_params = dict(aval=y.aval, site=params["site"], tier=params["tier"], name=params["name"])
  if not nested:
    staged = eqn.replace(primitive=load_p, invars=[handle], outvars=[y], params=load_params)
    return known, staged, [False], [True], [handle]
  # The tag's operand, recomputed in the backward (or saved, if the backward cannot recompute
  # it), carries the tangent; the value itself comes from the store.
  (x,) = eqn.invars
  residuals = [handle] + ([x] if isinstance(x, ji.Var) and not instantiated else [])
  staged = eqn.replace(primitive=reload_p, invars=[handle, x], outvars=[y], params=load_params)
  return known, staged, [False], [True], residuals


ji.partial_eval_jaxpr_custom_rules[tag_p] = _tag_partial_eval_custom


def _tag_batch(args, dims, **params):
  return tag_p.bind(args[0], **params), dims[0]


ji.primitive_batchers[tag_p] = _tag_batch


# The primitives whose first operand is a store's handle: lifetimes.py counts them (the package's
# __init__ hands them to lifetimes.install_lowering_hook).
LOAD_PRIMITIVES = (load_p, reload_p)
