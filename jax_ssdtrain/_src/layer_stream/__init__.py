"""A scanned layer stack whose parameters live in the store and whose gradients leave per layer.

The device holds a window of layers, never the whole stack's parameters or gradients (used by
``scripts/train.py --stream-layers`` and the planner's
:func:`~jax_ssdtrain.choose_placement`). Each class of tensor has its own location: the
parameters where the stack lives, the gradients' running sum (``sum_location``) and the
optimizer state with the master copy (``init_streamed_optimizer``'s ``location``) there too by
default, or each on the device or in another tier.

This package re-exports every name of its files: the rest of the library imports them from
``jax_ssdtrain._src.layer_stream``. One concern per file:

* ``stack.py``: :class:`StreamedStack` (a pytree of per-layer tensors with a leading layer axis
  ``L``, kept in the store as one entry per layer per leaf: the device holds, per leaf, a
  handles array ``uint32[L, 2]``; with ``location="device"`` the stacked leaves themselves, the
  bit-for-bit reference), its layout and role (``kind``), the passes over its layers, and the
  loading and storing of one layer.
* ``build.py``: :func:`init_streamed` (layer by layer straight into the store: a ``lax.scan``
  whose iteration makes and stores one layer; pure, so ``jax.eval_shape`` of it works),
  :func:`stack_from_tree`, :func:`stack_to_tree` and :func:`map_stack` (a function layer by
  layer over stacks, its results stored: the update path of a hand-written optimizer).
* ``spec.py``: what an optax transformation's state of one layer holds (per parameter or shared)
  and the refusal of one that cannot be updated layer by layer.
* ``update.py``: the streamed optimizer: :func:`init_streamed_optimizer`,
  :func:`update_stack` (``tx``'s update layer by layer, read ahead one layer, the
  state's per-parameter leaves and the float32 master copy stored per layer, its shared scalars
  once on the device), :func:`streamed_global_norm` (for global-norm clipping, which ``tx``
  itself cannot do per layer) and :func:`apply_device_update` (the embedding's and head's
  parameters with ``tx``'s ordinary state).
* ``room.py``: the room a streamed stack needs in the store (:func:`check_streamed_room`,
  :func:`room_arithmetic`, :class:`StreamedRoomError`) and the read-ahead that lets its passes
  read whole layers ahead (:func:`read_ahead_sizes`).
"""

from jax_ssdtrain._src.config import ensure_configured, store_directories  # noqa: F401
from jax_ssdtrain._src.layer_stream.build import (  # noqa: F401
  _from_tree_jit,
  _init_jit,
  _map_jit,
  _to_tree_jit,
  init_streamed,
  map_stack,
  stack_from_tree,
  stack_to_tree,
)
from jax_ssdtrain._src.layer_stream.room import (  # noqa: F401
  _ENTRY_ALIGN,
  _STORED,
  STACK_CLASSES,
  StreamedRoomError,
  _class_locations,
  _dtype_name,
  _fits,
  _room_args,
  check_streamed_room,
  read_ahead_sizes,
  room_arithmetic,
  store_room,
)
from jax_ssdtrain._src.layer_stream.spec import (  # noqa: F401
  _PROBE_LAYERS,
  _SPECS,
  _check_tx,
  _make_opt_spec,
  _opt_params,
  _opt_spec,
  _OptSpec,
  _params_key,
  master_weights_of,
)
from jax_ssdtrain._src.layer_stream.stack import (  # noqa: F401
  _PASSES,
  HANDLE_DTYPE,
  StreamedStack,
  StreamPass,
  _after,
  _chain_loads,
  _check_bool,
  _check_num_layers,
  _check_role,
  _check_stack,
  _describe,
  _is_array,
  _Layout,
  _load_layer,
  _make_layout,
  _parse_location,
  _scan_layers,
  _site_of,
  _stacked,
  _store_layer,
  _sum_layout,
  _token,
  _token32,
  new_pass,
)
from jax_ssdtrain._src.layer_stream.update import (  # noqa: F401
  StreamedOptState,
  _check_opt_state,
  _check_scalar,
  _clip,
  _global_norm_jit,
  _mean_grad,
  _opt_init_jit,
  _opt_layout,
  _sum_of_squares,
  _update_jit,
  _zeros,
  apply_device_update,
  apply_streamed_update,
  init_streamed_optimizer,
  streamed_global_norm,
  update_stack,
)
from jax_ssdtrain._src.lifetimes import COUNTED_OR_LATER  # noqa: F401
from jax_ssdtrain._src.location import TIER_CODES, Location  # noqa: F401
from jax_ssdtrain._src.options import free_bytes_total  # noqa: F401
from jax_ssdtrain._src.primitives import load_p, opaque_copy, store_p  # noqa: F401
from jax_ssdtrain._src.remat import new_site_id  # noqa: F401
