"""MaxText with SSD offload: its ``offload`` tensors go to the jax_ssdtrain store.

MaxText tags its decoder layers' activations with ``checkpoint_name`` and, under
``remat_policy: custom``, gives each tag ``remat | device | offload``, where ``offload`` means
JAX's pinned-host offload; the ``qkv_proj_offloaded`` / ``minimal_offloaded`` presets offload
fixed sets. After :func:`install`, every one of those offloads goes to our store instead
(``location``: ``"nvme"`` or ``"host"``, the engine's pinned host tier), ``device`` tags stay on
the device and the rest is recomputed, exactly as MaxText would otherwise decide:

    import jax_ssdtrain.maxtext
    jax_ssdtrain.maxtext.install(location="nvme")
    # ... MaxText as usual, e.g. maxtext.trainers.pre_train.train.main(argv)

or ``python -m jax_ssdtrain.maxtext [--ssd-location nvme|host] [--ssd-min-bytes N]
[--ssd-dir DIR] <MaxText's train arguments>``.

What is patched (checked when installing; a MaxText release that changed them fails here,
naming them): ``NNXDecoder.get_remat_policy`` (the decoder's policy: ours where MaxText would
offload), and ``maxtext_utils.get_save_and_offload_names`` as the layers that build their own
policy see it (Gemma4's and Qwen3-Next's global layers keep would-be-offloaded tags on the
device because pinned-host residuals cannot cross their one-trip scan; our handles can, so
they use the decoder's policy instead). The pipeline wraps the policy with
``save_from_both_policies``, which composes with ours (device saving wins).

``install(optimizer="host" | "nvme" | "host,nvme" | "device")`` (the launcher's
``--ssd-optimizer``) also puts the optimizer state in our store: ``optimizers.get_optimizer``'s
result is wrapped in :func:`jax_ssdtrain.offload_optimizer`, whose ``init`` (run by MaxText under
``jit``, the parameters tracers) shards the state by the shardings MaxText gives the parameters
(``sharding.nnx_construct_named_sharding`` on the ``nnx.Param`` variables). MaxText's settings
that act on the optimizer state's leaves themselves are refused when it builds the optimizer
(``_REFUSED``: its pinned-host moves, its emergency and multi-tier checkpoint managers, which
would save our handles, a full-state load, Zero-1 resharding); see docs/maxtext.md.

MaxText's own Orbax checkpoints save and restore ``tx``'s real state: the manager that
``checkpointing.create_orbax_checkpoint_manager`` makes is wrapped (:func:`_wrap_manager`) so
that a step's ``items`` hold a placeholder where the state's handles were and the step has a
checkpointable ``ssd_optimizer_state`` more, written and read by jax_ssdtrain.checkpointing.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
from typing import Any

import jax
import numpy as np

from jax_ssdtrain._src.config import configure
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.optimizer import OffloadedState, offload_optimizer
from jax_ssdtrain._src.policies import DEFAULT_MIN_BYTES, offload_policy

__all__ = ["DEFAULT_MIN_BYTES", "install", "uninstall", "installed", "MaxTextMissing"]

# (module, attribute path, the parameters we rely on)
_PATCHED = (
  ("maxtext.layers.nnx_decoders", "NNXDecoder.get_remat_policy", ("self",)),
  ("maxtext.utils.maxtext_utils", "get_save_and_offload_names", ("config",)),
)
# install(optimizer=...): MaxText's optimizer factory (train_utils.create_training_optimizer
# calls it by this name), and what the state's shardings are computed with.
_OPTIMIZER_PATCHED = (
  (
    "maxtext.optimizers.optimizers",
    "get_optimizer",
    ("config", "learning_rate_schedule", "model", "mesh"),
  ),
  ("maxtext.utils.sharding", "nnx_construct_named_sharding", ("abs_var_state", "mesh")),
  # MaxText's Orbax manager (train_utils.create_checkpoint_manager calls it by this name): its
  # saves and loads are wrapped so that the optimizer state goes through
  # jax_ssdtrain.checkpointing (see _wrap_manager).
  (
    "maxtext.common.checkpointing",
    "create_orbax_checkpoint_manager",
    (
      "checkpoint_dir",
      "enable_checkpointing",
      "use_async",
      "save_interval_steps",
      "dataset_type",
      "orbax_logger",
      "use_ocdbt",
      "use_zarr3",
      "enable_continuous_checkpointing",
      "max_num_checkpoints_to_keep",
      "checkpoint_storage_concurrent_gb",
      "enable_autocheckpoint",
      "todelete_subdir",
      "todelete_full_path",
      "ocdbt_target_data_file_size_bytes",
    ),
  ),
)
# Where install() keeps each patched function's original.
_ORIGINALS = {
  "get_remat_policy": "get_policy",
  "get_save_and_offload_names": "get_names",
  "get_optimizer": "get_optimizer",
  "nnx_construct_named_sharding": "",
  "create_orbax_checkpoint_manager": "create_manager",
}
# The checkpointable (a directory of each step) that holds tx's state, written by
# jax_ssdtrain.checkpointing's OptimizerStateHandler; MaxText's own item ``items`` holds a
# placeholder where the OffloadedState's leaves (store handles) would be.
CHECKPOINTABLE = "ssd_optimizer_state"
# Settings of MaxText's that act on the optimizer state itself and cannot act on ours: (name,
# why, what to do). Refused by install(optimizer=...) when MaxText builds the optimizer.
_REFUSED = (
  (
    "optimizer_memory_host_offload",
    "MaxText would move the state's store handles to pinned_host memory and back "
    "(maxtext_utils.get_abstract_state_nnx, train.train_step), not its moments; the state is "
    "in our store already",
    "set optimizer_memory_host_offload=false",
  ),
  (
    "enable_emergency_checkpoint",
    "MaxText's emergency checkpoint manager saves the NNX state as it is "
    "(emergency_checkpointing.save), the state's store handles, not its moments; only its "
    "standard Orbax checkpoints (enable_checkpointing) save the state from our store",
    "set enable_emergency_checkpoint=false (enable_checkpointing=true saves the state)",
  ),
  (
    "enable_multi_tier_checkpointing",
    "MaxText's replicator checkpoint manager saves the NNX state as it is "
    "(emergency_checkpointing.save), the state's store handles, not its moments",
    "set enable_multi_tier_checkpointing=false (enable_checkpointing=true saves the state)",
  ),
  (
    "load_full_state_path",
    "a full state checkpoint holds MaxText's own optimizer state, whose leaves are not our "
    "state's handles",
    "load the parameters only (load_parameters_path=...)",
  ),
  (
    "shard_optimizer_over_data",
    "MaxText would reshard every optimizer leaf over the data axis, our handle arrays included",
    "set shard_optimizer_over_data=false (the state streamed from the store is sharded like "
    "the parameters)",
  ),
)


class MaxTextMissing(ImportError):
  """MaxText is not installed (``pip install "jax_ssdtrain[maxtext]"``)."""


_state: dict[str, Any] = {}
# The tree structure of the last OffloadedState that the wrapped optimizer's init made.
_treedefs: list[Any] = []


def install(
  location: str | Location = Location.NVME,
  *,
  min_bytes: int = DEFAULT_MIN_BYTES,
  store: dict[str, Any] | None = None,
  optimizer: str | Location | None = None,
  optimizer_options: dict[str, Any] | None = None,
) -> None:
  """Routes MaxText's offloaded tags to our store (see the module doc). Idempotent; a second
  call with other arguments replaces the first. ``store``: options for
  :func:`jax_ssdtrain.configure` (e.g. ``{"directory": "/nvme/ssd", "host_tier_bytes":
  "64GiB"}``), applied now.

  ``optimizer``: ``"host"``, ``"nvme"``, ``"host,nvme"`` or ``"device"`` puts MaxText's optimizer
  state in our store: the optimizer MaxText builds (``optimizers.get_optimizer``) is wrapped in
  :func:`jax_ssdtrain.offload_optimizer` with that location (``"device"``: the same streamed
  program with the state on the device, the reference its results equal bit for bit), its state
  sharded like the parameters on a mesh of several devices. ``optimizer_options``: more
  arguments of ``offload_optimizer`` (``min_bytes``, ``chunk_bytes``, ``in_place``). MaxText's
  settings that act on the optimizer state itself (``optimizer_memory_host_offload``,
  ``enable_emergency_checkpoint``, ``enable_multi_tier_checkpointing``, ``load_full_state_path``,
  ``shard_optimizer_over_data``) are refused when MaxText builds the optimizer, naming why; its
  Orbax checkpoints (``enable_checkpointing``) hold ``tx``'s state, saved from and restored into
  our store. None (the default): MaxText's optimizer as it is."""
  loc = Location.parse(location, what="location")
  if loc not in (Location.NVME, Location.HOST):
    raise ValueError(f"location: MaxText's offloaded tags go to 'nvme' or 'host', got {location!r}")
  offload_policy([], min_bytes=min_bytes)  # validates min_bytes
  opt_loc = None
  if optimizer is not None:
    opt_loc = Location.parse(optimizer, what="optimizer")
    if not opt_loc.in_store and opt_loc is not Location.DEVICE:
      raise ValueError(
        f"optimizer: expected 'host', 'nvme', 'host,nvme' or 'device', got {optimizer!r}"
      )
    _offload_optimizer_for(opt_loc, dict(optimizer_options or {}))  # validates the options
  elif optimizer_options:
    raise ValueError("optimizer_options: given without optimizer=")
  targets = _targets()
  opt_targets = _targets(_OPTIMIZER_PATCHED) if opt_loc is not None else {}
  if store:
    configure(**store)
  uninstall()
  decoder_cls, get_policy = targets["NNXDecoder.get_remat_policy"]
  utils, get_names = targets["get_save_and_offload_names"]

  @functools.wraps(get_policy)
  def get_remat_policy(self):
    save, offload = get_names(self.config)
    if not offload:
      return get_policy(self)
    return offload_policy(offload, names_to_save=save, min_bytes=min_bytes, location=loc)

  @functools.wraps(get_names)
  def get_save_and_offload_names(config):
    # Layers that build their own policy from this split use the decoder's policy (ours).
    return [], []

  get_remat_policy._ssdtrain = get_save_and_offload_names._ssdtrain = True
  decoder_cls.get_remat_policy = get_remat_policy
  utils.get_save_and_offload_names = get_save_and_offload_names
  _state.update(
    decoder_cls=decoder_cls,
    get_policy=get_policy,
    utils=utils,
    get_names=get_names,
    location=loc,
    min_bytes=min_bytes,
    optimizer=opt_loc,
  )
  if opt_loc is not None:
    optimizers, get_optimizer = opt_targets["get_optimizer"]
    sharding_module, construct = opt_targets["nnx_construct_named_sharding"]
    wrapped = _get_optimizer(get_optimizer, construct, opt_loc, dict(optimizer_options or {}))
    optimizers.get_optimizer = wrapped
    checkpointing, create_manager = opt_targets["create_orbax_checkpoint_manager"]
    checkpointing.create_orbax_checkpoint_manager = _create_manager(create_manager)
    _state.update(
      optimizers=optimizers,
      get_optimizer=get_optimizer,
      checkpointing=checkpointing,
      create_manager=create_manager,
    )


