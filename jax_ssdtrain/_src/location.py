"""Where a tensor lives: the one ``Location`` type, at the bottom of the package.

Every layer spells locations with this enum (policies, the primitives, the planner, the
optimizer, ``models/``, the MaxText integration); the store's locations map to the engine's tier
codes here, the attribute ``tier`` of the FFI handlers (``enum ssdtrain_tier`` of the engine's
header ``ssdtrain/attributes.h``, whose values ``attributes.py`` reads).
"""

from __future__ import annotations

import enum

from jax_ssdtrain._src import attributes


class Location(enum.Enum):
  """Where a tagged activation (or a stored optimizer leaf) lives between its uses."""

  REMAT = "remat"  # recomputed in the backward pass
  DEVICE = "device"  # saved in device memory (JAX's own saving)
  HOST = "host"  # the engine's pinned host-memory tier
  NVME = "nvme"  # the store files, through the host cache
  HOST_NVME = "host,nvme"  # the host tier while it has room, else the store files (a spill)

  @property
  def in_store(self) -> bool:
    """True for the locations that leave the device through the engine."""
    return self in STORE_LOCATIONS

  @property
  def tier(self) -> int:
    """The engine's tier code of a store location (the handlers' ``tier`` attribute)."""
    if not self.in_store:
      raise ValueError(f"location {self.value!r} is not in the store: it has no engine tier")
    return TIER_CODES[self]

  @classmethod
  def from_tier(cls, code: int) -> Location:
    """The store location of an engine tier code."""
    return TIER_LOCATIONS[code]

  @classmethod
  def parse(cls, value: str | Location, *, what: str = "location") -> Location:
    if isinstance(value, Location):
      return value
    try:
      return cls(",".join(part.strip() for part in str(value).lower().split(",")))
    except ValueError:
      choices = ", ".join(repr(m.value) for m in cls)
      raise ValueError(f"{what}: unknown location {value!r}; expected one of {choices}") from None


STORE_LOCATIONS = frozenset({Location.HOST, Location.NVME, Location.HOST_NVME})

# The engine's tier code of each store location (the header's enum ssdtrain_tier).
TIER_CODES = {
  Location.NVME: attributes.TIER_NVME,
  Location.HOST: attributes.TIER_HOST,
  Location.HOST_NVME: attributes.TIER_HOST_THEN_NVME,
}
TIER_LOCATIONS = {code: loc for loc, code in TIER_CODES.items()}
TIER_NAMES = {code: loc.value for loc, code in TIER_CODES.items()}
