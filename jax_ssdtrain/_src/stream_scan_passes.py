"""The passes of :func:`~jax_ssdtrain.scan_stack`'s ``custom_vjp``: forward and backward.

This module owns the rule that ``stream_scan`` (the public functions) builds per scan: the body
closure-converted and checked (:func:`make_spec`), the forward pass (layer ``i + 1``'s parameters
load while layer ``i`` computes; each layer's carry input saved on the device or in the store),
and the backward pass (each layer recomputed from its saved input under ``jax.vjp``, its
parameters' gradient added into the running sum in the store, the new sum returned encoded as
the gradient carrier's cotangent: :func:`encode`, :func:`decode`). The stack's I/O and ordering
tokens are ``layer_stream``'s; the saved inputs are loaded and stored through ``stored_io``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import stored_io
from jax_ssdtrain._src.layer_stream import (
  HANDLE_DTYPE,
  StreamedStack,
  _after,
  _load_layer,
  _stacked,
  _store_layer,
  _token,
  _token32,
  new_pass,
)
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.remat import new_site_id
from jax_ssdtrain._src.stored_io import StoredLeaf

_INPUT = "layer_stream.input"  # the saved layer inputs' entries' name


def encode(handles: Any) -> Any:
  """uint32[L, 2] -> float32[L, 4]: each handle's 16-bit halves as exact float32 integers."""
  h = jnp.asarray(handles, HANDLE_DTYPE)
  return jnp.concatenate([h >> 16, h & 0xFFFF], axis=-1).astype(jnp.float32)


def decode(carrier: Any) -> Any:
  """float32[L, 4] -> uint32[L, 2]: :func:`encode`'s inverse."""
  u = carrier.astype(HANDLE_DTYPE)
  return (u[..., :2] << 16) | u[..., 2:]


# ---------------------------------------------------------------------------------------------
# The scan: its forward and backward passes


def strong(x: Any) -> Any:
  x = jnp.asarray(x)
  return jax.lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x


def _struct(x: Any) -> Any:
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _inexact(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


@dataclasses.dataclass(eq=False)
class _Spec:
  """What one scan_stack call is: its body closure-converted, its layouts and its masks."""

  fn: Callable  # fn(carry, layer, x, *consts) -> (carry, y)
  consts: list  # the closed-over values fn takes
  lay: Any  # the stack's layout
  carry_tree: Any
  carry_structs: list
  carry_mask: list  # per carry leaf: differentiable (floating)
  y_tree: Any
  y_mask: list
  x_mask: list
  k_mask: list


def make_spec(f, init, lay, xs) -> _Spec:
  """``f`` closure-converted (its traced closed-over values hoisted as ``consts``) and checked
  against the stack's layer and ``init``'s carry, with the masks of the floating leaves."""
  layer = lay.layer_struct()
  x_one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), xs)
  init_s = jax.tree.map(_struct, init)
  fn, consts = jax.closure_convert(f, init_s, layer, x_one)
  out = jax.eval_shape(fn, init_s, layer, x_one, *consts)
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(
      "scan_stack: f must return a pair (carry, y), as jax.lax.scan's body does, got "
      f"{type(out).__name__}"
    )
  carry_out, y = out
  c_in, c_tree = jax.tree.flatten(init_s)
  c_out, c_out_tree = jax.tree.flatten(carry_out)
  same = c_tree == c_out_tree and all(
    a.shape == b.shape and a.dtype == b.dtype for a, b in zip(c_in, c_out)
  )
  if not same:
    raise TypeError(
      "scan_stack: f must return a carry of its input carry's structure, shapes and dtypes "
      f"(as jax.lax.scan's body): got {_avals(carry_out)} for {_avals(init_s)}"
    )
  y_leaves, y_tree = jax.tree.flatten(y)
  return _Spec(
    fn,
    list(consts),
    lay,
    c_tree,
    c_in,
    [_inexact(a) for a in c_in],
    y_tree,
    [_inexact(a) for a in y_leaves],
    [_inexact(a) for a in jax.tree.leaves(x_one)],
    [_inexact(jnp.asarray(k)) for k in consts],
  )


def _avals(tree) -> str:
  return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def _pick(leaves, mask) -> list:
  return [x for x, m in zip(leaves, mask) if m]


def _fill(picked, mask, full=None) -> list:
  """Leaves from the ones ``mask`` picked and, for the others, ``full``'s (or None each)."""
  it = iter(picked)
  return [next(it) if m else (None if full is None else full[k]) for k, m in enumerate(mask)]


def _sliced(tree, index) -> Any:
  return jax.tree.map(lambda a: a[index], tree)