def uninstall() -> None:
  """Restores MaxText's own functions."""
  if not _state:
    return
  _state["decoder_cls"].get_remat_policy = _state["get_policy"]
  _state["utils"].get_save_and_offload_names = _state["get_names"]
  if "optimizers" in _state:
    _state["optimizers"].get_optimizer = _state["get_optimizer"]
    _state["checkpointing"].create_orbax_checkpoint_manager = _state["create_manager"]
  _state.clear()


def installed() -> dict[str, Any] | None:
  """``{"location", "min_bytes", "optimizer"}`` while installed (``optimizer``: where the
  optimizer state goes, or None for MaxText's own), else None."""
  return {k: _state[k] for k in ("location", "min_bytes", "optimizer")} if _state else None


def _offload_optimizer_for(loc: Location, options: dict[str, Any]):
  """``tx -> offload_optimizer(tx, location=loc, **options, param_shardings=...)``; checks the
  options now (on a stateless transformation)."""
  import optax  # an optional dependency (the demo extra; MaxText's own)

  unknown = sorted(set(options) - {"min_bytes", "chunk_bytes", "in_place"})
  if unknown:
    raise ValueError(
      f"optimizer_options: unknown {unknown} (min_bytes, chunk_bytes and in_place are taken)"
    )
  offload_optimizer(optax.identity(), location=loc.value, **options)
  return functools.partial(offload_optimizer, location=loc.value, **options)


