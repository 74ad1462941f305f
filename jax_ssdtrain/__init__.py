"""jax_ssdtrain: JAX training state to pinned host memory or NVMe files, streamed back in time.

The activations a step saves for its backward pass, the optimizer state and the float32 master
weights of bfloat16 parameters leave the device for the store (a pinned host-memory tier and/or
files in the store directory) and come back to the device in time for their use.

    import jax, jax_ssdtrain as ssd
    from jax.ad_checkpoint import checkpoint_name

    def block(p, x):
        h = checkpoint_name(x @ p["w1"], "mlp_up")   # a plain JAX tag
        ...
    jax.checkpoint(block, policy=ssd.ssd_offload_policy)

Tagged activations leave the program in the forward pass through an XLA FFI custom call, land
in the store (pinned host tier and/or files in the store directory) and come back, prefetched,
in the backward pass.
"""

import os as _os
import warnings as _warnings

import jax as _jax

from jax_ssdtrain._src import jax_internals as _ji


def _check_jax_version() -> None:
  low, high = _ji.TESTED_JAX
  if low <= _ji.jax_version() < high:
    return
  message = (
    f"jax_ssdtrain is tested with {_ji.TESTED_JAX_TEXT}, found jax {_jax.__version__}. "
    "Install a tested release (pip install 'jax_ssdtrain[...]' resolves one), or set "
    "SSDTRAIN_ALLOW_UNTESTED_JAX=1 to try this one anyway."
  )
  if _os.environ.get("SSDTRAIN_ALLOW_UNTESTED_JAX", "").strip() not in ("", "0"):
    _warnings.warn(message, RuntimeWarning, stacklevel=3)
    return
  raise ImportError(message)


_check_jax_version()

from jax_ssdtrain._src import config as _config  # noqa: E402
from jax_ssdtrain._src import lifetimes as _lifetimes  # noqa: E402
from jax_ssdtrain._src import native as _native  # noqa: E402
from jax_ssdtrain._src import options as _options  # noqa: E402
from jax_ssdtrain._src import primitives as _primitives  # noqa: E402
from jax_ssdtrain._src import remat as _remat  # noqa: E402

if _native.available():  # a checkout without a built library fails at first use instead
  _native.check_ffi_api()


def _check_environment() -> None:
  # The SSDTRAIN_* variables are read here, before any program is traced: a bad value raises
  # now, not inside JAX's traceback when the first step opens the store; a variable that is no
  # option warns (docs/options.md, "Environment variables").
  try:
    unknown = _options.check_environment()
  except ValueError as e:
    e.add_note(
      "jax_ssdtrain checks its SSDTRAIN_* environment variables when it is imported: fix or "
      "unset this one (docs/options.md)"
    )
    raise
  for message in unknown:
    _warnings.warn(message, RuntimeWarning, stacklevel=3)


_check_environment()
from jax_ssdtrain._src import deprecations as _deprecations
from jax_ssdtrain._src import layer_stream as _layer_stream
from jax_ssdtrain._src import planner as _planner
from jax_ssdtrain._src.accumulate import accumulate_gradients
from jax_ssdtrain._src.config import (
  StoreConfig,
  StoreShutDownError,
  collect,
  configure,
  configured,
  device_stats,
  flush,
  parse_size,
  release_all,
  reset_stats,
  shutdown,
  stats,
  store_directories,
  timeline,
)
from jax_ssdtrain._src.config import (
  current as current_config,
)
from jax_ssdtrain._src.config import (
  defaults as default_config,
)
from jax_ssdtrain._src.layer_stream import (
  StreamedOptState,
  StreamedRoomError,
  StreamedStack,
  check_streamed_room,
  init_streamed,
  init_streamed_optimizer,
  map_stack,
  read_ahead_sizes,
  stack_from_tree,
  stack_to_tree,
  streamed_global_norm,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.master_weights import MasterWeightsState, with_master_weights
from jax_ssdtrain._src.optimizer import (
  OffloadedState,
  OptimizerOffloadError,
  apply_gradients,
  offload_optimizer,
  optimizer_state,
  state_from_host,
  state_to_host,
)
from jax_ssdtrain._src.planner import (
  Placement,
  Plan,
  Profile,
  TagProfile,
  choose_placement,
  frontier,
  measured_bandwidth,
  plan,
  plan_for_budget,
  plan_long_context,
  profile,
  split_layers,
  split_scan,
)
from jax_ssdtrain._src.policies import (
  OffloadPolicy,
  flash_attention_saveable,
  location_policy,
  offload_policy,
  ssd_offload_policy,
)
from jax_ssdtrain._src.primitives import HigherOrderOffloadError
from jax_ssdtrain._src.stream_scan import (
  grad,
  scan_stack,
  value_and_grad,
  value_and_grad_streamed,
)
from jax_ssdtrain._src.trainer import StreamedTrainer, StreamedTrainState

# Names one other way replaced (jax_ssdtrain/_src/deprecations.py): they answer, with a warning,
# from the package that defines them.
_DEPRECATED_OBJECTS = {
  name: getattr(_layer_stream, name, None) or getattr(_planner, name)
  for name in _deprecations.DEPRECATED
}


def __getattr__(name: str):
  if name in _DEPRECATED_OBJECTS:
    _deprecations.warn(name)
    return _DEPRECATED_OBJECTS[name]
  raise AttributeError(f"module 'jax_ssdtrain' has no attribute {name!r}")


_remat.install()
# lifetimes.py sits below the primitives it counts: it is handed them here.
_lifetimes.install_lowering_hook(
  store_p=_primitives.store_p, load_ps=_primitives.LOAD_PRIMITIVES, copy_p=_primitives.copy_p
)
_config.install_dispatch_hook()  # a program that uses the store opens it when it first runs

__version__ = "0.1.0"

__all__ = [
  "accumulate_gradients",
  "apply_gradients",
  "check_streamed_room",
  "read_ahead_sizes",
  "HigherOrderOffloadError",
  "init_streamed",
  "init_streamed_optimizer",
  "Location",
  "MasterWeightsState",
  "OffloadedState",
  "OffloadPolicy",
  "OptimizerOffloadError",
  "Placement",
  "StoreConfig",
  "StoreShutDownError",
  "collect",
  "configure",
  "configured",
  "choose_placement",
  "current_config",
  "default_config",
  "device_stats",
  "flash_attention_saveable",
  "flush",
  "grad",
  "frontier",
  "location_policy",
  "map_stack",
  "measured_bandwidth",
  "offload_optimizer",
  "offload_policy",
  "optimizer_state",
  "parse_size",
  "Plan",
  "plan",
  "plan_for_budget",
  "plan_long_context",
  "Profile",
  "profile",
  "release_all",
  "scan_stack",
  "reset_stats",
  "shutdown",
  "split_layers",
  "split_scan",
  "ssd_offload_policy",
  "stack_from_tree",
  "stack_to_tree",
  "state_from_host",
  "state_to_host",
  "stats",
  "StreamedOptState",
  "StreamedRoomError",
  "StreamedStack",
  "StreamedTrainer",
  "StreamedTrainState",
  "streamed_global_norm",
  "store_directories",
  "TagProfile",
  "value_and_grad",
  "value_and_grad_streamed",
  "with_master_weights",
  "timeline",
]
