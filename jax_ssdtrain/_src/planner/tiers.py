"""Which tier of the store each class of training state goes to: the one rule behind every
``"auto"`` (:func:`choose_tiers`), and the share of the host tier it leaves to the activations
(:data:`LEFT_FOR_ACTIVATIONS`).

Its callers: ``offload_optimizer(tx, location="auto")``'s ``init`` (one class, the optimizer
state), and :func:`~jax_ssdtrain.choose_placement` for the classes a device budget leaves to the
store (a dense model's optimizer state; a streamed stack's parameters, gradient sum, optimizer
state and saved layer inputs). Each caller weighs a placement with its own arithmetic of what
the store holds; the rule decides which placements to weigh, in which order, and against which
room.
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Callable, Sequence
from typing import Any

from jax_ssdtrain._src.config import ensure_configured
from jax_ssdtrain._src.location import Location

# The share of the host tier that "auto" leaves to the activations a step saves there (the
# offload policies' tags at "host"): a class placed wholly in the host tier must fit beside the
# other classes there in the rest, three quarters.
LEFT_FOR_ACTIVATIONS = fractions.Fraction(1, 4)


def host_tier_share(host_tier_bytes: int | None = None) -> int:
  """The bytes of the host tier (``host_tier_bytes``; default: the store's) that the classes
  ``"auto"`` places wholly in it may take: all but :data:`LEFT_FOR_ACTIVATIONS`."""
  if host_tier_bytes is None:
    host_tier_bytes = ensure_configured().host_tier_bytes
  return math.floor(host_tier_bytes * (1 - LEFT_FOR_ACTIVATIONS))


# weigh(placement) -> (host_bytes, fits_store, detail): the most the classes at "host" hold in
# the host tier, whether the store holds the placement (its own room check: the whole host tier
# and the files) and what the caller keeps of the weighing (its arithmetic).
Weigh = Callable[[dict[str, Location]], tuple[int, bool, Any]]


def choose_tiers(
  classes: Sequence[str], weigh: Weigh, host_tier_bytes: int | None = None
) -> tuple[dict[str, Location], Any] | None:
  """The tiers of ``classes`` (the classes left to the store, hottest first: the most link
  traffic per byte first), by the one rule of every ``"auto"``: the first of these placements
  that fits, fastest first,

  1. every class in the host tier;
  2. each class, hottest first, in the host tier where it still fits beside the hotter ones
     placed there, the others in the files (where one class at least goes to the host tier);
  3. every class in the host tier spilling to the files (``"host,nvme"``);
  4. every class in the files;

  where a placement with classes at ``"host"`` fits when the store holds it and those classes
  take at most :func:`host_tier_share` of the host tier (the rest, :data:`LEFT_FOR_ACTIVATIONS`,
  is left to the activations a step saves there); a spilling class goes to the files where the
  host tier is full, so 3 and 4 fit when the store holds them (the whole host tier and the
  files). Without a host tier (``host_tier_bytes`` 0) only 4 is weighed. The files alone come
  last: the link carries the host tier's bytes an order of magnitude faster than a disk
  (docs/optimizer.md, "Choosing the location"), so with one class they are chosen only where
  there is no host tier.

  Args:
    classes: the class names, hottest first.
    weigh: ``weigh(placement) -> (host_bytes, fits_store, detail)`` for a placement
      (``{class: Location}``): the most the classes at ``"host"`` hold in the host tier at
      once, whether the store holds the placement (the caller's room check), and what the
      caller keeps of it (returned with the placement chosen).
    host_tier_bytes: the host tier's size (default: the store's).

  Returns:
    ``(placement, detail)`` of the first placement that fits, or None where none does.
  """
  if host_tier_bytes is None:
    host_tier_bytes = ensure_configured().host_tier_bytes
  share = host_tier_share(host_tier_bytes)
  weighed: dict[tuple, tuple[int, bool, Any]] = {}

  def fits(placement: dict[str, Location]) -> bool:
    key = tuple(placement.items())
    if key not in weighed:
      weighed[key] = weigh(placement)
    host_bytes, fits_store, _ = weighed[key]
    in_host = Location.HOST in placement.values()
    return fits_store and (not in_host or host_bytes <= share)

  def chosen(placement: dict[str, Location]) -> tuple[dict[str, Location], Any]:
    return placement, weighed[tuple(placement.items())][2]

  if host_tier_bytes > 0:
    every = dict.fromkeys(classes, Location.HOST)
    if fits(every):
      return chosen(every)
    placed = dict.fromkeys(classes, Location.NVME)
    for c in classes:
      if fits(placed | {c: Location.HOST}):
        placed[c] = Location.HOST
    if Location.HOST in placed.values():
      return chosen(placed)
    spill = dict.fromkeys(classes, Location.HOST_NVME)
    if fits(spill):
      return chosen(spill)
  files = dict.fromkeys(classes, Location.NVME)
  return chosen(files) if fits(files) else None
