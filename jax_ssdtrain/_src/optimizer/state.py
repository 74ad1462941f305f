"""The optimizer store's state: :class:`OffloadedState`, what ``offload_optimizer`` makes.

It is a pytree whose leaves are what jit, sharding and checkpoints see (the leaves kept on the
device and the stored leaves' handles); its layout (``layout.py``) is static data of the tree.
What a stored leaf's handles hold is the chunk I/O's business (``chunk_io.py``, chosen from the
layout's location): engine handles in the store, the leaf itself with ``location="device"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.optimizer.layout import Layout


@jax.tree_util.register_pytree_node_class
class OffloadedState:
  """The state of ``offload_optimizer(tx)``: ``tx``'s state with its large leaves in the store.

  Leaves (what jit, sharding and checkpoints see): ``device`` (the leaves kept on the device, in
  ``tx``'s leaf order) and ``handles`` (per stored leaf, uint32[chunks, 2]). The layout (``tx``'s
  tree structure, shapes, dtypes, chunking, store sites) is static data of the tree.
  """

  def __init__(self, device: Sequence[Any], handles: Sequence[Any], layout: Layout):
    self.device = tuple(device)
    self.handles = tuple(handles)
    self.layout = layout

  @property
  def location(self) -> str:
    """Where the stored leaves live: ``"host"``, ``"nvme"``, ``"host,nvme"`` or ``"device"``
    (``location="auto"`` says here what it chose)."""
    if not self.layout.stores_anything:
      return Location.DEVICE.value
    return self.layout.location.value

  def tree_flatten(self):
    return (self.device, self.handles), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], children[1], layout)

  def __repr__(self):
    if not self.layout.stores_anything:
      return (
        f"OffloadedState({len(self.layout.leaves)} leaves, none in the store: all on the device)"
      )
    return (
      f"OffloadedState({len(self.layout.leaves)} leaves, {len(self.handles)} in the store "
      f"({self.location}{', updated in place' if self.layout.in_place else ''}), "
      f"{self.layout.stored_bytes} bytes)"
    )


def check_state(state: Any, what: str) -> None:
  """Raises TypeError unless ``state`` is an :class:`OffloadedState` (``what`` names it)."""
  if not isinstance(state, OffloadedState):
    raise TypeError(f"{what}: expected an OffloadedState, got {type(state).__name__}")