def _get_optimizer(get_optimizer, construct, loc: Location, options: dict[str, Any]):
  """MaxText's ``optimizers.get_optimizer`` with its result wrapped in ``offload_optimizer``."""
  import optax  # an optional dependency (the demo extra; MaxText's own)

  wrap = _offload_optimizer_for(loc, options)

  @functools.wraps(get_optimizer)
  def wrapped(config, learning_rate_schedule, model=None, mesh=None):
    refused = [
      f"{name}={getattr(config, name)!r}: {why}; {fix}"
      for name, why, fix in _REFUSED
      if getattr(config, name, None)
    ]
    if refused:
      raise ValueError(
        f"jax_ssdtrain.maxtext: the optimizer state is in our store (optimizer={loc.value!r}, "
        "--ssd-optimizer), which these MaxText settings cannot take: " + " | ".join(refused)
      )
    tx = get_optimizer(config, learning_rate_schedule, model, mesh)
    offloaded = wrap(tx, param_shardings=_param_shardings(config, mesh, construct))

    def init(params):
      state = offloaded.init(params)
      # The OffloadedState's structure (its layout): MaxText's nnx.State and its checkpoints
      # keep only the leaves, which the checkpoint hooks put back into it (_wrap_manager).
      _treedefs[:] = [jax.tree.structure(state)]
      return state

    return optax.GradientTransformationExtraArgs(init, offloaded.update)

  wrapped._ssdtrain = True
  return wrapped


