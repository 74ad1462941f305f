"""The planner's types and tables: what it reads (``TagProfile``, ``Profile``: one layer of a
scan, the stack and the store), what it returns (``Plan``: the split and each tag's location,
with its predicted step, its memory and its ``jax.checkpoint`` policies; ``Placement``: where
``choose_placement`` puts each class of a model's training state, and why; the deprecated
``OptimizerPlacement`` and ``StackPlacement``, which the functions it replaced return), and the
defaults and location sets they share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_ssdtrain._src import options
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.planner.checks import _check_int, _check_number
from jax_ssdtrain._src.planner.split import split_scan
from jax_ssdtrain._src.policies import DEFAULT_MIN_BYTES, location_policy

DEFAULT_HOST_GBPS = 50.0  # without a GPU to measure: pinned host <-> H100 over PCIe, 41-55 GB/s
# measured (jax_ssdtrain.probe --link)
# The store's defaults (the option table's).
DEFAULT_HOST_CACHE_BYTES = options.default("host_cache_bytes")
# The most a plan's arena may take; under the store's staging_bytes="auto", its floor.
DEFAULT_STAGING_BYTES = options.default("staging_bytes") or options.staging.FLOOR_BYTES
DEFAULT_HOST_TIER_BYTES = options.default("host_tier_bytes")
OFFLOADED = (Location.HOST, Location.NVME)
# The locations the planner chooses from ("host,nvme" is a spill it does not model).
PLANNED = (Location.REMAT, Location.DEVICE, Location.HOST, Location.NVME)


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
  # the model options it was chosen with, sorted (name, value) pairs: plan_long_context's
  # (("loss_chunks", n), ("mlp_chunks", m)); () for a plan of the layer alone
  chunks: tuple[tuple[str, int], ...] = ()

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

  def model_options(self) -> dict[str, int]:
    """The model options the plan was chosen with (``plan_long_context``'s ``mlp_chunks`` and
    ``loss_chunks``, for ``models.get_config``); empty for other plans."""
    return dict(self.chunks)

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
    if self.chunks:
      lines.append("model options: " + ", ".join(f"{n}={v}" for n, v in self.chunks))
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


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where :func:`choose_placement` puts each class of a model's training state, and why;
  ``str()`` is one line naming both (``optimizer state: on the device (the step takes 2.89 GiB
  of 80.00 GiB)``, ``layer stack: parameters device, gradient sum host, optimizer state host
  (...)``).

  ``locations``: each class placed, to its location (``"device"``, ``"host"``, ``"nvme"`` or
  ``"host,nvme"``). A dense model's class is ``"optimizer_state"`` (``offload_optimizer``'s
  ``location``; ``"auto"`` where it goes to the store and its tier was not weighed, no ``tx``
  and ``params`` given: ``offload_optimizer``'s ``init`` chooses it by the same rule). A
  streamed stack's are ``"params"`` (``init_streamed``'s ``location``), ``"grad_sum"``
  (``value_and_grad_streamed``'s ``sum_location``), ``"optimizer_state"`` with the master copy
  (``init_streamed_optimizer``'s ``location``) and, where placed, ``"activations"``: the saved
  layer inputs (``save_inputs``); ``StreamedTrainer.placed`` takes the placement whole.
  """

  locations: dict[str, str]
  reason: str
  # the step's device memory with the chosen classes on the device (every class in the store:
  # with every class on the device, as weighed first)
  step_bytes: int | None = None
  budget_bytes: int | None = None  # what it was weighed against
  peak_bytes: int | None = None  # the most the store holds of it (None: nothing weighed there)
  room_bytes: int | None = None  # the room of the tiers it uses

  @property
  def on_device(self) -> bool:
    """Whether every class stays on the device (the store holds none of them)."""
    return all(loc == "device" for loc in self.locations.values())

  def __str__(self) -> str:
    where = self.locations
    if "params" not in where:  # a dense model: its optimizer state
      loc = where["optimizer_state"]
      said = {"device": "on the device", "auto": "in the store"}.get(loc, f"in the store, {loc}")
      return f"optimizer state: {said} ({self.reason})"
    if len(set(where.values())) == 1:
      return f"layer stack: {where['params']} ({self.reason})"
    named = ", ".join(f"{_CLASS_NAMES[c]} {loc}" for c, loc in where.items())
    return f"layer stack: {named} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class OptimizerPlacement:
  """Deprecated: :class:`Placement` (``locations["optimizer_state"]``). Where the deprecated
  ``choose_optimizer_location`` puts the optimizer state, and why; ``str()`` is one line naming
  both."""

  on_device: bool  # False: in the store (offload_optimizer, location="auto" picks the tier)
  reason: str
  step_bytes: int | None = None  # the step's device memory with the state on the device
  budget_bytes: int | None = None  # what it was weighed against

  def __str__(self) -> str:
    return (
      f"optimizer state: {'on the device' if self.on_device else 'in the store'} ({self.reason})"
    )


@dataclasses.dataclass(frozen=True)
class StackPlacement:
  """Deprecated: :class:`Placement`. Where the deprecated ``choose_stack_location`` puts each
  class of a streamed layer stack's tensors (its parameters, their gradients' running sum, the
  optimizer state with the master copy), and why; ``str()`` is one line naming both."""

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


def _layers(start: int, stop: int) -> str:
  """``layer 3`` or ``layers 0..2`` (``stop`` excluded)."""
  return f"layer {start}" if stop - start == 1 else f"layers {start}..{stop - 1}"
