"""The planner's placement of whole classes of training state, each on the device or in the
store: ``choose_optimizer_location`` (the optimizer state) and ``choose_stack_location`` (a
streamed layer stack's parameters, gradient sum, optimizer state with the master copy, and
saved layer inputs). Both weigh the exact device memory of the step (XLA's memory analysis)
against a budget through one function, ``_weigh_step``; the stack's store placements are
weighed against the store's rooms with the layer stream's own room arithmetic, reached
through one function, ``_stack_room``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream import (
  STACK_CLASSES,
  StreamedRoomError,
  check_streamed_room,
  master_weights_of,
  room_arithmetic,
  store_room,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.planner.checks import _check_int
from jax_ssdtrain._src.planner.types import _CLASS_NAMES, OptimizerPlacement, StackPlacement


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
  classes, host_tier, in_store = _stack_room(
    stack, tx, sum_dtype, master_weights, in_place, activation_bytes, name
  )
  sum_dtype = np.dtype(sum_dtype)
  placements = list(dict.fromkeys(tuple(c for c in p if c in classes) for p in _ON_DEVICE))

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


def _stack_room(
  stack: Any,
  tx: Any,
  sum_dtype: Any,
  master_weights: bool | None,
  in_place: bool,
  activation_bytes: int | None,
  name: str,
) -> tuple[tuple[str, ...], bool, Callable[[dict], dict]]:
  """The layer stream's side of :func:`choose_stack_location` (the planner's one use of the
  stack's layout and the layer stream's room arithmetic): checks the stack and its options and
  returns ``(classes, host_tier, in_store)``: the classes to place (``STACK_CLASSES``, and
  ``"activations"`` where ``activation_bytes`` is given), whether the store has a host tier,
  and ``in_store(where)``: the arithmetic of ``where``'s store classes against their rooms
  (``fits``)."""
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

  return classes, host_tier, in_store


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
