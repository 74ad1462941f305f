"""The layer stream as one JAX loss: :func:`scan_stack` inside it, :func:`value_and_grad` around.

This module owns the way a user writes a model whose stack of blocks streams: one loss over the
whole model, in which :func:`scan_stack` (``jax.lax.scan``'s signature, its ``xs`` replaced by a
:class:`~jax_ssdtrain.StreamedStack` of parameters plus optional per-layer inputs) runs the
blocks, and :func:`value_and_grad` (``jax.value_and_grad``'s signature) that returns the
gradients in the structure of the parameters, a stack's as its gradient's running sum in the
store. The stack's I/O (loading and storing one layer, the ordering tokens, the passes the engine
predicts loads from) is ``layer_stream``'s, the rule's two passes ``stream_scan_passes``'.

How a stack's gradient leaves the backward pass. ``scan_stack`` is a ``jax.custom_vjp``: its
forward rule loads layer ``i + 1`` while layer ``i`` computes and saves each layer's carry input
(on the device, or in the store); its backward rule recomputes each layer's vjp from that input
and the reloaded parameters, adds the parameters' gradient into the running sum (the old sum's
entries loaded, the new ones stored beside them) and passes the carry's cotangent down. A
backward rule can only return cotangents of its inputs, so :func:`value_and_grad` gives each
stack it differentiates a float "gradient carrier" input: in the store, the old sum's handles
(``uint32[L, 2]`` per leaf) encoded exactly as float32 integers of 16 bits each (``[L, 4]``, hi
then lo halves); with the sum on the device, the old sum itself. The backward rule reads the old
sum from the carrier's value and returns the new sum, encoded the same way, as the carrier's
cotangent, which :func:`value_and_grad` decodes into a :class:`~jax_ssdtrain.StreamedStack` of
kind ``grad_sum``. (Zeros added to the integers stay exact; nothing else reaches the carrier.)

Which stacks have a carrier is decided while the loss is traced: :func:`value_and_grad` binds
each stack of its differentiated arguments for the duration of the trace, and ``scan_stack``
looks its stack up there. A stack not bound (one in an argument not differentiated) is frozen:
its blocks are recomputed and the carry's cotangent passes down, no sum is made. Outside
:func:`value_and_grad`, ``scan_stack`` evaluates the forward pass only; differentiating it with
``jax.grad`` is refused with the fix. :func:`value_and_grad_streamed`, the embed/block/head
triple, is a loss of three pieces over the two.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream import (
  StreamedStack,
  _check_bool,
  _check_role,
  _check_stack,
  _describe,
  _is_array,
  _parse_location,
  _scan_layers,
  _sum_layout,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.stream_scan_passes import decode, encode, make_spec, scan_core, strong

__all__ = ["grad", "scan_stack", "value_and_grad", "value_and_grad_streamed"]


# ---------------------------------------------------------------------------------------------
# Public API


def scan_stack(
  f: Callable[[Any, Any, Any], tuple[Any, Any]],
  init: Any,
  stack: StreamedStack,
  xs: Any = None,
) -> tuple[Any, Any]:
  """``jax.lax.scan(f, init, (stack, xs))`` over a streamed stack, layer by layer.

  Named and shaped after ``jax.lax.scan``: ``f(carry, layer_params, x) -> (carry, y)`` is the
  scan's body with one layer's parameters (a tree of one layer's arrays, loaded from the store
  while the layer before computes) and ``x``, that layer's slice of ``xs`` (any pytree whose
  leaves have the leading layer axis: per-layer inputs that are not parameters, RNG keys;
  ``None`` without). ``carry`` is any pytree (a hidden state and a mask) that ``f`` returns
  with the same structure, shapes and dtypes. Returns ``(carry, ys)``, ``ys`` the ``y``'s
  stacked along a leading layer axis, as ``lax.scan`` does.

  ``f`` may close over traced values (positions, masks): they are hoisted
  (``jax.closure_convert``) and get their cotangents summed over the layers.

  Differentiate the loss that calls it with :func:`jax_ssdtrain.value_and_grad` (or
  :func:`jax_ssdtrain.grad`): it returns the stack's gradient as its running sum in the store.
  Outside of them this evaluates the forward pass (evaluation, inference); ``jax.grad`` of it is
  refused. Each stack is scanned once per loss.

  ``stack`` may also be a stacked tree of ordinary arrays (leading layer axis): this is then
  ``jax.lax.scan`` itself, so that one loss serves a model whose stack streams and the same
  model on the device (under ``jax.grad`` or :func:`value_and_grad` alike).
  """
  if not callable(f):
    raise TypeError(f"scan_stack: f must be callable (the scan's body), got {f!r}")
  if not isinstance(stack, StreamedStack):
    return _scan_arrays(f, init, stack, xs)
  lay = _check_stack(stack, "scan_stack: stack")
  if lay.kind in ("grad_sum", "opt_state"):
    raise ValueError(
      f"scan_stack: stack is a stack of kind {lay.kind!r} ({stack!r}), not parameters: pass the "
      "parameters' StreamedStack (a gradient sum is what value_and_grad returns for one)"
    )
  num_layers = lay.num_layers
  for path, leaf in jax.tree_util.tree_flatten_with_path(xs)[0]:
    if np.ndim(leaf) < 1 or np.shape(leaf)[0] != num_layers:
      raise ValueError(
        f"scan_stack: xs{jax.tree_util.keystr(path)} has shape {list(np.shape(leaf))}: every "
        f"leaf of xs needs the stack's leading layer axis of {num_layers}"
      )
  init = jax.tree.map(strong, init)
  spec = make_spec(f, init, lay, xs)
  slot = _bound_slot(stack)
  if slot is not None:
    if slot.used:
      raise ValueError(
        f"scan_stack: the stack {slot.name} ({stack!r}) is scanned a second time in one loss: "
        "each stack's gradient is one streamed sum, made by its one scan. Scan it once (put "
        "both uses' layers in one stack, or make two stacks)"
      )
    slot.used = True
    mode = "grad"
  else:
    mode = "frozen" if _scopes() else "eval"
  core = scan_core(spec, mode, slot)
  carrier = slot.carrier if slot is not None else None
  return core(carrier, jax.tree.leaves(stack.handles), init, xs, tuple(spec.consts))


def _scan_arrays(f, init, stack, xs):
  leaves = jax.tree.leaves(stack)
  if not leaves or not all(hasattr(x, "shape") and np.ndim(x) >= 1 for x in leaves):
    raise TypeError(
      "scan_stack: stack: expected a StreamedStack (ssd.stack_from_tree of a stacked tree, "
      f"ssd.init_streamed) or a stacked tree of arrays, got {type(stack).__name__}"
      + ("" if not leaves else f" with leaves {[type(x).__name__ for x in leaves][:4]}")
    )
  return jax.lax.scan(lambda c, a: f(c, *a), init, (stack, xs))


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  *,
  save_inputs: Any = "device",
  sum_dtype: Any = jnp.float32,
  sum_location: Any = None,
  in_place: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` for a loss that calls :func:`scan_stack` over streamed stacks.

  Named after ``jax.value_and_grad``, with its ``argnums`` and ``has_aux``: returns
  ``step(*args, sums=None, **kwargs) -> (value, grads)`` (``((value, aux), grads)`` with
  ``has_aux``), to call under ``jax.jit``. ``grads`` has the structure of the differentiated
  arguments; in place of each :class:`~jax_ssdtrain.StreamedStack` of parameters stands its
  gradient as a :class:`~jax_ssdtrain.StreamedStack` of kind ``grad_sum`` at ``sum_location``
  (the device never holds it whole); the other leaves' gradients are arrays in ``sum_dtype``.

  ``sums``: the ``grads`` of an earlier call (gradient accumulation over micro-batches): the
  returned gradients are then their sum with this call's; donate them
  (``jax.jit(step, donate_argnames="sums")``).

  Options (as :func:`~jax_ssdtrain.value_and_grad_streamed`'s): ``save_inputs``, where each
  layer's carry input waits for the backward pass (``"device"`` or a store location ``"host"``,
  ``"nvme"``, ``"host,nvme"``; the blocks are recomputed from them in every case);
  ``sum_dtype``, of the sums (float32, or bfloat16 at 2 B per parameter); ``sum_location``,
  ``None`` (where each stack lives) or ``"device"`` or a store location; ``in_place``, each load
  of the old sum is its entries' last (the store holds one version of the sum, and a step that
  fails part way leaves none consistent). With a stack at ``location="device"`` the same program
  is the bit-for-bit reference of the store's.
  """
  if not callable(fun):
    raise TypeError(f"value_and_grad: fun must be callable, got {fun!r}")
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
    raise TypeError(f"value_and_grad: argnums: expected an int or a tuple of ints, got {argnums!r}")
  _check_bool(has_aux, "has_aux")
  _check_bool(in_place, "in_place")
  opts = _options(save_inputs, sum_dtype, sum_location, in_place)

  def step(*args, sums=None, **kwargs):
    return _value_and_grad(fun, nums, isinstance(argnums, int), has_aux, opts, args, kwargs, sums)

  step.__name__ = f"value_and_grad({getattr(fun, '__name__', 'fun')})"
  step.__doc__ = fun.__doc__
  return step


