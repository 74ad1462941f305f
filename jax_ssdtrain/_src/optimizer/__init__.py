"""Optimizer state in the store: ``offload_optimizer(tx)`` wraps an optax transformation.

The wrapped transformation's state is a :class:`OffloadedState`: the large leaves of ``tx``'s
state live in the store (host tier, files, or the host tier spilling to the files), cut into
chunks of rows, and the device holds one handle (uint32[2]) per chunk; small leaves (step
counts, scalars) stay on the device.

How ``update`` computes what ``tx`` computes, one pass through the files of this package:

* ``trace.py``: ``tx.update`` traced once, as it is, on the whole trees; its equations are split,
  not rewritten (nested jit calls expanded, each call with its own variables; a ``cond`` decided
  before any stored state is read expanded into both branches and a ``select_n``);
* ``analyse.py`` (pure): the stored leaves each equation reads, the groups they join
  (union-find: Adam's ``mu`` and ``nu`` of one parameter form one group), what is elementwise,
  and the refusal of a group that reads the state of several parameters together;
* ``plan.py``: the *device part* (every equation that reads no stored leaf: a global norm of
  the gradients, a schedule, the step count; it runs first, exactly as ``tx`` would run it) and
  the groups, each chunked (elementwise over one shape) or run whole, and the conditions to
  expand;
* ``stream.py``: the device part, then each group one after the other, loading its leaves and
  storing the new ones chunk by chunk (a ``lax.scan``, pipelined), on one device or in one
  ``shard_map`` over the mesh (sharded state);
* ``chunk_io.py``: the seam the stream loads and stores through, chosen once from the location:
  the store (handles of entries in its tier) or the device reference (``location="device"``:
  copies XLA cannot see through where the store has loads and stores, so the two agree bit for
  bit); each chunk is loaded and stored through ``jax_ssdtrain/_src/stored_io.py``, the seam
  a streamed stack's layers go through too;
* ``layout.py``: which leaves are stored, their chunks of rows, store sites, owners, sharding,
  the room an update needs and where ``location="auto"`` puts it (the planner's one rule);
* ``host_io.py``: the state between the store and host memory piece by piece
  (``state_to_host``, ``state_from_host``, and the seam of :mod:`jax_ssdtrain.checkpointing`:
  ``stream_out``, ``stream_in``, ``check_leaf``, ``device_blocks``, ``spans_processes``);
* ``api.py``: ``offload_optimizer``, ``apply_gradients``, ``optimizer_state``;
  ``state.py``: ``OffloadedState`` (its layout, and the handles the chunk I/O reads);
  ``base.py``: ``OptimizerOffloadError``, which every file here raises.

What a group may be, what is refused, and how exactness is made: each file's doc, and
docs/optimizer.md.
"""

from jax_ssdtrain._src.optimizer.api import (
  apply_gradients,
  floating_dtype,
  offload_optimizer,
  optimizer_state,
)
from jax_ssdtrain._src.optimizer.base import OptimizerOffloadError
from jax_ssdtrain._src.optimizer.host_io import (
  PIECES_AHEAD,
  check_leaf,
  device_blocks,
  spans_processes,
  state_from_host,
  state_to_host,
  stream_in,
  stream_out,
)
from jax_ssdtrain._src.optimizer.layout import (
  DEFAULT_CHUNK_BYTES,
  DEFAULT_MIN_BYTES,
  PIPELINE_DEPTH,
  Layout,
  LeafLayout,
  auto_location,
)
from jax_ssdtrain._src.optimizer.state import OffloadedState

__all__ = [
  "DEFAULT_CHUNK_BYTES",
  "DEFAULT_MIN_BYTES",
  "PIECES_AHEAD",
  "PIPELINE_DEPTH",
  "Layout",
  "LeafLayout",
  "OffloadedState",
  "OptimizerOffloadError",
  "apply_gradients",
  "auto_location",
  "check_leaf",
  "device_blocks",
  "spans_processes",
  "floating_dtype",
  "offload_optimizer",
  "optimizer_state",
  "state_from_host",
  "state_to_host",
  "stream_in",
  "stream_out",
]
