"""SSD wear of a plan: bytes written per step x steps per day in TB per day, against the
drive's rated endurance (TB written, or drive writes per day x capacity, over its warranty)."""

from __future__ import annotations

import dataclasses
import math

from jax_ssdtrain._src.measure.checks import positive


@dataclasses.dataclass(frozen=True)
class Wear:
  bytes_per_step: int
  steps_per_day: float
  tb_per_day: float
  rated_tbw: float | None  # TB written over the drive's warranty
  days_to_rated: float | None
  drive_writes_per_day: float | None  # tb_per_day / capacity


def wear(
  bytes_per_step: int,
  *,
  step_ms: float | None = None,
  steps_per_day: float | None = None,
  tbw: float | None = None,
  dwpd: float | None = None,
  capacity_bytes: int | None = None,
  warranty_years: float = 5.0,
) -> Wear:
  """TB written per day and days to the drive's rated endurance.

  Steps per day: ``steps_per_day`` or 86400 s / step. Rated endurance: ``tbw`` (TB) or
  ``dwpd`` x capacity x 365 x ``warranty_years``.
  """
  positive("bytes_per_step", bytes_per_step, zero=True)
  if steps_per_day is None:
    if step_ms is None:
      raise ValueError("wear: give step_ms or steps_per_day")
    positive("step_ms", step_ms)
    steps_per_day = 86400e3 / step_ms
  positive("steps_per_day", steps_per_day)
  for name, v in (("tbw", tbw), ("dwpd", dwpd), ("capacity_bytes", capacity_bytes)):
    if v is not None:
      positive(name, v)
  positive("warranty_years", warranty_years)
  if tbw is not None and dwpd is not None:
    raise ValueError(f"wear: give tbw={tbw!r} or dwpd={dwpd!r}, not both")
  if dwpd is not None and capacity_bytes is None:
    raise ValueError(f"wear: dwpd={dwpd!r} needs capacity_bytes (the drive's size)")
  tb_day = bytes_per_step * steps_per_day / 1e12
  rated = (
    tbw
    if tbw is not None
    else (dwpd * capacity_bytes / 1e12 * 365 * warranty_years if dwpd is not None else None)
  )
  return Wear(
    bytes_per_step=int(bytes_per_step),
    steps_per_day=steps_per_day,
    tb_per_day=tb_day,
    rated_tbw=rated,
    days_to_rated=(
      rated / tb_day
      if rated is not None and tb_day > 0
      else (math.inf if rated is not None else None)
    ),
    drive_writes_per_day=tb_day / (capacity_bytes / 1e12) if capacity_bytes else None,
  )