def grad(
  fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, **options
):
  """``jax.grad`` for a loss that calls :func:`scan_stack`: :func:`value_and_grad`'s gradients
  alone (``(grads, aux)`` with ``has_aux``), with its options and ``sums``."""
  vg = value_and_grad(fun, argnums, has_aux, **options)

  def step(*args, sums=None, **kwargs):
    value, grads = vg(*args, sums=sums, **kwargs)
    return (grads, value[1]) if has_aux else grads

  step.__name__ = f"grad({getattr(fun, '__name__', 'fun')})"
  return step


# ---------------------------------------------------------------------------------------------
# The stacks value_and_grad differentiates, bound while the loss is traced


@dataclasses.dataclass(eq=False)
class _Options:
  save: Location
  sum_dtype: np.dtype
  sum_location: Location | None
  in_place: bool


def _options(save_inputs, sum_dtype, sum_location, in_place) -> _Options:
  try:
    dtype = np.dtype(sum_dtype)
  except TypeError:
    raise ValueError(f"sum_dtype: expected a floating dtype, got {sum_dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"sum_dtype: expected a floating dtype, got {dtype}")
  sum_loc = None if sum_location is None else _parse_location(sum_location, "sum_location")
  save = _parse_location(save_inputs, "save_inputs")
  return _Options(save, dtype, sum_loc, in_place)


@dataclasses.dataclass(eq=False)
class _Slot:
  """One stack a value_and_grad differentiates, for the length of the loss's trace."""

  name: str  # for messages: where it sits in the arguments
  stack: StreamedStack
  sum_lay: Any  # the layout of its gradient sum
  old_sum: bool  # the carrier holds an old sum (else zeros)
  options: _Options
  carrier: Any = None  # the carrier as traced (set while the loss is traced)
  used: bool = False  # a scan_stack took it
  differentiated: bool = False  # its backward rule ran


_LOCAL = threading.local()


def _scopes() -> list:
  if not hasattr(_LOCAL, "scopes"):
    _LOCAL.scopes = []
  return _LOCAL.scopes


def _bound_slot(stack: StreamedStack) -> _Slot | None:
  leaves = jax.tree.leaves(stack.handles)
  for scope in reversed(_scopes()):
    for slot in scope:
      if slot.stack is stack or all(
        a is b for a, b in zip(leaves, jax.tree.leaves(slot.stack.handles))
      ):
        return slot
  return None


def _is_stack(x: Any) -> bool:
  return isinstance(x, StreamedStack)


def _value_and_grad(fun, nums, single, has_aux, opts, args, kwargs, sums):
  for n in nums:
    if not -len(args) <= n < len(args):
      raise TypeError(
        f"value_and_grad: argnums {n} is out of range for the {len(args)} positional arguments "
        "the function was called with"
      )
  nums = tuple(n % len(args) for n in nums)
  diff = tuple(args[n] for n in nums)
  flat, treedef = jax.tree_util.tree_flatten_with_path(diff, is_leaf=_is_stack)
  names = [_arg_name(nums, single, path) for path, _ in flat]
  leaves = [leaf for _, leaf in flat]
  is_stack = [_is_stack(x) for x in leaves]
  for name, leaf, st in zip(names, leaves, is_stack):
    if st:
      lay = _check_stack(leaf, name)
      if lay.kind in ("grad_sum", "opt_state"):
        raise ValueError(
          f"value_and_grad: {name} is a stack of kind {lay.kind!r} ({leaf!r}), not parameters: "
          "pass the parameters' StreamedStack there, and an earlier call's gradients as sums="
        )
    elif not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TypeError(
        f"value_and_grad: {name} has dtype {jnp.result_type(leaf)}: the differentiated "
        "arguments must be floating arrays or StreamedStacks (move it to an argument that "
        "argnums does not name)"
      )
  sum_lays = [
    _sum_layout(
      x.layout,
      opts.sum_dtype,
      x.layout.location if opts.sum_location is None else opts.sum_location,
    )
    if st
    else None
    for x, st in zip(leaves, is_stack)
  ]
  old = _check_sums(sums, treedef, names, leaves, sum_lays, single)
  slots, carriers = [], []
  for name, leaf, st, sum_lay, o in zip(names, leaves, is_stack, sum_lays, old):
    if not st:
      continue
    for slot in slots:
      if jax.tree.leaves(slot.stack.handles)[0] is jax.tree.leaves(leaf.handles)[0]:
        raise ValueError(
          f"value_and_grad: {name} is the stack {slot.name} again (the same handles): a stack's "
          "gradient is one sum, so pass it once and scan it once"
        )
    slots.append(_Slot(name, leaf, sum_lay, o is not None, opts))
    carriers.append(_carrier_of(sum_lay, o))
  others = [x for x, st in zip(leaves, is_stack) if not st]

  def inner(others, carriers):
    it_others, it_slots = iter(others), iter(slots)
    rebuilt = [next(it_slots).stack if st else next(it_others) for st in is_stack]
    for slot, c in zip(slots, carriers):
      slot.carrier = c
    call = list(args)
    for n, a in zip(nums, jax.tree.unflatten(treedef, rebuilt)):
      call[n] = a
    _scopes().append(slots)
    try:
      out = fun(*call, **kwargs)
    finally:
      _scopes().pop()
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
          "value_and_grad: with has_aux=True, fun must return a pair (loss, aux), got "
          f"{type(out).__name__}"
        )
      loss, aux = out
    else:
      loss, aux = out, None
    if isinstance(loss, (tuple, list)):
      raise TypeError(
        f"value_and_grad: fun returned a {type(loss).__name__}, not a scalar loss: with a pair "
        "(loss, aux), pass has_aux=True"
      )
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise TypeError(
        "value_and_grad: fun must return a floating scalar loss, got "
        f"{jnp.result_type(loss)}{list(jnp.shape(loss))}"
      )
    return loss, aux

  loss, vjp_fn, aux = jax.vjp(inner, others, carriers, has_aux=True)
  ct_others, ct_carriers = vjp_fn(jnp.ones_like(loss))
  it_others, it_slots = iter(ct_others), iter(zip(slots, ct_carriers))
  grads = []
  for st, o in zip(is_stack, old):
    if st:
      slot, ct = next(it_slots)
      grads.append(_new_sum(slot, ct, o))
    else:
      g = next(it_others)
      if jnp.issubdtype(g.dtype, jnp.floating):
        g = g.astype(opts.sum_dtype)
      grads.append(g if o is None else o + g)
  grads = jax.tree.unflatten(treedef, grads)
  if single:
    (grads,) = grads
  return ((loss, aux) if has_aux else loss), grads


