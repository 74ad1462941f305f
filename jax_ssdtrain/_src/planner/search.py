"""The planner's search: ``plan`` enumerates every assignment of ``device | remat | host | nvme``
to the tags and every split ``k``, and returns the one with the least residual device memory
whose predicted step is at most ``1 + max_slowdown`` times the all-on-device step (ties: faster,
then fewer bytes moved); ``frontier`` is the Pareto front of (predicted step, device memory);
``plan_for_budget`` picks the micro-batch and plan with the most tokens/s whose exact device
memory (``memory_fn``, e.g. XLA's ``compiled.memory_analysis()``) fits a budget."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.planner.checks import _check_int, _check_number
from jax_ssdtrain._src.planner.time_model import _evaluate, simulate
from jax_ssdtrain._src.planner.types import OFFLOADED, PLANNED, Plan, Profile
from jax_ssdtrain._src.policies import DEFAULT_MIN_BYTES


def plan(
  profile: Profile,
  *,
  max_slowdown: float = 0.02,
  allowed: Iterable[str | Location] = PLANNED,
  fixed: Mapping[str, str | Location] | None = None,
  min_bytes: int = DEFAULT_MIN_BYTES,
) -> Plan:
  """The plan with the least residual device memory within ``max_slowdown`` of all-on-device.

  allowed: locations the planner may use ("host,nvme" is left out: a spill it does not model);
  fixed: tags whose location is given.
  Tags smaller than ``min_bytes`` are never offloaded (the policy keeps them on the device).
  """
  return min(_feasible(profile, max_slowdown, allowed, fixed, min_bytes), key=_rank)


def frontier(
  profile: Profile,
  *,
  allowed: Iterable[str | Location] = PLANNED,
  fixed: Mapping[str, str | Location] | None = None,
  min_bytes: int = DEFAULT_MIN_BYTES,
) -> list[Plan]:
  """Pareto front of (predicted step, device memory): fastest first, each smaller than the last."""
  plans = sorted(
    _candidates(profile, allowed, fixed, min_bytes),
    key=lambda p: (p.step_s, p.device_bytes, p.offloaded_bytes),
  )
  out = []
  for p in plans:
    if not out or p.device_bytes < out[-1].device_bytes:
      out.append(p)
  return out


def plan_for_budget(
  budget_bytes: int,
  batches: Sequence[int],
  profile_fn: Callable[[int], Profile],
  memory_fn: Callable[[int, Plan], int],
  *,
  max_compiles: int = 3,
  tolerance: float = 0.005,
  **plan_options,
) -> Plan:
  """The batch and plan with the most tokens/s whose device memory fits ``budget_bytes``.

  profile_fn(batch) -> Profile (e.g. ``base.scaled``); memory_fn(batch, plan) -> exact device
  bytes of the whole step (compile only). For each batch, the Pareto-front plans are tried from
  the fastest (of the plans predicted within ``tolerance`` of the fastest, the smallest: the
  model cannot tell them apart); the estimated residual bytes skip the ones that cannot fit,
  and at most ``max_compiles`` candidates per batch are measured. Raises ValueError when
  nothing fits.
  """
  _check_int("budget_bytes", budget_bytes, low=1)
  _check_number("tolerance", tolerance)
  if not batches:
    raise ValueError("batches: expected at least one batch size, got an empty sequence")
  for b in batches:
    _check_int("batches[]", b, low=1)
  best, best_batch, tried = None, 0, []
  for batch in sorted(set(batches), reverse=True):
    front = frontier(profile_fn(batch), **plan_options)
    for _ in range(max_compiles):
      # a smaller batch must beat the best tokens/s found so far
      if not front or (best is not None and batch / front[0].step_s <= best_batch / best.step_s):
        break
      # the front is sorted by step, smallest last: the last plan within the tolerance
      cand = front.pop(
        max(i for i, p in enumerate(front) if p.step_s <= front[0].step_s * (1 + tolerance))
      )
      used = int(memory_fn(batch, cand))
      tried.append((batch, cand.offload_layers, used))
      if used <= budget_bytes:
        best = dataclasses.replace(
          cand, measured_device_bytes=used, profile=dataclasses.replace(cand.profile, batch=batch)
        )
        best_batch = batch
        break
      # only plans whose residual savings can close the gap are worth a compile
      gap = used - budget_bytes
      front = [p for p in front if cand.device_bytes - p.device_bytes >= gap]
  if best is None:
    raise ValueError(
      f"budget_bytes={budget_bytes} ({budget_bytes / 1e9:.2f} GB): no batch in "
      f"{sorted(set(batches))} fits; measured (batch, offload_layers, bytes): {tried}"
    )
  return best


def _candidates(profile: Profile, allowed, fixed, min_bytes) -> Iterable[Plan]:
  _check_int("min_bytes", min_bytes)
  allowed = tuple(dict.fromkeys(Location.parse(a, what="allowed") for a in allowed))
  if not allowed:
    raise ValueError("allowed: expected at least one location, got none")
  fixed = {} if fixed is None else dict(fixed)
  names = [t.name for t in profile.tags]
  for name in fixed:
    if name not in names:
      raise ValueError(f"fixed: unknown tag {name!r}; the profile has {names}")
  fixed = {n: Location.parse(v, what=f"fixed[{n!r}]") for n, v in fixed.items()}
  # "host,nvme" (a spill) is not a tier the planner models: left out of what it may choose
  # (so that allowed=tuple(Location) works), refused where a tag is fixed to it.
  allowed = tuple(loc for loc in allowed if loc is not Location.HOST_NVME)
  if not allowed:
    raise ValueError("allowed: expected at least one of remat, device, host, nvme")
  if Location.HOST_NVME in fixed.values():
    raise ValueError(
      "fixed: the planner places each tag in one tier and does not model 'host,nvme' (a "
      "spill); fix the tag to 'host' or 'nvme' instead"
    )
  choices = []
  for t in profile.tags:
    opts = (fixed[t.name],) if t.name in fixed else allowed
    if t.bytes < min_bytes:  # the policy keeps small tags on the device
      opts = tuple(dict.fromkeys(Location.DEVICE if o in OFFLOADED else o for o in opts))
    choices.append(opts)
  everything_on_device = {n: Location.DEVICE for n in names}
  baseline = simulate(profile, 0, everything_on_device)[0]
  for combo in itertools.product(*choices):
    locations = dict(zip(names, combo))
    offloads = any(loc in OFFLOADED for loc in combo)
    host_per_layer = sum(t.bytes for t, loc in zip(profile.tags, combo) if loc is Location.HOST)
    for k in range(profile.num_layers + 1) if offloads else (0,):
      if k * host_per_layer > profile.host_tier_bytes:  # the engine refuses the store
        break
      yield _evaluate(profile, k, locations, baseline, min_bytes)


def _feasible(profile, max_slowdown, allowed, fixed, min_bytes) -> list[Plan]:
  _check_number("max_slowdown", max_slowdown)
  out = [
    p
    for p in _candidates(profile, allowed, fixed, min_bytes)
    if p.step_s <= p.baseline_s * (1 + max_slowdown) * (1 + 1e-12)
  ]
  if not out:
    raise ValueError(
      f"max_slowdown={max_slowdown}: no plan within it with allowed locations; allow 'device'"
    )
  return out


def _rank(p: Plan):
  return (p.device_bytes, p.step_s, p.offloaded_bytes, p.offload_layers)
