"""The planner's time model: a plan's predicted step (``simulate``: compute and I/O stalls),
its residual device memory, the staging arena it needs, and the ``Plan`` of one split and
assignment (``_evaluate``).

Timing model (per training step; F, B: one layer's forward and backward time; the first
``k`` layers send their host/nvme tags to the store, the last ``L - k`` keep them on the device,
as SSDTrain does, because their backward comes first and leaves no time to read them back):

- compute: forward ``L*F``, then ``other_s`` (head, loss), then the backward, layer by layer
  from the last, then ``update_s`` (the optimizer); each layer's backward is ``B`` plus the
  time of every tag it recomputes (``recompute_s`` of the tag: the measured cost of recomputing
  the whole layer times the FLOP share of the ops between the previous tag and this one).
- nvme: one disk queue, FIFO, ``write_gbps`` for writes and ``read_gbps`` for reads. The tensors
  of layer ``i`` are ready at the end of its forward and every one is written (the engine
  cancels a write that has not started when the host thread issues its load, but how many that
  is depends on host-side timing and on the host cache's free room, which entries of other
  programs can hold: measured on an H100, such plans wrote from 12% to 100% of their bytes; the
  planner takes no credit). Writes wait in the host cache (``host_cache_bytes``); when the
  unwritten backlog exceeds it, the forward stalls. The cache keeps the last
  ``host_cache_bytes`` stored, so those are not read back. Disk reads run after the writes, last
  layer first; layer ``i``'s reads must finish before its backward starts, else the backward
  stalls. In steady state the disk's writes and reads of one step must also fit in the step,
  else the step waits for them.
- every tag sent to the store also costs ``offload_s`` per layer (its store and load: host-side
  work and launches, measured by ``profile``), half in the forward and half in the backward.
- host: the same with the PCIe link (``host_gbps`` each way, full duplex: device-to-host in the
  forward, host-to-device read-ahead in the backward; ``profile`` measures it on the GPU,
  ``jax_ssdtrain.probe.measure_link``) and the device staging arena (``staging_bytes``) in the
  role of the cache: a store waits while the bytes not yet copied to the host exceed it, and
  the last ``staging_bytes`` stored are loaded from it (no copy either way: the engine defers
  their device-to-host copy until it is needed).
- the staging arena is device memory too: each plan that offloads gets the smallest arena (at
  least two of its largest offloaded tensors, at most the profile's ``staging_bytes``) whose
  predicted step is within ``STAGING_TOLERANCE`` of the profile's arena (``Plan.staging_bytes``;
  ``Plan.store_options()`` configures it, so that the store's arena is this number; a
  ``memory_fn`` of ``plan_for_budget`` adds it to XLA's bytes). Where the store's
  ``staging_bytes`` is ``"auto"``, the profile's arena is its floor (1 GiB): the search does not
  weigh a larger arena's device memory against its speed. A forward pass that produces host-tier bytes faster than the link drains
  them needs the difference in staging: ``bytes - host_gbps x forward time``.
- device memory of the plan's residuals: per layer, the bytes of tags on the device (all
  host/nvme tags in the kept layers) plus the layer input when some tag is recomputed, unless
  the input is itself a tag (``input_tag``) sent to the store: recomputation then starts from
  the loaded copy. A split scan (``0 < k < L``) over one stacked parameter array (the models'
  ``Stack``) also holds the stack's weight gradients twice (each scan's, then their
  concatenation): ``L * param_bytes`` more, unless ``split_grad_copy`` is False (segments with
  parameter arrays of their own).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.planner.types import OFFLOADED, Plan, Profile

STAGING_TOLERANCE = (
  0.002  # a plan's arena: the smallest within this share of the configured one's step
)


def simulate(
  profile: Profile, offload_layers: int, locations: Mapping[str, Location]
) -> tuple[float, float]:
  """``(compute_s, stall_s)`` per step under the timing model of the module docstring."""
  p, L, k = profile, profile.num_layers, offload_layers
  recompute = sum(t.recompute_s for t in p.tags if locations[t.name] is Location.REMAT)
  per_layer = {loc: sum(t.bytes for t in p.tags if locations[t.name] is loc) for loc in OFFLOADED}
  # host-side work of the offloaded layers' stores (forward) and loads (backward)
  calls = p.offload_s / 2 * sum(locations[t.name] in OFFLOADED for t in p.tags) if k else 0.0
  compute = L * (p.forward_s + p.backward_s + recompute) + 2 * k * calls + p.other_s + p.update_s
  if k == 0 or not any(per_layer.values()):
    return compute, 0.0
  nv, hb = per_layer[Location.NVME], per_layer[Location.HOST]
  w, r, h = p.write_gbps * 1e9, p.read_gbps * 1e9, p.host_gbps * 1e9
  if (nv and (w <= 0 or r <= 0)) or (hb and h <= 0):
    return compute, math.inf
  back = p.backward_s + recompute
  stall = t = disk_free = link_down = disk_busy = 0.0
  write_end, host_done = {}, {}
  for i in range(L):
    t += p.forward_s
    if i >= k:
      continue
    t += calls
    if nv:
      # every write starts (no credit for writes the engine cancels: see the module docstring)
      disk_free = write_end[i] = max(t, disk_free) + nv / w
      disk_busy += nv / w
      # unwritten bytes must fit in the host cache, else the store (and the forward) waits
      t = max(t, disk_free - p.host_cache_bytes / w)
    if hb:
      link_down = host_done[i] = max(t, link_down) + hb / h
      # bytes not yet copied to the host must fit in the device staging arena
      t = max(t, link_down - p.staging_bytes / h)
  stall += max(0.0, t - L * p.forward_s - k * calls)
  t += p.other_s
  link_up = t
  for i in reversed(range(L)):
    if i < k:
      ready = t
      # the cache keeps the last host_cache_bytes stored; older tensors come from the disk
      if nv and (k - i) * nv > p.host_cache_bytes:
        disk_free = max(disk_free, write_end[i]) + nv / r
        disk_busy += nv / r
        ready = max(ready, disk_free)
      # the staging arena keeps the last staging_bytes stored; older tensors come over PCIe
      if hb and (k - i) * hb > p.staging_bytes:
        link_up = max(link_up, host_done[i]) + hb / h
        ready = max(ready, link_up)
      stall += ready - t
      t = ready + calls
    t += back
  # steady state: the disk cannot move more per step than its bandwidth allows in one step
  return compute, stall + max(0.0, disk_busy - (compute + stall))


def _device_bytes(profile: Profile, k: int, locations: Mapping[str, Location]) -> int:
  L = profile.num_layers
  total = 0
  for t in profile.tags:
    loc = locations[t.name]
    if loc is Location.DEVICE:
      total += t.bytes * L
    elif loc in OFFLOADED:
      total += t.bytes * (L - k)
  if any(loc is Location.REMAT for loc in locations.values()):
    # recomputation needs the layer input; a tagged input is already counted where it lives
    # (device: every layer; host/nvme: the kept layers), else it is saved on the device
    tagged_input = (
      profile.input_tag is not None and locations[profile.input_tag] is not Location.REMAT
    )
    total += 0 if tagged_input else profile.input_bytes * L
  if 0 < k < L and profile.split_grad_copy:  # two scans' weight gradients, then their concat
    total += profile.param_bytes * L
  return total


def _evaluate(
  profile: Profile, k: int, locations: Mapping[str, Location], baseline: float, min_bytes: int
) -> Plan:
  staging = _staging_needed(profile, k, locations)
  compute, stall = simulate(
    dataclasses.replace(profile, staging_bytes=staging) if staging else profile, k, locations
  )
  moved = {
    loc: sum(t.bytes for t in profile.tags if locations[t.name] is loc) * k for loc in OFFLOADED
  }
  return Plan(
    profile,
    k,
    tuple(sorted(locations.items())),
    compute,
    stall,
    baseline,
    _device_bytes(profile, k, locations),
    moved[Location.NVME],
    moved[Location.HOST],
    min_bytes,
    staging_bytes=staging,
  )


def _staging_needed(profile: Profile, k: int, locations: Mapping[str, Location]) -> int:
  """The smallest staging arena (MiB multiples, at least two of the largest offloaded tensors,
  at most the profile's) whose predicted step is within STAGING_TOLERANCE of the profile's
  arena; 0 when the plan offloads nothing or the profile has no arena."""
  sizes = [t.bytes for t in profile.tags if locations[t.name] in OFFLOADED]
  if not k or not sizes or not profile.staging_bytes:
    return 0
  mib = 1 << 20
  most = profile.staging_bytes
  least = min(most, -(-2 * max(sizes) // mib) * mib)

  def step(arena):
    return sum(simulate(dataclasses.replace(profile, staging_bytes=arena), k, locations))

  target = step(most) * (1 + STAGING_TOLERANCE)
  if step(least) <= target:
    return least
  lo, hi = least, most  # step(lo) > target >= step(hi)
  while hi - lo > mib:
    mid = (lo + hi) // 2 // mib * mib
    if mid <= lo:
      break
    lo, hi = (lo, mid) if step(mid) <= target else (mid, hi)
  return hi
