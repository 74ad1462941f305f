"""The planner's placement of whole classes of training state under one device budget:
:func:`choose_placement`, the one entry point, for a dense model (its optimizer state) and for a
streamed layer stack (its parameters, gradient sum, optimizer state with the master copy, and
saved layer inputs), returning a :class:`Placement`; and the deprecated
``choose_optimizer_location`` and ``choose_stack_location``, which call it.

The step's exact device memory (XLA's memory analysis) is weighed against the budget through
one function, ``_weigh_step``; what the device leaves goes to the store's tiers by the one rule
of every ``"auto"`` (``tiers.choose_tiers``), each placement weighed with its own class's
arithmetic: a stack's with the layer stream's (reached through one function, ``_stack_room``),
a dense model's state with the optimizer's layout (``_dense_tier``)."""

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
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.planner.checks import _check_int
from jax_ssdtrain._src.planner.tiers import choose_tiers
from jax_ssdtrain._src.planner.types import (
  _CLASS_NAMES,
  OptimizerPlacement,
  Placement,
  StackPlacement,
)
from jax_ssdtrain._src.store_space import store_room

StepBytes = int | Callable[[dict[str, str]], int]


def choose_placement(
  step_bytes: StepBytes | None = None,
  budget_bytes: int | None = None,
  *,
  stack: Any = None,
  tx: Any = None,
  params: Any = None,
  sum_dtype: Any = None,
  master_weights: bool | None = None,
  in_place: bool = False,
  activation_bytes: int | None = None,
  device: Any = None,
  name: str = "model",
) -> Placement:
  """Where each class of a model's training state lives under one device budget: on the
  device as far as the compiled step fits the budget with it there (what stays there reads
  nothing over the link), the rest in the store's tiers by the one rule of every ``"auto"``
  (``offload_optimizer(tx, location="auto")``'s too).

  The classes: a dense model's optimizer state (``stack`` not given); a streamed layer stack's
  (``stack``) parameters, their gradients' running sum, the optimizer state with the master
  copy and, where ``activation_bytes`` is given, the layer inputs a micro-step saves for the
  backward pass. The device keeps as many classes as the step fits the budget with, in the
  order that saves the most link traffic per byte of device memory (all; the parameters, the
  layer inputs and the sum; the parameters and the inputs; the parameters; the inputs; none).

  The classes left go to the store, hottest first, to the first of these that fits: all in the
  host tier; each there where it still fits beside the hotter ones, the others in the files; all
  in the host tier spilling to the files; all in the files. A class wholly in the host tier
  fits in three quarters of it (the rest is left to the activations a step saves there); a
  spilling one fits where the store holds it. A stack's placement is weighed by its peak in
  the store (:func:`check_streamed_room`'s arithmetic); a dense model's state by what an update
  holds in the store (two versions, or with ``in_place`` one and the chunks in flight), as
  ``offload_optimizer``'s ``init`` lays it out.

  Args:
    step_bytes: the device memory of the training step (XLA's ``compiled.memory_analysis()``:
      arguments + outputs + temporaries - aliased, as ``plan_for_budget``'s ``memory_fn``
      measures it): a number, that with every class on the device (then only that placement is
      weighed), or a function of the classes' locations (``{class: "device" or a store
      location}``, as :attr:`Placement.locations` names them) returning it, called only where
      there is a budget to weigh it against (it usually compiles the step); a ValueError it
      raises says why that placement cannot be (no plan fits with it, say), and its message is
      the reason. None: every class goes to the store.
    budget_bytes: the device memory the step must fit in; default: ``device``'s limit
      (``memory_stats()["bytes_limit"]``; default: the first local device). Without one (a CPU
      reports no limit) every class goes to the store.
    stack: a streamed layer stack's structure on the device (``jax.eval_shape`` of
      ``init_streamed(..., location="device")``: nothing made); None: a dense model.
    tx: the optax transformation of the optimizer state. With a stack: as
      :func:`check_streamed_room`'s (None: no optimizer state). Dense, with ``params``: the
      state's tier in the store is chosen too, as ``offload_optimizer(tx, location="auto",
      in_place=in_place)``'s ``init`` chooses it (its default ``min_bytes`` and
      ``chunk_bytes``); without them its location in the store is ``"auto"`` (``init``
      chooses).
    params: a dense model's parameters (arrays or ``jax.ShapeDtypeStruct``s), with ``tx``.
    sum_dtype, master_weights: a stack's, as :func:`check_streamed_room`'s (``sum_dtype``
      None: float32).
    in_place: a stack's as :func:`check_streamed_room`'s; a dense model's as
      ``offload_optimizer``'s (one version of the state in the store).
    activation_bytes: the bytes of the layer inputs one micro-step of a stack saves
      (:func:`value_and_grad_streamed`'s ``save_inputs``): given, they are placed too
      (``locations["activations"]``); None: not placed (the step's own ``save_inputs``, outside
      the arithmetic).
    device: the device whose limit is the default budget.
    name: the model's name in messages.

  Returns:
    A :class:`Placement`; ``print`` it to say where each class went and why::

        where = ssd.choose_placement(step_bytes, tx=optax.adamw(1e-3), params=params)
        print(where)  # optimizer state: in the store, host (the step takes ...)
        tx = optax.adamw(1e-3) if where.on_device else ssd.offload_optimizer(
            optax.adamw(1e-3), location=where.locations["optimizer_state"])

  Raises:
    StreamedRoomError: a stack's peak in the store exceeds the host tier and the files
      together, with the arithmetic.
    OptimizerOffloadError: a dense model's state (``tx`` and ``params`` given), left to the
      store, does not fit it: as ``offload_optimizer``'s ``init`` refuses it.
  """
  if stack is not None:
    if params is not None:
      raise ValueError(
        "params: a dense model's parameters, given with stack=: give stack= for a streamed "
        "stack (its parameters are the stack's), params= and tx= for a dense model"
      )
    sum_dtype = jnp.float32 if sum_dtype is None else sum_dtype
    return _place_stack(
      stack,
      tx,
      step_bytes,
      budget_bytes,
      sum_dtype,
      master_weights,
      in_place,
      activation_bytes,
      device,
      name,
    )
  stack_only = dict(
    sum_dtype=sum_dtype, master_weights=master_weights, activation_bytes=activation_bytes
  )
  given = [k for k, v in stack_only.items() if v is not None]
  if given:
    raise ValueError(
      f"{', '.join(given)}: a streamed stack's, given without stack= (a dense model has its "
      "optimizer state alone to place)"
    )
  if (tx is None) != (params is None):
    raise ValueError(
      f"{'params' if tx is not None else 'tx'}: a dense model's state tier is weighed from tx "
      "and params together: give both (or neither: its tier is offload_optimizer's 'auto')"
    )
  if not isinstance(in_place, bool):
    raise ValueError(f"in_place: expected True or False, got {in_place!r}")
  return _place_dense(step_bytes, budget_bytes, tx, params, in_place, device, name)


