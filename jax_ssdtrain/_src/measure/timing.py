"""Timing of JAX functions: the median of repeated runs after a warmup. Shared by the planner's
``profile`` (each scan it times) and ``scripts.training`` (the step outside the layer stack and
the optimizer update), so that the times they compare are taken the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_time(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
  """Median seconds of ``fn()`` over ``repeats`` runs, each until its outputs are ready, after
  ``warmup + 1`` untimed runs (the first compiles)."""
  for _ in range(warmup + 1):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
