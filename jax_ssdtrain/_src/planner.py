"""Offload planner: where each tagged tensor of a scan over L layers lives, from a profile.

    prof = ssd.profile(layer_fn, layer_params, x, num_layers=L)  # store bandwidth measured
    p = ssd.plan(prof)              # p.offload_layers, p.locations, print(p)
    y = p.scan(layer_fn, stacked_params, x)  # the stack as planned (p.policies() for your own)

Timing model (per training step; F, B: one layer's forward and backward time; the first
``k`` layers send their host/nvme tags to the store, the last ``L - k`` keep them on the device,
as SSDTrain does, because their backward comes first and leaves no time to read them back):

- compute: forward ``L*F``, then ``other_s`` (head, loss), then the backward, layer by layer
  from the last, then ``update_s`` (the optimizer); each layer's backward is ``B`` plus the
  time of every tag it recomputes (``recompute_s`` of the tag: the measured cost of recomputing
  the whole layer times the FLOP share of the ops between the previous tag and this one).
- nvme: one disk queue, FIFO, ``write_gbps`` for writes and ``read_gbps`` for reads. The
  tensors of layer ``i`` are ready at the end of its forward and every one is written (the
  engine cancels a write that has not started when the host thread issues its load, but how
  many that is depends on host-side timing and on the host cache's free room, which entries
  of other programs can hold: on the H100 such plans wrote from 12% to 100% of their bytes;
  the planner takes no credit). Writes wait in the host cache (``host_cache_bytes``); when the unwritten backlog
  exceeds it, the forward stalls. The cache keeps the last ``host_cache_bytes`` stored, so those
  are not read back. Disk reads run after the writes, last layer first; layer ``i``'s reads
  must finish before its backward starts, else the backward stalls. In steady state the disk's
  writes and reads of one step must also fit in the step, else the step waits for them.
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
  ``Plan.store_options()`` configures it). A forward pass that produces host-tier bytes
  faster than the link drains them needs the difference in staging: ``bytes - host_gbps x
  forward time``.
- device memory of the plan's residuals: per layer, the bytes of tags on the device (all
  host/nvme tags in the kept layers) plus the layer input when some tag is recomputed, unless
  the input is itself a tag (``input_tag``) sent to the store: recomputation then starts from
  the loaded copy. A split scan (``0 < k < L``) over one stacked parameter array (the models'
  ``Stack``) also holds the stack's weight gradients twice (each scan's, then their
  concatenation): ``L * param_bytes`` more, unless ``split_grad_copy`` is False (segments with
  parameter arrays of their own).

``plan`` enumerates every assignment of ``device | remat | host | nvme`` to the tags and every
split ``k``, and returns the one with the least residual device memory whose predicted step is
at most ``1 + max_slowdown`` times the all-on-device step (ties: faster, then fewer bytes
moved). ``plan_for_budget`` picks the micro-batch and plan with the most tokens/s whose exact
device memory (``memory_fn``, e.g. XLA's ``compiled.memory_analysis()``) fits a budget.

``split_scan`` is the one split scan (the first ``k`` layers under one policy, the rest under
another): ``Plan.scan``, the models' ``Stack`` and ``scripts/bench_planner.py`` run it.
``choose_optimizer_location`` weighs the optimizer state on the device against the store the
same way: the exact device memory of the step with it there, against a budget.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import config, jax_internals, options
from jax_ssdtrain._src.layer_stream import (
  STACK_CLASSES,
  StreamedRoomError,
  check_streamed_room,
  master_weights_of,
  room_arithmetic,
  store_room,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.measure import link as link_probe
from jax_ssdtrain._src.measure.disk import measured_bandwidth
from jax_ssdtrain._src.measure.timing import median_time
from jax_ssdtrain._src.policies import (
  DEFAULT_MIN_BYTES,
  location_policy,
  name_p,
  nbytes,
  tree_nbytes,
)

DEFAULT_HOST_GBPS = 50.0  # without a GPU to measure: pinned host <-> H100 over PCIe, 41-55 GB/s
# measured (jax_ssdtrain.probe --link)
STAGING_TOLERANCE = (
  0.002  # a plan's arena: the smallest within this share of the configured one's step
)
# The store's defaults (the option table's).
DEFAULT_HOST_CACHE_BYTES = options.default("host_cache_bytes")
DEFAULT_STAGING_BYTES = options.default("staging_bytes")
DEFAULT_HOST_TIER_BYTES = options.default("host_tier_bytes")
OFFLOADED = (Location.HOST, Location.NVME)
# The locations the planner chooses from ("host,nvme" is a spill it does not model).
PLANNED = (Location.REMAT, Location.DEVICE, Location.HOST, Location.NVME)
MIN_DIFFERENCE_S = 0.02  # profile: the long and short scans differ by at least this much


@dataclasses.dataclass(frozen=True)
class TagProfile:
  """One tag name of a layer: bytes per layer (all its occurrences) and recompute time."""

  name: str
  bytes: int
  recompute_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Profile:
  """What the planner needs about one layer of the scan, the stack and the store."""

  num_layers: int
  forward_s: float
  backward_s: float
  tags: tuple[TagProfile, ...]
  write_gbps: float
  read_gbps: float
  host_gbps: float = DEFAULT_HOST_GBPS
  host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES
  staging_bytes: int = DEFAULT_STAGING_BYTES
  host_tier_bytes: int = DEFAULT_HOST_TIER_BYTES  # a step's host tensors must fit in it
  input_bytes: int = 0  # the layer input: saved when the layer recomputes anything
  input_tag: str | None = None  # the tag on the layer input itself, if any
  param_bytes: int = 0  # one layer's parameters
  split_grad_copy: bool = True  # a split scan concatenates its segments' weight gradients
  offload_s: float = 0.0  # per offloaded tag and layer: a store and its load, beyond the bytes
  other_s: float = 0.0  # per step, outside the layers, proportional to the batch (embedding, head)
  update_s: float = 0.0  # per step, after the backward, whatever the batch (optimizer update)
  batch: int | None = None

  def __post_init__(self):
    _check_int("num_layers", self.num_layers, low=1)
    for key in (
      "forward_s",
      "backward_s",
      "write_gbps",
      "read_gbps",
      "host_gbps",
      "offload_s",
      "other_s",
      "update_s",
    ):
      _check_number(key, getattr(self, key))
    _check_int("host_cache_bytes", self.host_cache_bytes)
    _check_int("staging_bytes", self.staging_bytes)
    _check_int("host_tier_bytes", self.host_tier_bytes)
    _check_int("input_bytes", self.input_bytes)
    _check_int("param_bytes", self.param_bytes)
    names = [t.name for t in self.tags]
    if len(set(names)) != len(names):
      raise ValueError(f"tags: duplicate tag names in {names}")
    if self.input_tag is not None and self.input_tag not in names:
      raise ValueError(f"input_tag: {self.input_tag!r} is not one of the tags {names}")
    for t in self.tags:
      _check_int(f"tags[{t.name!r}].bytes", t.bytes)
      _check_number(f"tags[{t.name!r}].recompute_s", t.recompute_s)

  def scaled(self, batch: int) -> Profile:
    """This profile at another batch size: times and bytes proportional to the batch (all but
    ``update_s`` and ``offload_s``)."""
    if self.batch is None:
      raise ValueError("scaled: this profile has no batch size")
    _check_int("batch", batch, low=1)
    f = batch / self.batch
    return dataclasses.replace(
      self,
      forward_s=self.forward_s * f,
      backward_s=self.backward_s * f,
      other_s=self.other_s * f,
      input_bytes=int(self.input_bytes * f),
      batch=batch,
      tags=tuple(
        dataclasses.replace(t, bytes=int(t.bytes * f), recompute_s=t.recompute_s * f)
        for t in self.tags
      ),
    )


@dataclasses.dataclass(frozen=True)
class Plan:
  """An offload plan: the split and each tag's location in the offloaded layers.

  Attributes:
    offload_layers: the first ``offload_layers`` layers send their host/nvme tags to the store;
      the others keep those tags on the device. remat tags are recomputed in every layer.
    locations: sorted ``(tag, Location)`` pairs.
  """

  profile: Profile
  offload_layers: int
  locations: tuple[tuple[str, Location], ...]
  compute_s: float  # predicted step without I/O stalls
  stall_s: float  # predicted I/O stalls per step
  baseline_s: float  # predicted step with every tag on the device
  device_bytes: int  # residual bytes on the device, all layers
  nvme_bytes: int  # per step, to the store files (before forwarding)
  host_bytes: int  # per step, to the host tier
  min_bytes: int = DEFAULT_MIN_BYTES
  measured_device_bytes: int | None = None  # the whole step's, from XLA (plan_for_budget)
  staging_bytes: int = 0  # the device staging arena the plan needs (0: it offloads nothing)

  @property
  def step_s(self) -> float:
    return self.compute_s + self.stall_s

  @property
  def offloaded_bytes(self) -> int:
    return self.nvme_bytes + self.host_bytes

  @property
  def allowed_nvme_bytes(self) -> float:
    """What the disk can take per step: write bandwidth x the all-on-device step."""
    return self.profile.write_gbps * 1e9 * self.baseline_s

  def location_map(self) -> dict[str, Location]:
    return dict(self.locations)

  def kept_location_map(self) -> dict[str, Location]:
    """Locations in the kept (last) layers: host/nvme tags stay on the device."""
    return {n: Location.DEVICE if loc in OFFLOADED else loc for n, loc in self.locations}

  def store_options(self) -> dict[str, int]:
    """``ssd.configure`` options the plan was predicted with: its staging arena."""
    return {"staging_bytes": self.staging_bytes} if self.staging_bytes else {}

  def policies(self) -> tuple[Any, Any]:
    """The plan's two ``jax.checkpoint`` policies, ``(offloading, keeping)``, in this order:

    0. ``offloading``: for layers ``0 .. offload_layers - 1`` (the first layers of the scan,
       whose backward comes last): every tag at :meth:`location_map` (host/nvme tags go to the
       store);
    1. ``keeping``: for layers ``offload_layers .. num_layers - 1``: the same, except that
       host/nvme tags are saved on the device (:meth:`kept_location_map`).

    Both are :func:`location_policy` results with the plan's ``min_bytes``. Where
    ``offload_layers`` is ``num_layers`` the second is unused, where it is 0 the first.
    :meth:`scan` applies them to a stack of layers (:func:`split_scan`); for a scan of your
    own, run layers ``[0, offload_layers)`` under the first and the others under the second.
    """
    return (
      location_policy(self.location_map(), min_bytes=self.min_bytes),
      location_policy(self.kept_location_map(), min_bytes=self.min_bytes),
    )

  def scan(self, layer_fn: Callable, params: Any, x: Any, *, prevent_cse: bool = False) -> Any:
    """Runs the stack as the plan says: ``layer_fn(layer_params, x) -> x`` (the function given
    to :func:`profile`) over ``params`` stacked on a leading axis of ``num_layers`` (every
    leaf ``(num_layers, ...)``), as a ``jax.lax.scan`` of ``jax.checkpoint(layer_fn,
    policy=...)``: the first ``offload_layers`` layers under ``policies()[0]``, the others
    under ``policies()[1]`` (two scans over slices of ``params`` when the plan splits the
    stack, else one). Returns the last layer's output. Differentiable like any JAX function::

        prof = ssd.profile(layer_fn, layer_params, x, num_layers=L)
        plan = ssd.plan(prof)
        loss = lambda stacked, x: plan.scan(layer_fn, stacked, x).sum()
        grads = jax.jit(jax.grad(loss))(stacked_params, x)

    ``prevent_cse`` is passed to ``jax.checkpoint`` (False by default, as is usual inside a
    scan). With ``flax.linen``, put ``nn.remat(Block, policy=plan.policies()[0])`` in an
    ``nn.scan`` of ``offload_layers`` layers and ``policies()[1]`` in one of the others.
    """
    L = self.profile.num_layers
    leaves = jax.tree.leaves(params)
    if not leaves:
      raise ValueError("params: expected stacked layer parameters, got no arrays")
    for leaf in leaves:
      if not np.shape(leaf) or np.shape(leaf)[0] != L:
        raise ValueError(
          f"params: every leaf must be stacked on a leading axis of num_layers={L} (the "
          f"plan's), got a leaf of shape {np.shape(leaf)}"
        )
    # a plan that sends nothing to the store runs every layer alike: one scan
    k = self.offload_layers if any(loc in OFFLOADED for _, loc in self.locations) else 0
    return split_scan(
      layer_fn, params, x, split=k, policies=self.policies(), prevent_cse=prevent_cse
    )

  def table(self) -> str:
    p, L, k = self.profile, self.profile.num_layers, self.offload_layers
    rows = [("tensor", "bytes/layer", "location", "layers", "raw I/O s/step", "compute window s")]
    window = p.forward_s * L + p.other_s + p.backward_s * L
    for t in p.tags:
      loc = self.location_map()[t.name]
      n = k if loc in OFFLOADED else L
      bw = {Location.NVME: min(p.write_gbps, p.read_gbps), Location.HOST: p.host_gbps}.get(loc)
      io = f"{2 * t.bytes * k / (bw * 1e9):.4f}" if bw else "-"
      rows.append((t.name, f"{t.bytes:,}", loc.value, f"{n}/{L}", io, f"{window:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(self._split_line())
    lines.append(
      f"predicted step {self.step_s * 1e3:.2f} ms (compute {self.compute_s * 1e3:.2f} "
      f"+ stall {self.stall_s * 1e3:.2f}; all on device {self.baseline_s * 1e3:.2f})"
    )
    if self.staging_bytes:
      lines.append(
        f"device staging arena {self.staging_bytes / 1e9:.3f} GB (link "
        f"{p.host_gbps:.1f} GB/s; the profile's arena: {p.staging_bytes / 1e9:.3f} GB)"
      )
    lines.append(
      f"residual device memory {self.device_bytes / 1e9:.3f} GB; per step to nvme "
      f"{self.nvme_bytes / 1e9:.3f} GB (disk allows {self.allowed_nvme_bytes / 1e9:.3f}"
      f" GB), to host {self.host_bytes / 1e9:.3f} GB" + (f"; batch {p.batch}" if p.batch else "")
    )
    if self.measured_device_bytes is not None:
      lines.append(f"device memory of the step (XLA): {self.measured_device_bytes / 1e9:.3f} GB")
    return "\n".join(lines)

  __str__ = table

  def _split_line(self) -> str:
    L, k = self.profile.num_layers, self.offload_layers
    moved = [n for n, loc in self.locations if loc in OFFLOADED]
    if not moved:
      return f"split: none (no tag goes to the store; all {L} layers alike)"
    tags, them = ", ".join(moved), "it" if len(moved) == 1 else "them"
    if k == 0:
      return (
        f"split: none (no layer sends {tags} to the store; every layer keeps {them} on the device)"
      )
    if k == L:
      return (
        f"split: none (every layer sends {tags} to the store; no layer keeps {them} on the device)"
      )
    first, rest = _layers(0, k), _layers(k, L)
    return (
      f"split: {first} {'sends' if k == 1 else 'send'} {tags} to the store, {rest} "
      f"{'keeps' if L - k == 1 else 'keep'} {them} on the device"
    )


def split_layers(params: Any, split: int) -> tuple[Any, Any]:
  """``(layers [0, split), layers [split, L))`` of ``params`` stacked on a leading axis of ``L``
  (every leaf ``(L, ...)``); an empty segment is None. Passed to :func:`split_scan` as
  arguments of their own (e.g. of a ``jax.jit``), the segments' gradients are two arrays, not
  concatenated into a second copy of the stack's (the planner's ``split_grad_copy=False``)."""
  _check_int("split", split, low=0)
  L = jax.tree.leaves(params)[0].shape[0]
  if split > L:
    raise ValueError(f"split: {split} layers > the {L} stacked layers")
  return tuple(
    jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], params) if hi > lo else None
    for lo, hi in ((0, split), (split, L))
  )


def split_scan(
  layer_fn: Callable,
  params: Any,
  x: Any,
  *,
  split: int | None,
  policies: tuple[Any, Any],
  prevent_cse: bool = False,
) -> Any:
  """A stack of layers as a split scan: layers ``[0, split)`` under ``policies[0]``, the others
  under ``policies[1]``; returns the last layer's output.

  Each segment is a ``jax.lax.scan`` of ``jax.checkpoint(layer_fn, policy=...)`` (a policy of
  None: no ``jax.checkpoint``, every residual kept), ``layer_fn(layer_params, x) -> x``. An
  empty segment is left out: ``split=0`` is one scan under ``policies[1]``, ``split=L`` one
  under ``policies[0]``. ``params``: the layers' parameters stacked on a leading axis of ``L``
  (sliced at ``split``), or with ``split=None`` the pair :func:`split_layers` returns.
  :meth:`Plan.scan` is this with the plan's split and ``Plan.policies()``; with your own scan,
  e.g.::

      first, rest = plan.policies()
      y = ssd.split_scan(layer_fn, stacked, x, split=plan.offload_layers, policies=(first, rest))

  ``prevent_cse`` is passed to ``jax.checkpoint`` (False by default, as is usual in a scan).
  """
  if len(policies) != 2:
    raise ValueError(f"policies: expected (first, rest), got {len(policies)} policies")
  segments = split_layers(params, split) if split is not None else params

  for policy, segment in zip(policies, segments):
    if segment is None:
      continue
    body = layer_fn
    if policy is not None:
      body = jax.checkpoint(layer_fn, policy=policy, prevent_cse=prevent_cse)
    x = jax.lax.scan(lambda h, p, body=body: (body(p, h), None), x, segment)[0]
  return x


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


@dataclasses.dataclass(frozen=True)
class OptimizerPlacement:
  """Where :func:`choose_optimizer_location` puts the optimizer state, and why; ``str()`` is
  one line naming both (``optimizer state: on the device (the step takes 3.10 GB of 80.00
  GB)``)."""

  on_device: bool  # False: in the store (offload_optimizer, location="auto" picks the tier)
  reason: str
  step_bytes: int | None = None  # the step's device memory with the state on the device
  budget_bytes: int | None = None  # what it was weighed against

  def __str__(self) -> str:
    return (
      f"optimizer state: {'on the device' if self.on_device else 'in the store'} ({self.reason})"
    )


def choose_optimizer_location(
  step_bytes: int | Callable[[], int],
  budget_bytes: int | None = None,
  *,
  device: Any = None,
) -> OptimizerPlacement:
  """Device or store for the optimizer state: on the device when the whole training step fits
  there with it (the update then reads nothing over the link), else in the store, where
  ``offload_optimizer(tx, location="auto")`` chooses the tier from the state's size.

  Args:
    step_bytes: the device memory of the training step with the state on the device (XLA's
      ``compiled.memory_analysis()``: arguments + outputs + temporaries - aliased, as
      ``plan_for_budget``'s ``memory_fn`` measures it), or a function returning it, called only
      when there is a budget to weigh it against (it usually compiles the step). A ValueError
      the function raises says why the state cannot be on the device (no plan fits with it,
      say): the state goes to the store, and its message is the reason.
    budget_bytes: the device memory the step must fit in; default: ``device``'s limit
      (``memory_stats()["bytes_limit"]``; default: the first local device). Without one (a
      CPU reports no limit) the state goes to the store.
    device: the device whose limit is the default budget.

  Returns:
    An :class:`OptimizerPlacement`; ``print`` it to say where the state went and why::

        where = ssd.choose_optimizer_location(lambda: step_bytes(state_on_device=True))
        print(where)
        tx = optax.adamw(1e-3) if where.on_device else ssd.offload_optimizer(optax.adamw(1e-3))
  """
  budget_bytes, need, refused = _weigh_step(step_bytes, budget_bytes, device)
  if budget_bytes is None:
    return OptimizerPlacement(False, "no device memory limit to weigh it against")
  budget = f"{budget_bytes / 1e9:.2f} GB"
  if refused is not None:
    return OptimizerPlacement(False, f"{refused}, budget {budget}", None, budget_bytes)
  if need <= budget_bytes:
    return OptimizerPlacement(
      True, f"the step takes {need / 1e9:.2f} GB of {budget}", need, budget_bytes
    )
  reason = f"the step takes {need / 1e9:.2f} GB with it on the device, budget {budget}"
  return OptimizerPlacement(False, reason, need, budget_bytes)


@dataclasses.dataclass(frozen=True)
class StackPlacement:
  """Where :func:`choose_stack_location` puts each class of a streamed layer stack's tensors
  (its parameters, their gradients' running sum, the optimizer state with the master copy),
  and why; ``str()`` is one line naming both."""

  location: str  # the parameters': init_streamed's location ("device", "host", ...)
  reason: str
  # the step's device memory with the chosen classes on the device (every class in the store:
  # with every class on the device, as weighed first)
  step_bytes: int | None = None
  budget_bytes: int | None = None
  peak_bytes: int | None = None  # check_streamed_room's peak of what lies in the store
  room_bytes: int | None = None  # the room of the tiers it uses
  sum_location: str | None = None  # value_and_grad_streamed's sum_location (None: location)
  state_location: str | None = None  # init_streamed_optimizer's location (None: location)
  save_inputs: str | None = None  # value_and_grad_streamed's save_inputs (None: not placed)

  @property
  def locations(self) -> dict[str, str]:
    """Each class's location: ``"params"``, ``"grad_sum"``, ``"optimizer_state"`` (and
    ``"activations"``, the saved layer inputs, where placed) to ``"device"``, ``"host"``,
    ``"nvme"`` or ``"host,nvme"``."""
    where = dict(
      params=self.location,
      grad_sum=self.sum_location or self.location,
      optimizer_state=self.state_location or self.location,
    )
    return where | ({"activations": self.save_inputs} if self.save_inputs else {})

  def __str__(self) -> str:
    where = self.locations
    if len(set(where.values())) == 1:
      return f"layer stack: {self.location} ({self.reason})"
    named = ", ".join(f"{_CLASS_NAMES[c]} {loc}" for c, loc in where.items())
    return f"layer stack: {named} ({self.reason})"


_CLASS_NAMES = dict(
  params="parameters",
  grad_sum="gradient sum",
  optimizer_state="optimizer state",
  activations="layer inputs",
)
# The classes the device keeps, most first: each left on the device saves the most link traffic
# per byte of device memory first. The parameters load twice per micro-batch (forward, and the
# backward pass's recomputation: 4 B in per bfloat16 parameter for 2 B of device memory); the
# saved layer inputs and the sum are each written and read once per micro-batch (1 B in and 1 B
# out per byte; the inputs first: far fewer bytes); the optimizer state and master copy once per
# optimizer step. Without activations to place, the placements that differ only in them merge.
_ON_DEVICE = (
  ("params", "activations", "grad_sum", "optimizer_state"),
  ("params", "activations", "grad_sum"),
  ("params", "activations"),
  ("params",),
  ("activations",),
  (),
)
_HOTTEST_FIRST = ("params", "activations", "grad_sum", "optimizer_state")


def _place_in_store(
  classes: tuple[str, ...], host_tier: bool, arithmetic_of: Callable[[dict], dict]
) -> tuple[dict, dict] | None:
  """``classes`` (hottest first) placed in the store, fastest first: all in the host tier; else
  each class in the host tier where it still fits beside the hotter ones placed there, the
  others in the files; else all in the host tier spilling to the files (first come, first
  placed); else all in the files. ``arithmetic_of(placement)``: the room arithmetic of a
  placement (``fits``). Returns the first placement that fits and its arithmetic, or None."""
  tried: dict = {}

  def fits(placement: dict) -> bool:
    tried[tuple(placement.items())] = arithmetic = arithmetic_of(placement)
    return arithmetic["fits"]

  def chosen(placement: dict) -> tuple[dict, dict]:
    return placement, tried[tuple(placement.items())]

  if host_tier:
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


def choose_stack_location(
  stack: Any,
  tx: Any = None,
  step_bytes: int | Callable[[dict[str, str]], int] | None = None,
  budget_bytes: int | None = None,
  *,
  sum_dtype: Any = jnp.float32,
  master_weights: bool | None = None,
  in_place: bool = False,
  activation_bytes: int | None = None,
  device: Any = None,
  name: str = "model",
) -> StackPlacement:
  """Where each class of a streamed layer stack's tensors lives: the parameters, their
  gradients' running sum, the optimizer state with the master copy and (``activation_bytes``)
  the layer inputs a micro-step saves for the backward pass, each on the device, in the host
  tier or in the files.

  The device keeps as many classes as the compiled step fits the budget with, in the order that
  saves the most link traffic per byte (all; the parameters, the layer inputs and the sum; the
  parameters and the inputs; the parameters; the inputs; none); the classes left go to the
  store, the hottest to the host tier: all of them there, else each there where it still fits
  beside the hotter ones and the rest in the files, else all in the host tier spilling to the
  files, else all in the files, the first whose peak (``check_streamed_room``'s arithmetic)
  fits the rooms.

  Args:
    stack: the stack's structure on the device (``jax.eval_shape`` of ``init_streamed(...,
      location="device")``: nothing made).
    tx, sum_dtype, master_weights, in_place: as :func:`check_streamed_room`'s.
    step_bytes: the device memory of the training step (XLA's memory analysis): a number, that
      with every class on the device (then only that placement is weighed), or a function of
      the classes' locations (``{"params", "grad_sum", "optimizer_state"}`` to ``"device"`` or
      a store location) returning it, called only where there is a budget to weigh it against;
      a ValueError it raises says why that placement cannot be. None: every class goes to the
      store.
    activation_bytes: the bytes of the layer inputs one micro-step saves
      (:func:`value_and_grad_streamed`'s ``save_inputs``): given, they are placed too
      (``StackPlacement.save_inputs``, ``locations["activations"]``); None: not placed (the
      step's own ``save_inputs``, outside the arithmetic).
    budget_bytes, device: as :func:`choose_optimizer_location`'s.

  Raises:
    StreamedRoomError: the stack's peak in the store exceeds the host tier and the files
      together, with the arithmetic.
  """
  # the arithmetic's own checks (the stack, dtype, flags, tx)
  check_streamed_room(
    stack, tx, sum_dtype=sum_dtype, master_weights=master_weights, in_place=in_place, name=name
  )
  lay = stack.layout
  if not lay.on_device:
    raise ValueError("stack: expected the stack's structure on the device (location='device')")
  master_weights = master_weights_of(lay, master_weights)
  sum_dtype = np.dtype(sum_dtype)
  host_tier = store_room(Location.HOST)[0] > 0
  if activation_bytes is not None:
    _check_int("activation_bytes", activation_bytes, low=0)
  classes = STACK_CLASSES + (("activations",) if activation_bytes is not None else ())
  placements = list(dict.fromkeys(tuple(c for c in p if c in classes) for p in _ON_DEVICE))

  def in_store(where: dict) -> dict:
    """The arithmetic of ``where``'s store classes against their rooms (``fits``)."""
    return room_arithmetic(
      lay,
      tx,
      sum_dtype,
      master_weights,
      in_place,
      where,
      name,
      refuse=False,
      activation_bytes=activation_bytes or 0,
    )

  whole = in_store(dict.fromkeys(classes, Location.HOST_NVME))
  held = {c: b * whole["num_layers"] for c, b in whole["layer_bytes"].items()}
  held["activations"] = activation_bytes or 0

  weighed = []  # per placement weighed: how it went
  budget, no_limit = None, False  # no_limit: the device reports no memory limit to weigh with
  for on_device in placements:
    stored = tuple(c for c in _HOTTEST_FIRST if c in classes and c not in on_device)
    kept = dict.fromkeys(on_device, Location.DEVICE)
    found = _place_in_store(stored, host_tier, lambda p: in_store(kept | p))
    if found is None:
      continue  # the store cannot hold what this placement leaves it
    choice, arithmetic = found
    locations = {c: (kept | choice)[c].value for c in classes}
    stored_part = (
      f"its peak in the store, {_gib(arithmetic['peak_bytes'])}, fits "
      + " + ".join(arithmetic["room_parts"])
      if stored
      else ""
    )
    placement = dict(
      location=locations["params"],
      sum_location=locations["grad_sum"],
      state_location=locations["optimizer_state"],
      save_inputs=locations.get("activations"),
      peak_bytes=arithmetic["peak_bytes"] if stored else None,
      room_bytes=arithmetic["room_bytes"],
    )
    if not on_device:
      why_not = _not_on_device(weighed, budget, step_bytes, classes, no_limit)
      why = "; ".join(w for w in (why_not, stored_part) if w)
      need = weighed[0][1] if weighed else None  # every class on the device
      return StackPlacement(reason=why, step_bytes=need, budget_bytes=budget, **placement)
    if no_limit or step_bytes is None:
      continue  # nothing to weigh this placement with, or against
    if not callable(step_bytes) and len(on_device) < len(classes):
      continue  # a number weighs every class on the device only
    weigh = (lambda locs=locations: step_bytes(locs)) if callable(step_bytes) else step_bytes
    # the classes' own bytes: a placement that cannot fit is not compiled to weigh it
    floor = sum(held[c] for c in on_device)
    on = _with_on_device(on_device, classes)
    budget, need, refused = _weigh_step(
      weigh, budget_bytes, device, floor, f"at least {_gib(floor)} with {on} on the device"
    )
    if budget is None:
      no_limit = True
      continue
    if refused is None and need <= budget:
      why = f"the step takes {_gib(need)} of {_gib(budget)} with {on} on the device"
      why = "; ".join(w for w in (why, stored_part) if w)
      return StackPlacement(reason=why, step_bytes=need, budget_bytes=budget, **placement)
    weighed.append((on_device, need, refused))
  why_not = _not_on_device(weighed, budget, step_bytes, classes, no_limit) or "not weighed"
  raise StreamedRoomError(
    f"{name}: its streamed stack of {whole['num_layers']} layers, "
    f"{whole['parameters']} parameters, fits neither the device ({why_not}) nor the store: its "
    f"peak is {whole['peak_bytes']} bytes ({_gib(whole['peak_bytes'])}) with every class there, "
    f"more than {' + '.join(whole['room_parts'])} = {whole['room_bytes']} bytes. Ways out: "
    "configure more room (ssd.configure(host_tier_bytes=..., capacity_bytes=...))"
    + ("; in_place=True" if not in_place else "")
    + ("; sum_dtype=bfloat16" if sum_dtype.itemsize > 2 else "")
    + "; or fewer or narrower layers"
  )


def _with_on_device(on_device: tuple[str, ...], classes: tuple[str, ...]) -> str:
  """For a placement's reason: every class ("it"), or the classes named."""
  if len(on_device) == len(classes):
    return "it"
  names = [_CLASS_NAMES[c] for c in on_device]
  return "its " + (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1]


def _not_on_device(
  weighed: list, budget: int | None, step_bytes: Any, classes: tuple, no_limit: bool
) -> str:
  """Why no class stays on the device: each placement weighed and what it took."""
  if step_bytes is None:
    return "no step to weigh"
  if no_limit:
    return "no device memory limit to weigh the step against"
  if not weighed:
    return ""
  parts: list[str] = []
  takes = "the step takes "  # said once, before the first size
  for on_device, need, refused in weighed:
    if need is None:
      if refused not in parts:  # one function's refusal, once
        parts.append(refused)
      continue
    parts.append(f"{takes}{_gib(need)} with {_with_on_device(on_device, classes)} on the device")
    takes = ""
  return ", ".join(parts) + (f", budget {_gib(budget)}" if budget is not None else "")


def _weigh_step(
  step_bytes, budget_bytes, device, floor: int = 0, over_floor: str = ""
) -> tuple[int | None, int | None, str | None]:
  """``(budget_bytes, need, refused)`` for :func:`choose_optimizer_location` and
  :func:`choose_stack_location`: the budget (default: ``device``'s limit, else the first local
  device's; None where it reports none: then nothing is weighed), the step's device memory
  (``step_bytes``, called if a function) and, where that raised a ValueError, its message; or,
  where ``floor`` (bytes the step holds whatever XLA does) exceeds the budget, ``over_floor``
  as the refusal without calling ``step_bytes`` (a compilation)."""
  if budget_bytes is None:
    device = jax.local_devices()[0] if device is None else device
    budget_bytes = (device.memory_stats() or {}).get("bytes_limit")
    if budget_bytes is None:
      return None, None, None
  _check_int("budget_bytes", budget_bytes, low=1)
  if floor > budget_bytes:
    return budget_bytes, None, over_floor
  try:
    return budget_bytes, int(step_bytes() if callable(step_bytes) else step_bytes), None
  except ValueError as e:
    return budget_bytes, None, str(e)


def _gib(n: int) -> str:
  return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def profile(
  layer_fn: Callable,
  params: Any,
  x: Any,
  *,
  num_layers: int,
  directory: str | os.PathLike | None = None,
  bandwidth: tuple[float, float] | None = None,
  host_gbps: float | None = None,
  host_cache_bytes: int | None = None,
  staging_bytes: int | None = None,
  host_tier_bytes: int | None = None,
  other_s: float = 0.0,
  update_s: float = 0.0,
  batch: int | None = None,
  repeats: int = 10,
  warmup: int = 2,
  progress: bool | None = None,
) -> Profile:
  """Times one layer ``layer_fn(params, x) -> y`` (``y`` shaped like ``x``: a scan body) as the
  training step runs it, reads the tagged bytes from its jaxpr, and takes the store bandwidth:
  ``bandwidth`` as (write, read) GB/s if given, else :func:`measured_bandwidth` of
  ``directory``, by default the store's own directory (the first of
  :func:`~jax_ssdtrain.store_directories`: ``ssd.configure``'s, else the private temporary
  one). The bandwidth probe writes and reads back what a step of this stack could send to the
  store (all its tags in all ``num_layers`` layers), in tensors of its largest tag, each
  rounded up to a power of two and kept between 16 MiB and 256 MiB (tensors: 1 MiB to
  64 MiB); it is measured once per filesystem and size, then cached on disk.

  Forward and backward times are per layer of a ``lax.scan`` with every tag saved on the device
  (the plan's all-on-device baseline): the difference between scans of 2 and of 4 or more
  layers (more for small layers, see ``_layer_times``), per layer, so that launch and transfer
  costs outside the layers cancel. The same scans with nothing saved give the cost of
  recomputing a layer (XLA fuses recomputed element-wise work into the backward, so it is often
  far below the forward time), which the tags share by FLOPs; with the input tag (else the
  smallest tag) in the host tier, the cost of one store and its load (``offload_s``: it goes
  through the store, which is set up if it is not yet).
  ``host_gbps`` (the host tier's link) defaults to the rate the engine's copies reached while
  the offload probe's layers computed (CUDA events; the store's statistics are reset), else to
  :func:`measured_link_gbps` (the link idle, cached).
  ``host_cache_bytes``, ``staging_bytes`` and ``host_tier_bytes`` default to the current store
  configuration's.

  It compiles the scans above (four, three where the layer has no tag) at both lengths (on
  the CPU each length's at once, on threads) and runs each ``warmup + 1 + repeats`` times.
  ``progress``: show each step (a tqdm bar where tqdm is installed, else a line per step on
  stderr); None shows it when stderr is a terminal."""
  _check_int("num_layers", num_layers, low=1)
  _check_int("repeats", repeats, low=1)
  _check_int("warmup", warmup)
  if progress is not None and not isinstance(progress, bool):
    raise ValueError(f"progress: expected True, False or None, got {progress!r}")
  if bandwidth is not None:
    if not isinstance(bandwidth, (tuple, list)) or len(bandwidth) != 2:
      raise ValueError(f"bandwidth: expected (write, read) GB/s, got {bandwidth!r}")
    _check_number("bandwidth[0] (write GB/s)", bandwidth[0])
    _check_number("bandwidth[1] (read GB/s)", bandwidth[1])
  cfg = config.current() or config.defaults()  # defaults: SSDTRAIN_* environment
  sizes = {
    k: getattr(cfg, k) if v is None else v
    for k, v in (
      ("host_cache_bytes", host_cache_bytes),
      ("staging_bytes", staging_bytes),
      ("host_tier_bytes", host_tier_bytes),
    )
  }
  tags, flops, input_tag = _tagged(layer_fn, params, x)
  # the offload cost is measured on the input tag, else the smallest tag the policies offload
  big = [n for n in tags if tags[n] >= DEFAULT_MIN_BYTES] or list(tags)
  probe_tag = input_tag or min(big, key=tags.get, default=None)
  programs = 3 + (probe_tag is not None)
  with _Progress(2 * (1 + programs) + (bandwidth is None), enabled=progress) as bar:
    if bandwidth is None:
      if directory is None:
        directory = config.store_directories()[0]
      probe_bytes, tensor_bytes = _probe_sizes(tags, num_layers)
      bar.start(f"store bandwidth of {os.fspath(directory)} ({probe_bytes >> 20} MiB)")
      bandwidth = measured_bandwidth(directory, probe_bytes, tensor_bytes=tensor_bytes)
      bar.finish()
    write_gbps, read_gbps = bandwidth
    if host_gbps is None and probe_tag is not None:
      config.reset_stats()
    forward_s, backward_s, recompute_s, offload_s = _layer_times(
      layer_fn, params, x, tuple(tags), probe_tag, repeats, warmup, bar
    )
  if host_gbps is None:
    host_gbps = _achieved_link_gbps() if probe_tag is not None else None
    host_gbps = host_gbps or measured_link_gbps()
  total = sum(flops.values()) or 1.0
  return Profile(
    num_layers=num_layers,
    forward_s=forward_s,
    backward_s=backward_s,
    tags=tuple(TagProfile(n, b, recompute_s * flops[n] / total) for n, b in tags.items()),
    write_gbps=float(write_gbps),
    read_gbps=float(read_gbps),
    host_gbps=float(host_gbps),
    **{k: int(v) for k, v in sizes.items()},
    input_bytes=tree_nbytes(x),
    input_tag=input_tag,
    param_bytes=tree_nbytes(params),
    offload_s=offload_s,
    other_s=other_s,
    update_s=update_s,
    batch=batch,
  )


def _tagged(
  layer_fn: Callable, params: Any, x: Any
) -> tuple[dict[str, int], dict[str, float], str | None]:
  """``({tag: bytes per layer}, {tag: forward FLOPs since the previous tag}, input tag)`` from
  the jaxpr; the input tag names the layer input ``x`` itself (a single array), else None."""
  with jax_internals.remat3(False):  # under jax_remat3 tags are not name_p eqns
    closed = jax.make_jaxpr(layer_fn)(params, x)
  n_x = len(jax.tree.leaves(x))
  inputs = set(closed.jaxpr.invars[-n_x:]) if n_x == 1 else set()
  sizes: dict[str, int] = {}
  flops: dict[str, float] = {}
  input_tags: set[str] = set()
  acc = 0.0
  for eqn, aliases in _walk(closed.jaxpr, inputs):
    if eqn.primitive is name_p:
      name = eqn.params["name"]
      sizes[name] = sizes.get(name, 0) + nbytes(eqn.invars[0].aval)
      flops[name] = flops.get(name, 0.0) + acc
      acc = 0.0
      if eqn.invars[0] in aliases:
        input_tags.add(name)
    else:
      acc += _flops(eqn)
  # a name that also tags other values does not free the input when it is offloaded
  input_tag = next((n for n in input_tags if sizes[n] == tree_nbytes(x)), None)
  return sizes, flops, input_tag


def _achieved_link_gbps() -> float | None:
  """The slower direction of the host tier's copies since the last reset, in GB/s of copy-
  stream busy time (None where none ran: no GPU, or every copy stayed in staging)."""
  s = config.stats()
  rates = [s[f"link_{d}_GBps"] for d in ("d2h", "h2d") if s.get(f"link_{d}_bytes", 0) >= 1 << 26]
  return min(rates) if rates else None


def measured_link_gbps(device: int = 0) -> float:
  """GB/s of the host tier's copies over GPU ``device``'s link: the slower direction of pinned
  copies between the engine's kind of host memory and the device (``probe.measure_link``,
  measured once per machine and cached); ``DEFAULT_HOST_GBPS`` where JAX has no GPU."""
  if not any(d.platform == "gpu" for d in jax.local_devices()):
    return DEFAULT_HOST_GBPS
  return link_probe.measure_link(device).gbps


def _probe_sizes(tags: Mapping[str, int], num_layers: int) -> tuple[int, int]:
  """``(bytes, tensor bytes)`` of the bandwidth probe for a stack: what one step could send to
  the store (every tag of every layer) in tensors of its largest tag, each rounded up to a
  power of two, the bytes between 16 MiB and 256 MiB, the tensors between 1 MiB and 64 MiB."""
  per_step = num_layers * sum(tags.values())
  total = min(max(_pow2_ceil(per_step), 16 << 20), 256 << 20)
  tensor = min(max(_pow2_ceil(max(tags.values(), default=0)), 1 << 20), 64 << 20, total)
  return total, tensor


def _pow2_ceil(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------
# Implementation


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


def _walk(jaxpr, aliases: frozenset | set = frozenset()) -> Iterable[tuple[Any, set]]:
  """``(equation, variables holding the traced input)`` in program order, descending into
  sub-jaxprs (pjit, custom_vjp, scan, ...); ``aliases`` follow the input into a sub-jaxpr
  whose inputs are its equation's operands (pjit, closed_call: same count)."""
  for eqn in jaxpr.eqns:
    subs = [v for v in eqn.params.values() if _is_jaxpr(v)]
    subs += [
      s for v in eqn.params.values() if isinstance(v, (tuple, list)) for s in v if _is_jaxpr(s)
    ]
    if subs and eqn.primitive is not name_p:
      sub = getattr(subs[0], "jaxpr", subs[0])  # branches/fwd-bwd pairs: the first is the forward
      inner = set()
      if len(sub.invars) == len(eqn.invars):
        inner = {v for v, outer in zip(sub.invars, eqn.invars) if _in(outer, aliases)}
      yield from _walk(sub, inner)
    else:
      yield eqn, aliases


def _in(var, aliases) -> bool:
  try:
    return var in aliases
  except TypeError:  # literals are not hashable
    return False


def _is_jaxpr(v) -> bool:
  return hasattr(v, "eqns") or (hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"))


def _flops(eqn) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contract = int(np.prod([lhs[d] for d in lc], dtype=np.int64))
    return 2.0 * contract * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
  if "attention" in name or "cudnn" in name:  # fused attention: QK^T and PV, (B,T,N,D)x(B,S,N,D)
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if len(q) == 4 and len(k) == 4:
      return 4.0 * q[0] * q[1] * k[1] * q[2] * q[3]
  return 0.0


def _layer_times(
  layer_fn, params, x, names, probe_tag, repeats: int, warmup: int, bar: _Progress | None = None
) -> tuple[float, float, float, float]:
  """(forward, backward, recompute, offload) seconds of one layer inside a scan: forward and
  backward with every tag saved on the device; recompute: what the backward adds when nothing
  is saved; offload: what the step adds when ``probe_tag`` goes to the host tier (0 if None)."""
  bar = bar or _Progress(0, enabled=False)

  def stack_of(policy):
    # prevent_cse=False as the models' and benchmarks' scanned layers (barriers cost time)
    body = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)
    return lambda ps, v: jax.lax.scan(lambda h, p: (body(p, h), None), v, ps)[0]

  def train_of(stack):  # forward with residuals, then the backward of a ones cotangent
    def train(ps, v):
      y, pullback = jax.vjp(stack, ps, v)
      return pullback(jnp.ones_like(y))

    return jax.jit(train)

  on_device = {n: Location.DEVICE for n in names}
  saved = stack_of(location_policy(on_device, min_bytes=0))
  fwd, fwd_bwd = jax.jit(saved), train_of(saved)
  remat_bwd = train_of(stack_of(jax.checkpoint_policies.nothing_saveable))
  fns = {
    "forward": fwd,
    "forward and backward": fwd_bwd,
    "recomputing backward": remat_bwd,
  }
  if probe_tag is not None:
    host = location_policy({**on_device, probe_tag: Location.HOST}, min_bytes=0)
    fns[f"{probe_tag!r} in the host tier"] = train_of(stack_of(host))
  v = jnp.asarray(x)

  def times_at(n):  # median seconds of each function on a scan of n layers
    bar.start(f"compiling {len(fns)} scans of {n} layers")
    # one program stacks every leaf: (n, ...) per leaf
    ps = jax.jit(lambda p: jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), p))(
      params
    )
    compiled = _compile_all([f.lower(ps, v) for f in fns.values()])
    bar.finish()
    times = []
    for what, c in zip(fns, compiled):
      bar.start(f"timing the {what} of {n} layers")
      times.append(median_time(lambda c=c: c(ps, v), repeats, warmup))
      bar.finish()
    return times

  # Two layers and more: a scan of one is no loop at all (XLA removes it, and with it the
  # per-layer slicing and stacking of residuals), so a difference against it overstates a layer.
  # The longer scan has at least 4 layers, more for small layers (up to 32), so that the
  # difference is at least MIN_DIFFERENCE_S of training time and not lost in timing noise.
  lo = 2
  short = times_at(lo)
  per_layer = max(short[1] / lo, 1e-9)
  hi = min(32, max(4, 2 * math.ceil((lo + MIN_DIFFERENCE_S / per_layer) / 2)))
  long = times_at(hi)
  # per layer: (T(hi) - T(2)) / (hi - 2); where timing noise makes it <= 0, T(hi) / hi
  d = [(b - a) / (hi - lo) for a, b in zip(short, long)]
  if min(d) <= 0 or d[1] <= d[0]:
    d = [b / hi for b in long]
  f, t, r = d[:3]
  # recomputing costs at least nothing and at most a forward (timing noise either way)
  return (
    f,
    (t - f if t > f else t / 2),
    min(max(r - t, 0.0), f),
    max(d[3] - t, 0.0) if probe_tag is not None else 0.0,
  )


def _compile_all(lowered: Sequence[Any]) -> list[Any]:
  """Compiles lowered programs: on the CPU at once, on threads (XLA compiles without holding
  the GIL; the lowering, which runs our hooks, stays on the caller's thread); elsewhere one at
  a time, as a GPU compiler's autotuning times kernels on the device and would time them
  against each other."""
  if len(lowered) < 2 or jax.default_backend() != "cpu":
    return [low.compile() for low in lowered]
  with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
    return list(pool.map(lambda low: low.compile(), lowered))


class _Progress:
  """``profile``'s steps: a tqdm bar where tqdm is installed, else a line per step on stderr;
  shown where ``enabled`` (None: when stderr is a terminal)."""

  def __init__(self, total: int, *, enabled: bool | None):
    self.total, self.done, self.bar, self.lines = total, 0, None, False
    if enabled is None:
      enabled = sys.stderr.isatty()
    if not enabled:
      return
    try:
      from tqdm import tqdm  # optional (the demo extra): a bar where installed, else lines
    except ImportError:
      self.lines = True
      return
    self.bar = tqdm(total=total, desc="ssd.profile", unit="step", file=sys.stderr, leave=True)

  def start(self, what: str) -> None:
    if self.bar is not None:
      self.bar.set_postfix_str(what)
    elif self.lines:
      print(f"ssd.profile [{self.done + 1}/{self.total}] {what}", file=sys.stderr, flush=True)

  def finish(self) -> None:
    self.done += 1
    if self.bar is not None:
      self.bar.update(1)

  def __enter__(self) -> _Progress:
    return self

  def __exit__(self, *exc) -> None:
    if self.bar is not None:
      self.bar.close()


def _layers(start: int, stop: int) -> str:
  """``layer 3`` or ``layers 0..2`` (``stop`` excluded)."""
  return f"layer {start}" if stop - start == 1 else f"layers {start}..{stop - 1}"


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
