"""Store settings from disk measurements (``disk.ProbeResult`` at one or more thread counts):
I/O threads, host cache, read-ahead, host tier and staging sizes, and the bytes per step the
store writes and reads back within a step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax_ssdtrain._src.measure.disk import ProbeResult
from jax_ssdtrain._src.options import GiB, MiB


@dataclasses.dataclass(frozen=True)
class Recommendation:
  """Starting points from measured bandwidth (see :func:`recommend` for the model)."""

  io_threads: int
  write_gbps: float
  read_gbps: float
  fit_bytes_per_step: int | None  # bytes the store writes and reads back within a step
  host_cache_bytes: int
  prefetch_bytes: int
  host_tier_bytes: int  # for the bytes per step beyond fit_bytes_per_step
  staging_bytes: int
  notes: tuple[str, ...] = ()


def recommend(
  results: Sequence[ProbeResult], *, step_ms: float | None = None, bytes_per_step: int | None = None
) -> Recommendation:
  """Settings from probe results at one or more thread counts.

  Threads: the fewest whose slower direction is within 5% of the best. Bytes per step that fit:
  the store must write them and read them back within the step, one direction after the other
  on a shared device: ``step / (1/W + 1/R)``. Host cache: the forward pass (a third of the
  step) produces the bytes faster than the store drains them; the backlog plus the read-ahead
  stay in the cache. Read-ahead: a tenth of a step of reading. Host tier: the bytes per step
  beyond the fit. Staging: two tensors.
  """
  if not results:
    raise ValueError("recommend: no probe results")
  best = max(min(r.write_gbps, r.read_gbps) for r in results)
  pick = min(
    (r for r in results if min(r.write_gbps, r.read_gbps) >= 0.95 * best), key=lambda r: r.threads
  )
  w, r = pick.write_gbps * 1e9, pick.read_gbps * 1e9
  notes = []
  fit = None
  prefetch = 256 * MiB
  cache = 1 * GiB
  tier = 0
  if step_ms is not None:
    step = step_ms / 1e3
    fit = int(step / (1 / w + 1 / r))
    prefetch = max(prefetch, _round_mib(r * step / 10))
    if bytes_per_step is not None:
      backlog = max(0, bytes_per_step - w * step / 3)
      cache = max(cache, _round_mib(backlog + prefetch))
      tier = _round_mib(max(0, bytes_per_step - fit))
      if tier:
        notes.append(
          f"{bytes_per_step / 1e9:.2f} GB per step is more than the store moves in "
          f"{step_ms:g} ms ({fit / 1e9:.2f} GB): put {tier / 1e9:.2f} GB in the host "
          f"tier (or recompute it), or expect stalls"
        )
  if pick.bandwidth_cap:
    notes.append(
      f"bandwidth capped at {pick.bandwidth_cap / 1e9:.2f} GB/s per direction (emulation)"
    )
  if not pick.o_direct:
    notes.append("O_DIRECT is not available here: buffered I/O (page cache) was measured")
  if pick.raw_write_gbps and pick.raw_read_gbps and not pick.bandwidth_cap:
    for io, eng, raw in (
      ("write", pick.write_gbps, pick.raw_write_gbps),
      ("read", pick.read_gbps, pick.raw_read_gbps),
    ):
      if eng < 0.8 * raw:
        notes.append(
          f"engine {io} {eng:.2f} GB/s is below 80% of raw {raw:.2f} GB/s: try more "
          f"io_threads or a larger chunk_bytes"
        )
  return Recommendation(
    io_threads=pick.threads,
    write_gbps=pick.write_gbps,
    read_gbps=pick.read_gbps,
    fit_bytes_per_step=fit,
    host_cache_bytes=cache,
    prefetch_bytes=prefetch,
    host_tier_bytes=tier,
    staging_bytes=max(256 * MiB, 2 * pick.tensor_bytes),
    notes=tuple(notes),
  )


def _round_mib(n: float) -> int:
  return int(math.ceil(n / MiB)) * MiB
