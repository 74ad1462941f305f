"""The size of the device staging arena under ``staging_bytes="auto"``: a pure rule.

A store copies its tensor into the arena on the compute stream and the arena drains to the host
over the link while the next layer computes; what the arena cannot hold goes over the link
directly, on the compute stream, and costs the step its link time. So the arena should hold what
one layer stores (a layer's stores are in flight while the next layer computes), and never
less than the largest tensor stored, within a device budget.

:func:`layers_of` groups a program's stores (in program order) into layers; :func:`arena_bytes`
sizes the arena from them and a budget; :func:`device_budget` is the budget a program leaves on
its device (``device_free.py`` reads the device's numbers). ``config.py`` applies them when a
program that stores first runs; the planner's time model configures its own plans' arenas
(``Plan.store_options()``), at most :data:`FLOOR_BYTES` under ``"auto"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MiB = 1 << 20
GiB = 1 << 30

# The least the rule gives (the fixed default of earlier releases): a program whose layers
# store little keeps room for a few layers, as before.
FLOOR_BYTES = 1 * GiB
# The share of the device memory a program leaves free that the arena may take.
DEVICE_SHARE = 0.5


def layers_of(stores: Iterable[tuple]) -> list[list[int]]:
  """A program's stores ``(name, bytes, ...)`` in program order -> the bytes of each layer's
  stores.

  A layer ends where a name it already stored comes again: the layers of an unrolled stack
  store the same names once each, and the body of a scan over layers (listed once) is one
  layer."""
  layers: list[list[int]] = []
  names: set[str] = set()
  for name, nbytes, *_ in stores:
    if not layers or name in names:
      layers.append([])
      names = set()
    layers[-1].append(int(nbytes))
    names.add(name)
  return layers


def arena_bytes(
  layers: Sequence[Sequence[int]], *, budget: int | None, floor: int = FLOOR_BYTES
) -> int:
  """The arena for a program whose layers store ``layers`` (bytes per store, per layer): the
  bytes of its largest layer (so at least its largest tensor), rounded up to MiB and at least
  ``floor``, at most ``budget`` (None: no cap). With a budget below the largest tensor the arena
  is the budget: the rest of that tensor streams over the link directly."""
  for i, layer in enumerate(layers):
    for nbytes in layer:
      if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"layers[{i}]: expected sizes in bytes (ints >= 0), got {list(layer)!r}")
  if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
    raise ValueError(f"budget: expected a size in bytes or None, got {budget!r}")
  want = max((sum(layer) for layer in layers), default=0)
  want = max(-(-want // MiB) * MiB, floor)
  if budget is not None:
    want = min(want, max(budget, 0) // MiB * MiB)
  return want


def device_budget(free_bytes: int, *, xla_more_bytes: int = 0, share: float = DEVICE_SHARE) -> int:
  """The arena's share of what a program leaves on its device: ``share`` of the device's free
  memory as CUDA sees it (``cudaMemGetInfo``; the arena is allocated outside XLA's pool) less
  what XLA's allocator still takes from CUDA for the program (``xla_more_bytes``: its bytes in
  use, temporaries and outputs beyond the pool it holds; none when JAX preallocated the pool)."""
  return max(0, int((free_bytes - max(0, xla_more_bytes)) * share))