def _arg_name(nums, single, path) -> str:
  (first, *rest) = path
  n = nums[first.idx]
  return f"args[{n}]{jax.tree_util.keystr(tuple(rest))}"


def _carrier_of(sum_lay, old: StreamedStack | None) -> list:
  """A stack's gradient carrier: the old sum's handles encoded (its arrays on the device), or
  zeros of that shape."""
  if sum_lay.on_device:
    if old is not None:
      return list(jax.tree.leaves(old.handles))
    return [jnp.zeros((sum_lay.num_layers, *s), d) for s, d in zip(sum_lay.shapes, sum_lay.dtypes)]
  if old is not None:
    return [encode(h) for h in jax.tree.leaves(old.handles)]
  return [jnp.zeros((sum_lay.num_layers, 4), jnp.float32) for _ in sum_lay.shapes]


def _new_sum(slot: _Slot, ct: list, old: StreamedStack | None) -> StreamedStack:
  lay = slot.sum_lay
  if not slot.differentiated:  # the loss did not reach the stack: its gradient is zero
    if old is not None:
      return old
    zeros = jax.tree.unflatten(
      lay.treedef, [jnp.zeros(s, d) for s, d in zip(lay.shapes, lay.dtypes)]
    )
    return _scan_layers(lay, lambda i: zeros)
  if lay.on_device:
    leaves = [c.astype(d) for c, d in zip(ct, lay.dtypes)]
  else:
    leaves = [decode(c) for c in ct]
  return StreamedStack(jax.tree.unflatten(lay.treedef, leaves), lay)


