"""The room a streamed stack needs in the store, refused before its first step where it does
not fit, and the read-ahead that lets its passes read whole layers ahead.

Owns :func:`check_streamed_room` (and :func:`room_arithmetic`, its arithmetic for a layout not
yet made, which the planner weighs placements with), :class:`StreamedRoomError`,
:func:`store_room` (what room a location gives), :func:`read_ahead_sizes` and the classes of a
stack's tensors (``STACK_CLASSES``) with each one's location (:func:`_class_locations`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream.spec import (
  _check_tx,
  _opt_params,
  _opt_spec,
  master_weights_of,
)
from jax_ssdtrain._src.layer_stream.stack import (
  _check_bool,
  _check_stack,
  _Layout,
  _parse_location,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.store_space import ENTRY_ALIGN as _ENTRY_ALIGN  # noqa: F401 (re-exported)
from jax_ssdtrain._src.store_space import entry_bytes, store_room


class StreamedRoomError(ValueError):
  """A streamed stack (its parameters, master copy, optimizer state and gradient sum) needs
  more room in the store than its location holds: raised by :func:`check_streamed_room` with
  the arithmetic."""


def _dtype_name(d: np.dtype) -> str:
  return np.dtype(d).name


STACK_CLASSES = (
  "params",
  "grad_sum",
  "optimizer_state",
)  # the classes of a streamed stack's tensors
# the class each of the message's four parts (parameters, master copy, state, sum) belongs to
_STORED = ("params", "optimizer_state", "optimizer_state", "grad_sum")


def _class_locations(lay: _Layout, sum_location: Any, state_location: Any) -> dict:
  """Each class's :class:`Location` (``STACK_CLASSES``): the parameters where the stack lives,
  the sum and the state there too unless given."""

  def parse(loc, what):
    return lay.location if loc is None else _parse_location(loc, what)

  return dict(
    params=lay.location,
    grad_sum=parse(sum_location, "sum_location"),
    optimizer_state=parse(state_location, "state_location"),
  )


def _fits(need: dict, rooms: dict) -> bool:
  """Whether bytes per store location (``need``) fit the rooms (``rooms``: the host tier's and
  the files'): each tier its own classes, and the classes that spill (``host,nvme``) the rest."""
  host, files = need.get(Location.HOST, 0), need.get(Location.NVME, 0)
  spill = need.get(Location.HOST_NVME, 0)
  h, f = rooms.get(Location.HOST, 0), rooms.get(Location.NVME, 0)
  return host <= h and files <= f and host + files + spill <= h + f


def read_ahead_sizes(
  stack: Any,
  tx: Any = None,
  *,
  sum_dtype: Any = jnp.float32,
  master_weights: bool | None = None,
  in_place: bool = False,
  sum_location: Any = None,
  state_location: Any = None,
  layers_ahead: int = 2,
) -> dict:
  """The store's read-ahead budget and each GPU's staging arena that let a streamed stack's
  passes read whole layers ahead: ``{"prefetch_bytes", "staging_bytes"}``, for
  ``ssd.configure`` (the defaults, 1 GiB each, hold a fraction of a large model's layer).

  Per layer, each pass loads from the store what of it lives there: the forward pass the
  parameters, the backward pass the parameters and the old gradient sum, the update the sum,
  the optimizer state and master copy (and the parameters where it reads them: no master copy,
  or ``in_place``). The forward and backward passes read ``layers_ahead`` layers ahead (their
  compute hides the loads); the update one (the link binds it: it computes little). The
  read-ahead into staging takes at most half the arena (the stores of the same step, a layer
  of new sums or of new parameters and state, keep the other half): the arena is twice the
  read-ahead, each rounded up to a MiB. Arguments as :func:`check_streamed_room`'s; a stack
  wholly on the device needs none (zeros)."""
  if isinstance(layers_ahead, bool) or not isinstance(layers_ahead, int) or layers_ahead < 1:
    raise ValueError(f"layers_ahead: expected an integer >= 1, got {layers_ahead!r}")
  lay, sum_dtype, master_weights, where = _room_args(
    stack, tx, sum_dtype, master_weights, in_place, sum_location, state_location
  )
  arithmetic = room_arithmetic(
    lay, tx, sum_dtype, master_weights, in_place, where, "stack", refuse=False
  )
  per_layer = {c: b if where[c].in_store else 0 for c, b in arithmetic["layer_bytes"].items()}
  p, s, m = (per_layer[c] for c in STACK_CLASSES)
  forward, backward = p, p + s
  update = s + m + (p if (not master_weights or in_place) else 0)
  ahead = max(layers_ahead * max(forward, backward), update)
  mib = lambda b: -(-b // (1 << 20)) * (1 << 20)  # noqa: E731
  return dict(prefetch_bytes=mib(ahead), staging_bytes=2 * mib(ahead))


def check_streamed_room(
  stack: Any,
  tx: Any = None,
  *,
  sum_dtype: Any = jnp.float32,
  master_weights: bool | None = None,
  in_place: bool = False,
  sum_location: Any = None,
  state_location: Any = None,
  name: str = "model",
) -> dict:
  """Refuses a streamed stack that does not fit the store, before anything is stored or run.

  ``stack``: a :class:`StreamedStack`, or its structure before it is made (``jax.eval_shape``
  of :func:`init_streamed`: nothing stored). ``tx``: the optax transformation that
  :func:`apply_streamed_update` will run (``None``: no optimizer state); ``master_weights`` as
  :func:`init_streamed_optimizer`'s (``None``: a float32 copy where the parameters are
  narrower); ``sum_dtype`` and ``in_place`` as :func:`value_and_grad_streamed`'s and
  :func:`apply_streamed_update`'s; ``sum_location`` (the gradients' sum) and ``state_location``
  (the optimizer state and master copy): each class's location where it is not the stack's
  (``None``: the stack's).

  Per parameter, the store holds the parameters (bfloat16: 2 B), the master copy (4 B), the
  optimizer state's per-parameter leaves (Adam's moments: 8 B) and the gradients' running sum
  (``sum_dtype``: 4 or 2 B), each class where it lives (a class on the device takes no room in
  the store). Unless ``in_place``, the update writes the new parameters, master copy and state
  beside the old ones at its peak (with master weights the old parameters are not read: they
  stay until swept), and a micro-step the new sum beside the old one. The peak (each entry, a
  layer's leaf, rounded up to the store's 4 KiB alignment; plus one layer of each class: the
  entries in flight; old versions released as soon as no array holds them: ``ssd.collect()``
  after each call) must fit the rooms (``store_room``) at both moments: ``host_tier_bytes``
  (``"host"``), ``capacity_bytes`` (``"nvme"``; where it is not configured, 90% of the store
  directories' free space, as the store takes it when it opens), both for the classes at
  ``"host,nvme"`` (what the others leave). Where it does not, raises :class:`StreamedRoomError`
  with the arithmetic. Returns the arithmetic (a dict: bytes per parameter per class, each
  class's location, the peak and the room) where it fits; with every class on the device the
  store holds nothing (``room_bytes`` ``None``). The activations saved in the store
  (``save_inputs``, policies) come on top of it."""
  lay, sum_dtype, master_weights, where = _room_args(
    stack, tx, sum_dtype, master_weights, in_place, sum_location, state_location
  )
  return room_arithmetic(lay, tx, sum_dtype, master_weights, in_place, where, name)


def _room_args(stack, tx, sum_dtype, master_weights, in_place, sum_location, state_location):
  """:func:`check_streamed_room`'s arguments checked: ``(layout, sum dtype, master weights,
  each class's location)``."""
  lay = _check_stack(stack, "stack", role="params")
  _check_bool(in_place, "in_place")
  sum_dtype = np.dtype(sum_dtype)
  if not jnp.issubdtype(sum_dtype, jnp.floating):
    raise ValueError(f"sum_dtype: expected a floating dtype, got {sum_dtype}")
  if tx is not None:
    _check_tx(tx)
  master_weights = master_weights_of(lay, master_weights)
  return lay, sum_dtype, master_weights, _class_locations(lay, sum_location, state_location)


def room_arithmetic(
  lay: _Layout,
  tx: Any,
  sum_dtype: np.dtype,
  master_weights: bool,
  in_place: bool,
  where: dict,
  name: str,
  refuse: bool = True,
  activation_bytes: int = 0,
) -> dict:
  """:func:`check_streamed_room`'s arithmetic for a stack's layout (its location aside) with
  each class at ``where[class]`` (a :class:`Location` per name of ``STACK_CLASSES``): the planner
  weighs placements of a stack not yet made with it. ``refuse=False``: returns the arithmetic
  with ``fits`` instead of raising where it does not fit. ``activation_bytes``: the layer inputs
  a micro-step saves (``save_inputs``), at ``where["activations"]`` during a micro-step."""
  count = sum(int(np.prod(s)) for s in lay.shapes) * lay.num_layers  # parameters
  L = lay.num_layers

  def entries(arrays) -> tuple[int, int]:
    """Bytes of one layer's entries for ``(size, itemsize)`` arrays, times the layers: as
    they are, and as the store holds them (each entry rounded up to its 4 KiB alignment)."""
    raw = sum(n * b for n, b in arrays)
    return raw * L, sum(entry_bytes(n * b) for n, b in arrays) * L

  sizes = [int(np.prod(s)) for s in lay.shapes]
  params = entries([(n, d.itemsize) for n, d in zip(sizes, lay.dtypes)])
  master = (0, 0)
  if master_weights:
    master = entries(
      [(n, 4 if jnp.issubdtype(d, jnp.floating) else d.itemsize) for n, d in zip(sizes, lay.dtypes)]
    )
  state, state_what = (0, 0), "none"
  if tx is not None:
    spec = _opt_spec(tx, lay, master_weights)
    one = jax.eval_shape(tx.init, _opt_params(lay, master_weights))
    state = entries(
      [
        (int(np.prod(x.shape)), np.dtype(x.dtype).itemsize)
        for x, k in zip(jax.tree.leaves(one), spec.per_layer)
        if k
      ]
    )
    state_what = f"{sum(spec.per_layer)} arrays per layer of {len(lay.shapes)} parameter arrays"
  grad_sum = entries([(n, sum_dtype.itemsize) for n in sizes])
  (params, params_held), (master, master_held) = params, master
  (state, state_held), (grad_sum, sum_held) = state, grad_sum
  # bytes each class holds in the store: resident, at a micro-step's peak, at the update's
  twice = 1 if in_place else 2
  held = dict(params=params_held, grad_sum=sum_held, optimizer_state=master_held + state_held)
  moments = dict(
    micro=dict(held, grad_sum=sum_held * twice),
    update=dict(held, params=params_held * twice, optimizer_state=held["optimizer_state"] * twice),
  )
  if activation_bytes:
    moments["micro"]["activations"] = activation_bytes  # released at their loads

  def by_location(per_class: dict) -> dict:
    out: dict = {}
    for c, b in per_class.items():
      if where[c].in_store:
        out[where[c]] = out.get(where[c], 0) + b + held.get(c, 0) // L  # one layer in flight
    return out

  stored = lambda per_class: sum(b for c, b in per_class.items() if where[c].in_store)  # noqa: E731
  resident = stored(held)
  micro_peak, update_peak = stored(moments["micro"]), stored(moments["update"])
  peak = max(micro_peak, update_peak) + resident // L  # one layer in flight
  per = lambda b: b / count  # noqa: E731 - bytes per parameter
  out = dict(
    parameters=count,
    num_layers=lay.num_layers,
    location=lay.location.value,
    locations={c: loc.value for c, loc in where.items()},
    bytes_per_parameter=dict(
      params=per(params), master=per(master), optimizer_state=per(state), grad_sum=per(grad_sum)
    ),
    # one layer's bytes per class (the optimizer state's with the master copy), unaligned
    layer_bytes=dict(
      params=params // L, grad_sum=grad_sum // L, optimizer_state=(master + state) // L
    ),
    resident_bytes=resident,
    micro_step_peak_bytes=micro_peak,
    update_peak_bytes=update_peak,
    peak_bytes=peak,
    room_bytes=None,
    in_place=in_place,
    host_bytes=0,  # the most the classes at "host" hold in the host tier, at either moment
  )
  used = {where[c] for c in moments["micro"] if where[c].in_store}
  out["fits"], out["room_parts"] = True, []
  if not used:
    return out
  tiers = set()
  for loc in used:
    tiers |= {Location.HOST, Location.NVME} if loc is Location.HOST_NVME else {loc}
  rooms, parts = {}, []
  for tier in (Location.HOST, Location.NVME):
    if tier in tiers:
      rooms[tier], named = store_room(tier)
      parts += named
  room = sum(rooms.values())
  out["room_bytes"], out["room_parts"] = room, parts
  need = {m: by_location(moments[m]) for m in moments}
  out["host_bytes"] = max(n.get(Location.HOST, 0) for n in need.values())
  out["fits"] = all(_fits(n, rooms) for n in need.values())
  if out["fits"] or not refuse:
    return out
  GB = 1e9
  p = out["bytes_per_parameter"]
  apart = len({where[c] for c in STACK_CLASSES}) > 1
  at = lambda c: f" at {where[c].value!r}" if apart else ""  # noqa: E731
  classes = [
    f"parameters {p['params']:g} B ({'/'.join(sorted({_dtype_name(d) for d in lay.dtypes}))})"
    + at("params"),
    f"master copy {p['master']:g} B"
    + ("" if master_weights else " (none)")
    + at("optimizer_state"),
    f"optimizer state {p['optimizer_state']:g} B ({state_what})" + at("optimizer_state"),
    f"gradient sum {p['grad_sum']:g} B ({sum_dtype.name})" + at("grad_sum"),
  ]
  if in_place:
    when = "each new version takes its old one's room (in place)"
  elif update_peak >= micro_peak:
    when = "the update writes the new parameters, master copy and state beside the old"
  else:
    when = "a micro-step writes the new gradient sum beside the old one"
  worst = need["update"] if update_peak >= micro_peak else need["micro"]
  over = [
    f"{loc.value!r} {b} bytes ({b / GB:.3g} GB)"
    for loc, b in sorted(worst.items(), key=lambda kv: kv[0].value)
  ]
  placed = (
    f"location={lay.location.value!r}"
    if not apart
    else "its classes' locations ("
    + ", ".join(f"{c} {where[c].value!r}" for c in STACK_CLASSES)
    + ")"
  )
  hints = ["configure more room (ssd.configure(host_tier_bytes=..., capacity_bytes=...))"]
  if used != {Location.HOST_NVME}:
    hints.append("use location='host,nvme' (the host tier spilling to the files)")
  if not in_place:
    hints.append("in_place=True (one version of the sum, state, master copy and parameters)")
  if sum_dtype.itemsize > 2:
    hints.append("sum_dtype=bfloat16 (2 B per parameter)")
  hints.append("or fewer or narrower layers")
  in_store = [c for c, k in zip(classes, _STORED) if where[k].in_store]  # the parts stored
  stored_bytes = sum(
    b for b, k in zip((params, master, state, grad_sum), _STORED) if where[k].in_store
  )
  raise StreamedRoomError(
    f"{name}: its streamed stack of {lay.num_layers} layers, {count} parameters "
    f"({count / 1e9:.3g}B), does not fit {placed}. Per parameter the "
    f"store holds {', '.join(in_store)} = {per(stored_bytes):g}"
    f" B ({resident / GB:.3g} GB with each entry's alignment); at its "
    f"peak {when}: {per(peak):.4g} B per parameter with one layer in flight, {peak} bytes "
    f"({peak / GB:.3g} GB)"
    + (f", by location {', '.join(over)}" if len(worst) > 1 else "")
    + f", more than {' + '.join(parts)} = {room} bytes ({room / GB:.3g} GB). "
    f"Ways out: {'; '.join(hints)}"
  )