def _create_manager(create_manager):
  """MaxText's ``checkpointing.create_orbax_checkpoint_manager`` with the manager it makes
  saving and loading the optimizer state through jax_ssdtrain.checkpointing."""

  @functools.wraps(create_manager)
  def wrapped(*args, **kwargs):
    manager = create_manager(*args, **kwargs)
    return None if manager is None else _wrap_manager(manager)

  wrapped._ssdtrain = True
  return wrapped


def _wrap_manager(manager):
  """``manager`` (MaxText's ``ocp.training.Checkpointer``) with its ``save_checkpointables_async``
  (which ``save_checkpointables`` calls too) and ``load_checkpointables`` wrapped, on the
  instance:

  * save: MaxText's item ``items`` (``checkpointing.save_checkpoint``, common/checkpointing.py:
    1286, the NNX state in the Linen layout) gets a placeholder for ``opt_state`` (the
    OffloadedState's leaves: the device leaves and the store handles, which
    ``train_state_nnx.to_checkpoint_dict`` keeps without the structure), and the step gets one
    checkpointable more, ``ssd_optimizer_state``: tx's own state streamed from the store by
    jax_ssdtrain.checkpointing's OptimizerStateHandler. Orbax writes the step's items into a
    temporary directory and makes it current once all are complete. The save waits for that
    checkpointable (async_checkpointing included): the next step consumes the entries it reads.
  * load (``checkpointing.load_state_if_possible``, common/checkpointing.py:641): the same
    placeholder in the restore target, the state streamed from the checkpoint into the store
    (``stream_in``, into the layout of the state MaxText's abstract init made), and its leaves
    put where ``items`` had ``opt_state``, placed as the target's; MaxText then overlays them on
    its freshly initialised state (maxtext_utils.setup_initial_state, utils/maxtext_utils.py:
    1812) as any restored leaf."""
  missing = [
    name
    for name in ("save_checkpointables_async", "load_checkpointables", "directory")
    if not hasattr(manager, name)
  ]
  if missing:
    raise RuntimeError(
      "jax_ssdtrain.maxtext: MaxText's checkpoint manager "
      f"({type(manager).__module__}.{type(manager).__qualname__}) lacks {missing}: this MaxText "
      "changed what saves the optimizer state from our store"
    )
  save_async, load = manager.save_checkpointables_async, manager.load_checkpointables

  def save_checkpointables_async(step, checkpointables, *args, **kwargs):
    checkpointables = dict(checkpointables)
    items, state = _split_items(checkpointables["items"])
    checkpointables.update(items=items, **{CHECKPOINTABLE: _StateCheckpointable(state)})
    response = save_async(step, checkpointables, *args, **kwargs)
    if response is not None:
      response.result()  # tx's state is written before the next step consumes its entries
    return response

  def load_checkpointables(step=None, abstract_checkpointables=None):
    if abstract_checkpointables is None or "items" not in abstract_checkpointables:
      return load(step, abstract_checkpointables)
    abstract = dict(abstract_checkpointables)
    target, like = _split_items(abstract["items"])
    where = manager.directory / str(getattr(step, "step", step)) / CHECKPOINTABLE
    if not where.exists():
      raise FileNotFoundError(
        f"jax_ssdtrain.maxtext: {where} is missing: step {step} of {manager.directory} was not "
        "saved with the optimizer state in our store (--ssd-optimizer); its optimizer state, "
        "if any, is MaxText's own. Resume it without --ssd-optimizer, or load its parameters "
        "only (load_parameters_path)"
      )
    loaded = _StateCheckpointable(like)
    abstract.update(items=target, **{CHECKPOINTABLE: loaded})
    restored = dict(load(step, abstract))
    restored.pop(CHECKPOINTABLE, None)
    items = dict(restored["items"])
    items["opt_state"] = _leaves_like(abstract_checkpointables["items"]["opt_state"], loaded.state)
    restored["items"] = items
    return restored

  manager.save_checkpointables_async = save_checkpointables_async
  manager.load_checkpointables = load_checkpointables
  return manager


