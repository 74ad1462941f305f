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
(``_REFUSED``: its pinned-host moves, its Orbax checkpoints, which would hold our handles, a
full-state load, Zero-1 resharding); see docs/maxtext.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from jax_ssdtrain._src.config import configure
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.optimizer import offload_optimizer
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
)
# Where install() keeps each patched function's original.
_ORIGINALS = {
  "get_remat_policy": "get_policy",
  "get_save_and_offload_names": "get_names",
  "get_optimizer": "get_optimizer",
  "nnx_construct_named_sharding": "",
}
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
    "enable_checkpointing",
    "MaxText's Orbax checkpoints would hold the state's store handles, not its moments, and a "
    "restore would put stale handles back (checkpointing.maybe_save_checkpoint saves the NNX "
    "state as it is)",
    "set enable_checkpointing=false, or save with jax_ssdtrain.checkpointing in a loop of your "
    "own (docs/maxtext.md)",
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
  ``enable_checkpointing``, ``load_full_state_path``, ``shard_optimizer_over_data``) are refused
  when MaxText builds the optimizer, naming why. None (the default): MaxText's optimizer as it
  is."""
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
    _state.update(optimizers=optimizers, get_optimizer=get_optimizer)


def uninstall() -> None:
  """Restores MaxText's own functions."""
  if not _state:
    return
  _state["decoder_cls"].get_remat_policy = _state["get_policy"]
  _state["utils"].get_save_and_offload_names = _state["get_names"]
  if "optimizers" in _state:
    _state["optimizers"].get_optimizer = _state["get_optimizer"]
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
    return wrap(tx, param_shardings=_param_shardings(config, mesh, construct))

  wrapped._ssdtrain = True
  return wrapped


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
