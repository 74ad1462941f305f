"""The store's room: what a location gives (:func:`store_room`) and what an entry takes in it
(:func:`entry_bytes`, each entry rounded up to the engine's alignment, :data:`ENTRY_ALIGN`).

One arithmetic for every room check: a streamed stack's (``layer_stream/room.py``) and an
offloaded optimizer state's (``optimizer/layout.py``).
"""

from __future__ import annotations

from jax_ssdtrain._src.config import ensure_configured, store_directories
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.options import free_bytes_total

ENTRY_ALIGN = 4096  # the engine rounds each entry up to this (xla_ffi/src/config.h: kAlign)


def entry_bytes(nbytes: int) -> int:
  """Bytes an entry of ``nbytes`` takes in the store (rounded up to :data:`ENTRY_ALIGN`)."""
  return -(-int(nbytes) // ENTRY_ALIGN) * ENTRY_ALIGN


def store_room(location: Location) -> tuple[int, list[str]]:
  """The room ``location`` gives: ``host_tier_bytes`` (``"host"``), ``capacity_bytes``
  (``"nvme"``; unset: 90% of the store directories' free space, as the store takes it when it
  opens) or both (``"host,nvme"``); with the parts named for messages."""
  cfg = ensure_configured()
  parts, room = [], 0
  if location in (Location.HOST, Location.HOST_NVME):
    parts.append(f"host_tier_bytes {cfg.host_tier_bytes}")
    room += cfg.host_tier_bytes
  if location in (Location.NVME, Location.HOST_NVME):
    files = cfg.capacity_bytes
    if files is None:
      files = int(0.9 * free_bytes_total(store_directories()))
      parts.append(f"capacity_bytes {files} (90% of the store directories' free space)")
    else:
      parts.append(f"capacity_bytes {files}")
    room += files
  return room, parts
