"""Argument checks shared by the measurement modules (disk, wear) and the probe's CLI."""

from __future__ import annotations

import math


def positive(name: str, value, zero: bool = False) -> None:
  """ValueError unless ``value`` is a finite number > 0 (>= 0 with ``zero``), not a bool."""
  ok = (
    not isinstance(value, bool)
    and isinstance(value, (int, float))
    and math.isfinite(value)
    and (value >= 0 if zero else value > 0)
  )
  if not ok:
    raise ValueError(
      f"{name}: expected a {'non-negative' if zero else 'positive'} number, got {value!r}"
    )