def _place_dense(step_bytes, budget_bytes, tx, params, in_place, device, name) -> Placement:
  """:func:`choose_placement` for a dense model: its optimizer state on the device where the
  step fits with it there, else in the store (its tier by :func:`_dense_tier`)."""
  on_device = {"optimizer_state": "device"}
  need = budget = None
  if step_bytes is None:
    why = "no step to weigh"
  else:
    weigh = (lambda: step_bytes(dict(on_device))) if callable(step_bytes) else step_bytes
    budget, need, refused = _weigh_step(weigh, budget_bytes, device)
    if budget is None:
      why = "no device memory limit to weigh it against"
    elif refused is not None:
      why = f"{refused}, budget {_gib(budget)}"
    elif need <= budget:
      why = f"the step takes {_gib(need)} of {_gib(budget)}"
      return Placement(on_device, why, need, budget)
    else:
      why = f"the step takes {_gib(need)} with it on the device, budget {_gib(budget)}"
  if tx is None:
    return Placement({"optimizer_state": "auto"}, why, need, budget)
  tier, held, room, parts = _dense_tier(tx, params, in_place, name)
  fits = f"an update holds {_gib(held)} of it in the store, which fits {' + '.join(parts)}"
  return Placement({"optimizer_state": tier.value}, f"{why}; {fits}", need, budget, held, room)


def _dense_tier(tx, params, in_place: bool, name: str) -> tuple[Location, int, int, list[str]]:
  """A dense model's state in the store: ``(tier, bytes an update holds, the tier's room, its
  parts named)``, as ``offload_optimizer(tx, location="auto", in_place=in_place)``'s ``init``
  lays the state out and chooses its tier (``layout.auto_location``: the one rule); a state the
  store cannot hold refused as ``init`` refuses it (``OptimizerOffloadError``, naming the
  settings)."""
  # The optimizer's init places its state by this package's rule (optimizer/layout.py imports
  # planner/tiers.py), so its layout is reached here, where a dense model's tier is weighed.
  from jax_ssdtrain._src.optimizer.layout import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MIN_BYTES,
    Options,
    auto_location,
    check_room,
    make_layout,
    room_bytes,
  )

  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx: expected an optax GradientTransformation, got {tx!r}")
  opts = Options(Location.HOST, DEFAULT_MIN_BYTES, DEFAULT_CHUNK_BYTES, in_place)
  layout = make_layout(jax.eval_shape(tx.init, params), opts, name, params)
  tier = auto_location(layout)
  check_room(layout, tier, name)
  room, parts = store_room(tier)
  return tier, room_bytes(layout), room, parts


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


