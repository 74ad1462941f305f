"""Store and load under SPMD partitioning: every device stores and loads only its own shard.

A custom call with a side effect cannot be partitioned by XLA on its own (it would either be
refused or have its operand gathered to every device). When a program is partitioned over
several devices, the store and load lowerings go through ``custom_partitioning`` instead:

* ``store``: the handle is computed per device from the local shard of ``x``, whose sharding is
  kept as propagation chose it (no resharding); the handle is declared replicated
  (a need-replication factor), so it is never split or moved. Each device's handle names its
  own entry; the engine refuses a handle on any other device than the one that stored it.
* ``load``: its result dimensions are result-only factors, so their sharding comes from the
  consumers of the loaded tensor. The partition callback then loads with exactly the sharding
  the matching store saw (recorded per site during the same compilation): were the two ever to
  differ, XLA reshards the loaded tensor (correct, at the cost of communication) instead of the
  engine handing out bytes of another layout.

Inside ``shard_map`` (every mesh axis manual) and on one device the calls lower directly.

The recorded sharding is that of the latest compiled store of the site: a forward and a
backward pass compiled as two programs (``jax.vjp`` across jits) pair up as long as nothing
recompiles that store with another sharding in between; compiling one site with different
shardings from several threads at once is not supported. Under GSPMD
(``jax_use_shardy_partitioner=False``) the same callbacks partition the calls; the load's
sharding is then guessed before partitioning and XLA may reshard around it.
"""

from __future__ import annotations

import threading

from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_ssdtrain._src import jax_internals as ji

_HANDLE_FACTOR = "ssd_handle"


def needs_partitioning(ctx) -> bool:
  """True when the program being lowered is SPMD-partitioned over several devices."""
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, ji.SPMDAxisContext):  # shard_map
    mesh = axis_context.mesh
    return mesh.size > 1 and set(axis_context.manual_axes) != set(mesh.axis_names)
  if isinstance(axis_context, ji.ShardingContext):  # jit
    return axis_context.num_devices > 1
  return False  # pmap replicas: each lowers its own calls


def store_handle(x, *, store_p, site: int, tier: int, name: str, uses: int):
  """The store's handle, partitioned per device (call while lowering; traced by lower_fun).
  ``uses`` comes from the whole program's count: the per-device module XLA's partitioner lowers
  later sees the handle as its output."""
  return _store_fn(store_p, site, tier, name, uses)(x)


def load(handle, *, load_p, aval, site: int, tier: int, name: str):
  """The load, partitioned per device (call while lowering; traced by lower_fun)."""
  return _load_fn(load_p, aval, site, tier, name)(handle)


# ---------------------------------------------------------------------------------------------
# Implementation

# site -> sharding of the stored operand, written by the store's partition callback and read by
# the load's (the partitioner visits a store before the loads that use its handle).
_store_shardings: dict[int, object] = {}
_lock = threading.Lock()


def _factors(prefix: str, ndim: int) -> tuple[str, ...]:
  return tuple(f"{prefix}{i}" for i in range(ndim))


def _local_aval(aval, shape):
  """The per-device aval of a global one: its shape, and under explicit mesh axes
  (``AxisType.Explicit``, where the sharding is part of the type) no sharding left on it: the
  global spec would claim the local shape is split again."""
  sharding = getattr(aval, "sharding", None)
  if sharding is None or not hasattr(sharding, "update"):
    return aval.update(shape=shape)
  return aval.update(shape=shape, sharding=sharding.update(spec=PartitionSpec()))


def _stored_sharding(site):
  """The sharding the latest compiled store of ``site`` saw (None where none was compiled)."""
  with _lock:
    return _store_shardings.get(site)


def _partitioned(local, partition, rule, infer):
  """``local`` under ``custom_partitioning`` with these callbacks (Shardy's ``rule``, GSPMD's
  ``infer``); a consumer's sharding of the result propagates as it is."""
  fn = custom_partitioning(local)
  fn.def_partition(
    partition=partition,
    sharding_rule=rule,
    infer_sharding_from_operands=infer,
    propagate_user_sharding=lambda mesh, user_shape: user_shape.sharding,
  )
  return fn


def _replicated(mesh, like):
  if mesh is not None and not mesh.empty:
    return NamedSharding(mesh, PartitionSpec())
  return ji.GSPMDSharding.get_replicated(like._device_assignment)


def _store_fn(store_p, site, tier, name, uses):
  def local_store(x):
    return store_p.bind(x, site=site, tier=tier, name=name, uses=uses)[1]

  def rule(mesh, operand_types, result_types):
    del mesh, result_types
    ndim = len(operand_types[0].shape)
    return SdyShardingRule(
      operand_mappings=(_factors("x", ndim),),
      result_mappings=((_HANDLE_FACTOR,),),
      need_replication_factors=(_HANDLE_FACTOR,),
    )

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x_sharding = arg_shapes[0].sharding
    with _lock:
      _store_shardings[site] = x_sharding
    return mesh, local_store, _replicated(mesh, x_sharding), (x_sharding,)

  def infer(mesh, arg_shapes, result_shape):  # GSPMD (jax_use_shardy_partitioner=False)
    del result_shape
    return _replicated(mesh, arg_shapes[0].sharding)

  return _partitioned(local_store, partition, rule, infer)


def _load_fn(load_p, aval, site, tier, name):
  def local_load(handle):  # only traced on one device (custom_partitioning's impl)
    return load_p.bind(handle, aval=aval, site=site, tier=tier, name=name)

  def rule(mesh, operand_types, result_types):
    del mesh, operand_types
    ndim = len(result_types[0].shape)
    return SdyShardingRule(
      operand_mappings=((_HANDLE_FACTOR,),),
      result_mappings=(_factors("y", ndim),),
      need_replication_factors=(_HANDLE_FACTOR,),
    )

  def partition(mesh, arg_shapes, result_shape):
    proposed = result_shape.sharding
    stored = _stored_sharding(site)
    out_sharding = proposed
    if stored is not None and stored._device_assignment == proposed._device_assignment:
      out_sharding = stored
    shard_aval = _local_aval(aval, tuple(out_sharding.shard_shape(aval.shape)))

    def lower_fn(handle):
      return load_p.bind(handle, aval=shard_aval, site=site, tier=tier, name=name)

    return mesh, lower_fn, out_sharding, (_replicated(mesh, arg_shapes[0].sharding),)

  def infer(mesh, arg_shapes, result_shape):
    # GSPMD asks before any partition callback ran: the store's sharding of an earlier
    # compilation if any, else replicated (the partition callback still loads the shard).
    del result_shape
    stored = _stored_sharding(site)
    return stored if stored is not None else _replicated(mesh, arg_shapes[0].sharding)

  return _partitioned(local_load, partition, rule, infer)