def scan_core(spec: _Spec, mode: str, slot: Any):
  """The custom_vjp of one scan: ``core(carrier, handles, init, xs, consts) -> (carry, ys)``.

  ``mode``: ``"grad"`` (``slot``, stream_scan's binding of the stack: its sum's layout, whether
  the carrier holds an old sum, the options; the backward rule marks it ``differentiated``),
  ``"frozen"`` (no sum: the carry's cotangent only) or ``"eval"`` (differentiating is refused)."""
  lay = spec.lay
  opts = slot.options if slot is not None else None
  save_loc = opts.save if opts is not None else Location.DEVICE
  storable = [
    save_loc.in_store
    and a.size > 0
    and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
    and a.dtype != np.bool_
    for a in spec.carry_structs
  ]
  # each storable carry input one stored piece per layer, at a site of its own (counted: one
  # load each, in the backward pass)
  inputs = [
    StoredLeaf("", tuple(a.shape), a.dtype, new_site_id()) if s else None
    for a, s in zip(spec.carry_structs, storable)
  ]

  def stack_of(handles):
    return StreamedStack(jax.tree.unflatten(lay.treedef, list(handles)), lay)

  def call(c, p, x, consts):
    return spec.fn(c, p, x, *consts)

  def save(c):
    out = []
    for x, leaf in zip(jax.tree.leaves(c), inputs):
      if leaf is not None:
        x = stored_io.store(x, leaf, save_loc, _INPUT, uses=None)
      out.append(x)
    return out

  def restore(saved):
    out = []
    for x, leaf in zip(saved, inputs):
      if leaf is not None:  # an activation's load: predicted among this execution's entries
        x = stored_io.load(x, leaf, save_loc, _INPUT, exact=False)
      out.append(x)
    return jax.tree.unflatten(spec.carry_tree, out)

  def forward(handles, init, xs, consts, saving):
    """Layer i computes while layer i + 1's parameters load (the carry holds both)."""
    stack = stack_of(handles)
    n = lay.num_layers
    fwd_pass = new_pass(1)
    p = _load_layer(stack, 0, fwd_pass)
    carry, saved, ys_head = init, None, None
    if n > 1:

      def body(state, inp):
        c, p = state
        i, x = inp
        p_next = _load_layer(stack, _after(i, _token32(jax.tree.leaves(p))) + 1, fwd_pass)
        c_new, y = call(c, p, x, consts)
        return (c_new, p_next), (save(c) if saving else None, y)

      rows = jnp.arange(n - 1, dtype=jnp.int32)
      (carry, p), (saved, ys_head) = jax.lax.scan(
        body, (carry, p), (rows, _sliced(xs, slice(0, n - 1)))
      )
    c_last = carry
    carry, y_last = call(carry, p, _sliced(xs, n - 1), consts)
    if n > 1:
      ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys_head, y_last)
    else:
      ys = jax.tree.map(lambda b: b[None], y_last)
    return (carry, ys), (saved, c_last, p)

  @jax.custom_vjp
  def core(carrier, handles, init, xs, consts):
    del carrier
    return forward(handles, init, xs, consts, saving=False)[0]

  def fwd(carrier, handles, init, xs, consts):
    if mode == "eval":
      raise TypeError(
        "scan_stack: its stack's gradient is a streamed sum that jax.grad, jax.value_and_grad "
        "and jax.vjp cannot return: differentiate the loss with ssd.value_and_grad(loss_fn) "
        "(or ssd.grad), which takes the same argnums and has_aux; scan_stack outside it "
        "evaluates the forward pass only"
      )
    out, (saved, c_last, p_last) = forward(handles, init, xs, consts, saving=True)
    res = (carrier if slot is not None and slot.old_sum else None, handles, saved, c_last, p_last)
    return out, res + (xs, consts)

  def bwd(res, cts):
    carrier, handles, saved, c_last, p_last, xs, consts = res
    if slot is not None:
      slot.differentiated = True
    return _backward(
      spec, slot, stack_of(handles), carrier, saved, c_last, p_last, xs, consts, cts, restore
    )

  core.defvjp(fwd, bwd)
  return core


def _layer_vjp(spec: _Spec, c, p, x, consts, ct_cf, ct_yf):
  """One layer's vjp over its floating inputs: ``(ct_carry, g_params, ct_x, ct_consts)`` from
  the floating outputs' cotangents (lists of leaves, as the masks pick them)."""
  c_leaves, x_leaves, k_leaves = jax.tree.leaves(c), jax.tree.leaves(x), list(consts)
  x_tree = jax.tree.structure(x)

  def f(cf, p, xf, kf):
    c_full = jax.tree.unflatten(spec.carry_tree, _fill(cf, spec.carry_mask, c_leaves))
    x_full = jax.tree.unflatten(x_tree, _fill(xf, spec.x_mask, x_leaves))
    c2, y = spec.fn(c_full, p, x_full, *_fill(kf, spec.k_mask, k_leaves))
    return _pick(jax.tree.leaves(c2), spec.carry_mask), _pick(jax.tree.leaves(y), spec.y_mask)

  _, vjp = jax.vjp(
    f,
    _pick(c_leaves, spec.carry_mask),
    p,
    _pick(x_leaves, spec.x_mask),
    _pick(k_leaves, spec.k_mask),
  )
  return vjp((ct_cf, ct_yf))