def _check_sums(sums, treedef, names, leaves, sum_lays, single) -> list:
  """The old sums per differentiated leaf (None each without ``sums``), once they match."""
  if sums is None:
    return [None] * len(leaves)
  flat, tree = jax.tree_util.tree_flatten((sums,) if single else tuple(sums), is_leaf=_is_stack)
  if tree != treedef:
    raise ValueError(
      "sums: expected the gradients an earlier call returned (the structure of the "
      f"differentiated arguments, {treedef}), got the structure {tree}"
    )
  for name, s, x, lay in zip(names, flat, leaves, sum_lays):
    what = f"sums (at {name})"
    if lay is not None:
      got = _check_stack(s, what) if _is_stack(s) else None
      if got != lay:
        raise ValueError(
          f"{what}: expected this stack's gradient sum ({_describe_layout(lay)}), got "
          f"{s!r}"
          + ("" if got is None else f" ({_describe_layout(got)})")
          + " (a sum of another stack, sum_dtype or sum_location)"
        )
    elif np.shape(s) != np.shape(x):
      raise ValueError(f"{what}: shape {list(np.shape(s))}, the parameter's is {list(np.shape(x))}")
  return flat


def _describe_layout(lay) -> str:
  leaves = [f"{d.name}{list(s)}" for s, d in zip(lay.shapes, lay.dtypes)]
  return f"{lay.kind}, {lay.num_layers} layers of {leaves} at {lay.location.value!r}"