def _split_items(items):
  """``(items with a placeholder for opt_state, the OffloadedState rebuilt from its leaves)``:
  ``items`` is MaxText's checkpoint dict (``train_state_nnx.to_checkpoint_dict``: the optimizer
  state under ``opt_state``, our OffloadedState's leaves without its structure, device leaves
  then handles); the structure is the one the wrapped optimizer's init made."""
  if not isinstance(items, dict) or "opt_state" not in items:
    raise RuntimeError(
      "jax_ssdtrain.maxtext: MaxText's checkpoint item has no opt_state (got "
      f"{type(items).__name__}{sorted(items) if isinstance(items, dict) else ''}): this MaxText "
      "changed how it saves the optimizer state"
    )
  if not _treedefs:
    raise RuntimeError(
      "jax_ssdtrain.maxtext: MaxText saves or loads a checkpoint, but the optimizer in our "
      "store has made no state (its init did not run)"
    )
  (treedef,) = _treedefs
  leaves = jax.tree.leaves(items["opt_state"])
  if len(leaves) != treedef.num_leaves:
    raise RuntimeError(
      f"jax_ssdtrain.maxtext: MaxText's opt_state has {len(leaves)} leaves, the OffloadedState "
      f"that the optimizer in our store made {treedef.num_leaves}: this MaxText changed how it "
      "keeps the optimizer state"
    )
  state = treedef.unflatten(leaves)
  assert isinstance(state, OffloadedState), type(state)
  return {**items, "opt_state": np.zeros((), np.int8)}, state