def _place_stack(
  stack: Any,
  tx: Any,
  step_bytes: StepBytes | None,
  budget_bytes: int | None,
  sum_dtype: Any,
  master_weights: bool | None,
  in_place: bool,
  activation_bytes: int | None,
  device: Any,
  name: str,
) -> Placement:
  """:func:`choose_placement` for a streamed layer stack: each placement of ``_ON_DEVICE``
  weighed in turn, what it leaves to the store placed by the one rule."""
  classes, in_store = _stack_room(
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

    def weigh(p, kept=kept):
      arithmetic = in_store(kept | p)
      return arithmetic["host_bytes"], arithmetic["fits"], arithmetic

    found = choose_tiers(stored, weigh)
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
      locations=locations,
      peak_bytes=arithmetic["peak_bytes"] if stored else None,
      room_bytes=arithmetic["room_bytes"],
    )
    if not on_device:
      why_not = _not_on_device(weighed, budget, step_bytes, classes, no_limit)
      why = "; ".join(w for w in (why_not, stored_part) if w)
      need = weighed[0][1] if weighed else None  # every class on the device
      return Placement(reason=why, step_bytes=need, budget_bytes=budget, **placement)
    if no_limit or step_bytes is None:
      continue  # nothing to weigh this placement with, or against
    if not callable(step_bytes) and len(on_device) < len(classes):
      continue  # a number weighs every class on the device only
    weigh_step = (lambda locs=locations: step_bytes(locs)) if callable(step_bytes) else step_bytes
    # the classes' own bytes: a placement that cannot fit is not compiled to weigh it
    floor = sum(held[c] for c in on_device)
    on = _with_on_device(on_device, classes)
    budget, need, refused = _weigh_step(
      weigh_step, budget_bytes, device, floor, f"at least {_gib(floor)} with {on} on the device"
    )
    if budget is None:
      no_limit = True
      continue
    if refused is None and need <= budget:
      why = f"the step takes {_gib(need)} of {_gib(budget)} with {on} on the device"
      why = "; ".join(w for w in (why, stored_part) if w)
      return Placement(reason=why, step_bytes=need, budget_bytes=budget, **placement)
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


# -- the names choose_placement replaced (deprecated: jax_ssdtrain/_src/deprecations.py) -------


def choose_optimizer_location(
  step_bytes: int | Callable[[], int],
  budget_bytes: int | None = None,
  *,
  device: Any = None,
) -> OptimizerPlacement:
  """Deprecated: ``choose_placement(step_bytes, budget_bytes, device=...)`` (its
  ``step_bytes`` a function of the classes' locations; ``.on_device``). Device or store for a
  dense model's optimizer state, as :func:`choose_placement` chooses it."""
  weigh = (lambda locations: step_bytes()) if callable(step_bytes) else step_bytes
  where = choose_placement(weigh, budget_bytes, device=device)
  return OptimizerPlacement(where.on_device, where.reason, where.step_bytes, where.budget_bytes)


def choose_stack_location(
  stack: Any,
  tx: Any = None,
  step_bytes: StepBytes | None = None,
  budget_bytes: int | None = None,
  *,
  sum_dtype: Any = jnp.float32,
  master_weights: bool | None = None,
  in_place: bool = False,
  activation_bytes: int | None = None,
  device: Any = None,
  name: str = "model",
) -> StackPlacement:
  """Deprecated: ``choose_placement(step_bytes, budget_bytes, stack=stack, tx=tx, ...)``
  (``.locations``). Each class of a streamed stack's place, as :func:`choose_placement`
  chooses it."""
  where = choose_placement(
    step_bytes,
    budget_bytes,
    stack=stack,
    tx=tx,
    sum_dtype=sum_dtype,
    master_weights=master_weights,
    in_place=in_place,
    activation_bytes=activation_bytes,
    device=device,
    name=name,
  )
  loc = where.locations
  return StackPlacement(
    location=loc["params"],
    reason=where.reason,
    step_bytes=where.step_bytes,
    budget_bytes=where.budget_bytes,
    peak_bytes=where.peak_bytes,
    room_bytes=where.room_bytes,
    sum_location=loc["grad_sum"],
    state_location=loc["optimizer_state"],
    save_inputs=loc.get("activations"),
  )


def _stack_room(
  stack: Any,
  tx: Any,
  sum_dtype: Any,
  master_weights: bool | None,
  in_place: bool,
  activation_bytes: int | None,
  name: str,
) -> tuple[tuple[str, ...], Callable[[dict], dict]]:
  """The layer stream's side of :func:`choose_placement` for a stack (the planner's one use of
  the stack's layout and the layer stream's room arithmetic): checks the stack and its options
  and returns ``(classes, in_store)``: the classes to place (``STACK_CLASSES``, and
  ``"activations"`` where ``activation_bytes`` is given) and ``in_store(where)``: the
  arithmetic of ``where``'s store classes against their rooms (``fits``; ``host_bytes``: what
  its classes at ``"host"`` hold there)."""
  # the arithmetic's own checks (the stack, dtype, flags, tx)
  check_streamed_room(
    stack, tx, sum_dtype=sum_dtype, master_weights=master_weights, in_place=in_place, name=name
  )
  lay = stack.layout
  if not lay.on_device:
    raise ValueError("stack: expected the stack's structure on the device (location='device')")
  master_weights = master_weights_of(lay, master_weights)
  sum_dtype = np.dtype(sum_dtype)
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

  return classes, in_store


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
  """``(budget_bytes, need, refused)`` for :func:`choose_placement`: the budget (default: ``device``'s limit, else the first local
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