# ---------------------------------------------------------------------------------------------
# The embed/block/head triple, over the same mechanism


def value_and_grad_streamed(
  embed_fn: Callable[[Any, Any], Any],
  block_fn: Callable[[Any, Any], Any],
  head_fn: Callable[[Any, Any, Any], Any],
  *,
  save_inputs: Any = "device",
  sum_dtype: Any = jnp.float32,
  sum_location: Any = None,
  in_place: bool = False,
):
  """A micro-step over a model ``head(block_{L-1}(... block_0(embed(batch))))`` whose stack of
  blocks streams: the convenience for a model that is exactly these three pieces, over
  :func:`scan_stack` and :func:`value_and_grad`.

  ``embed_fn(embed_params, batch) -> x``, ``block_fn(layer_params, x) -> x`` (same shape and
  dtype), ``head_fn(head_params, x, batch) -> loss`` (a scalar). Returns
  ``step(embed_params, stack, head_params, batch, sums=None) -> (loss, sums)``, to call under
  ``jax.jit`` (donate ``sums``): ``stack`` is the blocks' parameters (a :class:`StreamedStack`),
  ``sums`` the running sums of the gradients ``(embed, stack, head)`` (``None`` at the first
  micro-batch of a step: the returned sums are then its gradients). The embedding and head sums
  stay on the device; the stack's is a :class:`StreamedStack` at ``sum_location``: ``None``
  (default) where ``stack`` lives, else ``"device"`` or a store location (the planner's choice
  per class: :func:`jax_ssdtrain.choose_placement`).

  ``sum_dtype``: of the sums, float32 (default) or bfloat16 (2 B per parameter instead of 4; each
  micro-batch's sum rounds to it). ``save_inputs``: where each block's input waits for the
  backward pass: ``"device"`` or a store location (``"host"``, ``"nvme"``, ``"host,nvme"``); the
  blocks are recomputed in the backward pass in every case (from those inputs).

  ``in_place``: each load of the old sum is its entries' last: the engine releases them as the
  backward pass reads them, so that the store holds one version of the sum instead of two (4 B
  per parameter less at float32). The sums a step was given are then gone (donate them), and a
  step that fails part way leaves no consistent sum. Default ``False``: the new sum is written
  beside the old one, which a failed step leaves whole.

  Each block's gradient is added to the sum in ``sum_dtype`` (the parameters' gradient converted,
  then added), so that the sum over micro-batches is that of ``jax.grad`` of the same model, up to
  XLA's reassociation; with the stack at ``location="device"`` the same program is the bit-for-bit
  reference of the store's.
  """
  if not isinstance(save_inputs, Location):
    try:
      _parse_location(save_inputs, "save_inputs")
    except ValueError:
      raise ValueError(
        f"save_inputs: expected 'device', 'host', 'nvme' or 'host,nvme', got {save_inputs!r}"
      ) from None
  options = dict(
    save_inputs=save_inputs, sum_dtype=sum_dtype, sum_location=sum_location, in_place=in_place
  )
  opts = _options(save_inputs, sum_dtype, sum_location, in_place)
  _check_bool(in_place, "in_place")

  def block(x, p, _):
    y = block_fn(p, x)
    if not (_is_array(y) and y.shape == x.shape and y.dtype == x.dtype):
      raise ValueError(
        f"block_fn must return an array shaped like its input x ({_describe(x)}), got "
        f"{_describe(y)} (ssd.scan_stack carries any pytree)"
      )
    return y, None

  def loss_fn(embed_params, stack, head_params, batch):
    x0 = embed_fn(embed_params, batch)
    if not _is_array(x0):
      raise ValueError(
        "embed_fn must return one array (the first block's input x: the blocks carry one "
        f"array, which block_fn returns shaped like it), got {_describe(x0)}; a carry that is a "
        "pytree: write the loss with ssd.scan_stack and ssd.value_and_grad"
      )
    x, _ = scan_stack(block, x0, stack)
    loss = head_fn(head_params, x, batch)
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise ValueError(
        "head_fn must return a floating scalar loss, got "
        f"{jnp.result_type(loss)}{list(jnp.shape(loss))}"
      )
    return loss

  vg = value_and_grad(loss_fn, argnums=(0, 1, 2), **options)

  def step(embed_params, stack, head_params, batch, sums=None):
    lay = _check_stack(stack, "stack")
    _check_role(lay, "params", "stack", "step(embed_params, stack, head_params, batch, sums)")
    if sums is not None:
      sum_lay = _sum_layout(lay, opts.sum_dtype, opts.sum_location or lay.location)
      sums = _check_triple_sums(sums, sum_lay, embed_params, head_params)
    return vg(embed_params, stack, head_params, batch, sums=sums)

  return step


def _check_triple_sums(sums: Any, sum_lay: Any, embed_params: Any, head_params: Any) -> tuple:
  if not (isinstance(sums, (tuple, list)) and len(sums) == 3):
    raise TypeError(
      "sums: expected the (embed, stack, head) sums a previous micro-step returned, or None, "
      f"got {type(sums).__name__}"
    )
  embed_sum, stack_sum, head_sum = sums
  lay = _check_stack(stack_sum, "sums[1]")
  if lay != sum_lay:

    def text(lay):
      leaves = [f"{d.name}{list(s)}" for s, d in zip(lay.shapes, lay.dtypes)]
      return f"{lay.num_layers} layers of {leaves} at {lay.location.value!r}"

    raise ValueError(
      f"sums[1]: a gradient sum of {text(lay)}, but this stack's (sum_dtype "
      f"{sum_lay.dtypes[0].name}) is {text(sum_lay)}"
    )
  for what, s, p in (("sums[0]", embed_sum, embed_params), ("sums[2]", head_sum, head_params)):
    if jax.tree.structure(s) != jax.tree.structure(p) or any(
      np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(p))
    ):
      raise ValueError(f"{what}: its tree or shapes differ from the parameters it sums")
  return (embed_sum, stack_sum, head_sum)
