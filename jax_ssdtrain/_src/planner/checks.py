"""The planner's argument checks: an integer or a number at least some bound, else a ValueError
naming the argument and the value."""

from __future__ import annotations

import math

import numpy as np


def _check_int(what: str, value, low: int = 0) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{what}: expected an integer >= {low}, got {value!r}")


def _check_number(what: str, value) -> None:
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float, np.floating, np.integer))
    or math.isnan(value)
    or value < 0
  ):
    raise ValueError(f"{what}: expected a number >= 0, got {value!r}")