def _leaves_like(abstract, state):
  """``state``'s leaves in the structure of ``abstract`` (MaxText's opt_state), each placed as
  its ``abstract`` leaf is (MaxText's shardings of the train state)."""
  out = []
  for x, like in zip(jax.tree.leaves(state), jax.tree.leaves(abstract), strict=True):
    sharding = getattr(like, "sharding", None)
    out.append(jax.device_put(x, sharding) if sharding is not None else x)
  return jax.tree.unflatten(jax.tree.structure(abstract), out)


class _StateCheckpointable:
  """An Orbax v1 ``StatefulCheckpointable`` (as MaxText's grain iterator is one): ``save`` writes
  ``state`` with jax_ssdtrain.checkpointing's OptimizerStateHandler, ``load`` restores into
  ``state``'s layout (then ``state`` is the restored OffloadedState)."""

  def __init__(self, state):
    self.state = state

  async def save(self, directory):
    import jax_ssdtrain.checkpointing as checkpointing  # needs orbax (optional), as MaxText does

    async def write():
      path = await directory.await_creation()
      args = checkpointing.OptimizerStateSave([self.state])
      await asyncio.to_thread(checkpointing.OptimizerStateHandler().save, path, args)

    return write()

  async def load(self, directory):
    import jax_ssdtrain.checkpointing as checkpointing  # needs orbax (optional), as MaxText does

    async def read():
      args = checkpointing.OptimizerStateRestore([self.state])
      (self.state,) = await asyncio.to_thread(
        checkpointing.OptimizerStateHandler().restore, directory, args
      )

    return read()


def _param_shardings(config, mesh, construct):
  """``param_shardings`` for ``offload_optimizer``: MaxText's init runs under ``jit``
  (``maxtext_utils.setup_initial_state``), where the parameters are tracers without shardings,
  so the shardings MaxText gives them (its logical axis rules applied to the ``nnx.Param``
  metadata, ``sharding.nnx_construct_named_sharding``) are computed from the variables that
  ``nnx.Optimizer`` hands ``init``."""
  # MaxText's own dependency, imported where MaxText calls in
  from flax import nnx
  from flax.core.spmd import logical_axis_rules

  def shardings(params):
    if mesh is None or mesh.size <= 1:
      return None
    if not isinstance(params, nnx.State):
      return None  # not nnx.Optimizer's variables: the parameters' own shardings
    with logical_axis_rules(config.logical_axis_rules):
      return nnx.as_pure(construct(params, mesh))

  return shardings


def _targets(patched=_PATCHED) -> dict[str, tuple[Any, Any]]:
  """{attribute path: (owner, original function)}, checked against what we rely on."""
  try:
    importlib.import_module("maxtext")
  except ImportError as e:
    raise MaxTextMissing(
      f"jax_ssdtrain.maxtext needs MaxText (pip install "
      f"'jax_ssdtrain[maxtext]', Python >= 3.12): {e}"
    ) from None
  out, problems = {}, []
  for module_name, path, params in patched:
    try:
      owner = importlib.import_module(module_name)
      *parents, name = path.split(".")
      for p in parents:
        owner = getattr(owner, p)
      fn = getattr(owner, name)
      if getattr(fn, "_ssdtrain", False):
        fn = _state.get(_ORIGINALS[name], fn)
      got = tuple(inspect.signature(fn).parameters)
      if got != params:
        problems.append(
          f"{module_name}.{path}{inspect.signature(fn)} (expected ({', '.join(params)}))"
        )
        continue
      out[path] = (owner, fn)
    except (ImportError, AttributeError) as e:
      problems.append(f"{module_name}.{path} ({e})")
  if problems:
    import maxtext  # the optional, heavy MaxText: only for its version in this message

    version = getattr(maxtext, "__version__", "?")
    raise RuntimeError(
      f"jax_ssdtrain.maxtext: this MaxText ({version}) changed what the SSD "
      f"offload patches: {'; '.join(problems)}"
    )
  return out