def _backward(spec, slot, stack, carrier, saved, c_last, p_last, xs, consts, cts, restore):
  """Layer i's vjp recomputed from its saved input, its gradient into the sum while layer
  i - 1's parameters load (layer L - 1's from the forward pass)."""
  lay = spec.lay
  n = lay.num_layers
  ct_carry, ct_ys = cts
  ct_cf = _pick(jax.tree.leaves(ct_carry), spec.carry_mask)
  ct_yf = _pick(jax.tree.leaves(ct_ys), spec.y_mask)
  summing = slot is not None
  bwd_pass, sum_pass, store_pass = new_pass(-1), new_pass(-1), new_pass(-1)
  if summing:
    opts, sum_lay = slot.options, slot.sum_lay
    stack_sum = None
    if slot.old_sum:
      old = carrier if sum_lay.on_device else [decode(c) for c in carrier]
      stack_sum = StreamedStack(jax.tree.unflatten(sum_lay.treedef, list(old)), sum_lay)

  def add(i, g, after=None):
    """Layer i's gradient into the sum: its new entries, and a token of the old sum's loads
    that the next layer's loads wait for (the engine predicts a stack's loads from their
    order, which XLA would otherwise choose)."""
    if not summing:
      return [], None
    g = [x.astype(opts.sum_dtype) for x in jax.tree.leaves(g)]
    token = None
    if stack_sum is not None:
      old = _load_layer(stack_sum, i, sum_pass, consume=opts.in_place, after=[after])
      old = jax.tree.leaves(old)
      token = _token(old)
      g = [o.astype(opts.sum_dtype) + x for o, x in zip(old, g)]
    return _store_layer(sum_lay, jax.tree.unflatten(sum_lay.treedef, g), store_pass), token

  # the backward pass's first parameter load after the incoming cotangents: it holds one
  # layer less on the device than a load XLA would move up
  turn_after = ct_cf + ct_yf
  ct_cf, g, ct_xf, ct_kf = _layer_vjp(
    spec, c_last, p_last, _sliced(xs, n - 1), consts, ct_cf, [y[n - 1] for y in ct_yf]
  )
  last, token = add(n - 1, g)
  parts = [[h[None] for h in last]]
  x_parts = [[t[None] for t in ct_xf]]
  if n > 1:
    # the other layers' stores after this one (what they compute waits for it): the sums'
    # entries are stored in layer order, which their loads' prediction follows
    if last:
      if ct_cf:
        ct_cf = [stored_io.ordered_after(t, *last) for t in ct_cf]
      else:
        ct_yf = [stored_io.ordered_after(t, *last) for t in ct_yf]
    p = _load_layer(stack, n - 2, bwd_pass, after=turn_after)
    if n > 2:

      def body(carry, inp):
        ct_cf, ct_k, p, token = carry
        i, s, x, ct_y = inp
        p_prev = _load_layer(stack, _after(i, _token32(jax.tree.leaves(p))) - 1, bwd_pass)
        ct_cf, g, ct_x, ct_k_i = _layer_vjp(spec, restore(s), p, x, consts, ct_cf, ct_y)
        new, token = add(i, g, after=token)
        ct_k = [a + b for a, b in zip(ct_k, ct_k_i)]
        return (ct_cf, ct_k, p_prev, token), (new, ct_x)

      rows = jnp.arange(1, n - 1, dtype=jnp.int32)
      inputs = (
        rows,
        [s[1:] for s in saved],
        _sliced(xs, slice(1, n - 1)),
        [y[1 : n - 1] for y in ct_yf],
      )
      (ct_cf, ct_kf, p, token), (middle, x_mid) = jax.lax.scan(
        body, (ct_cf, ct_kf, p, token), inputs, reverse=True
      )
      parts.insert(0, middle)
      x_parts.insert(0, x_mid)
    # the first layer's input after the others' (loads of saved inputs come newest first, as
    # the engine predicts them on the GPU; nothing else orders this one after the scan)
    first_input, ct_cf, p = jax.lax.optimization_barrier(([s[0] for s in saved], ct_cf, p))
    ct_cf, g, ct_x0, ct_k0 = _layer_vjp(
      spec, restore(first_input), p, _sliced(xs, 0), consts, ct_cf, [y[0] for y in ct_yf]
    )
    first, _ = add(0, g, after=token)
    ct_kf = [a + b for a, b in zip(ct_kf, ct_k0)]
    parts.insert(0, [h[None] for h in first])
    x_parts.insert(0, [t[None] for t in ct_x0])
  ct_init = jax.tree.unflatten(spec.carry_tree, _fill(ct_cf, spec.carry_mask))
  x_leaves = [p[0] if len(p) == 1 else jnp.concatenate(p) for p in zip(*x_parts)]
  ct_xs = jax.tree.unflatten(jax.tree.structure(xs), _fill(x_leaves, spec.x_mask))
  ct_consts = tuple(_fill(ct_kf, spec.k_mask))
  ct_carrier = None
  if summing:
    new_sum = jax.tree.leaves(_stacked(sum_lay, parts).handles)
    ct_carrier = new_sum if sum_lay.on_device else [encode(h) for h in new_sum]
  return ct_carrier, None, ct_init, ct_xs, ct_consts
