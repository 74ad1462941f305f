"""The training micro-step: :func:`value_and_grad_streamed`.

Owns the micro-step over a model ``head(block_{L-1}(... block_0(embed(batch))))`` whose stack of
blocks streams, with an explicit per-layer backward pass (a ``custom_vjp`` cannot return new
store handles from its backward rule): forward, a ``lax.scan`` over the layers that loads layer
``i + 1``'s parameters while layer ``i`` computes (they travel in the carry: two layers on the
device) and saves each layer's input (on the device, or in the store); the head through
``jax.vjp``; backward, a reverse ``lax.scan`` that loads the parameters again (layer ``i - 1``
read ahead while layer ``i`` runs), recomputes the layer under ``jax.vjp``, adds its parameter
gradient into the running sum in the store and passes the input cotangent down. The last
layer's parameters and ``jax.vjp`` from the forward pass serve its backward (one layer's load and
compute fewer). The embedding and head parameters stay on the device with ordinary gradients
(their running sums too): they are small.

Where the sum is added: on the device, which reads the old sum back, adds the layer's gradient
and stores the new sum beside the old one. The alternative, the host's cores adding each arriving
gradient into the sum in place, crosses the link once per micro-batch instead of twice. Per
parameter and micro-batch (bfloat16 parameters, float32 sum), the device's way moves 8 B in (the
parameters twice, the old sum) and 4 B out (the new sum); the host's way 4 B in, 4 B out. The
link runs both ways at once (~45 GB/s each way on an H100), so the inbound side binds: at 400
TFLOP/s (6 FLOP per parameter and token) the device's way hides behind the compute from about
12k tokens per micro-batch (9k with a bfloat16 sum), the host's from about 6k. What the host's
way costs instead: (1) the sum is updated in place, so a micro-step that fails part way leaves
a sum that is part old, part new (a failed write must leave the last consistent state; keeping
two versions on the host costs the memory the device's way costs); (2) 16 B of host-memory
traffic per parameter (the arriving gradient written and read, the sum read and written): 480 GB
per micro-batch at 30B parameters, 1.6-2.4 s of a server's memory bandwidth, shared with the
link's copies and the disk, and a dozen cores or more doing float32 adds at that rate; (3)
arithmetic in the engine (dtype conversion, an entry that is both read and written, its
ordering against the loads of the sum), which only moves bytes; with the sum in the files both
ways read and write it on the disk. So the device adds here: consistent under failure, no
host-memory or core budget, the addition is XLA's and bit for bit the device reference's, in any
tier, and the first micro-batch of a step reads nothing back (k micro-batches read the sum k - 1
times). The host's add pays where the link binds at the micro-batch sizes that fit
(docs/layer_stream.md has the arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream.stack import (
  _after,
  _check_bool,
  _check_stack,
  _Layout,
  _load_layer,
  _make_layout,
  _parse_location,
  _stacked,
  _store_layer,
  _token,
  _token32,
  new_pass,
)
from jax_ssdtrain._src.location import TIER_CODES, Location
from jax_ssdtrain._src.primitives import load_p, opaque_copy, store_p
from jax_ssdtrain._src.remat import new_site_id


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
  blocks streams: its parameters from the store, its gradients into a running sum in the store.

  ``embed_fn(embed_params, batch) -> x``, ``block_fn(layer_params, x) -> x`` (same shape and
  dtype), ``head_fn(head_params, x, batch) -> loss`` (a scalar). Returns
  ``step(embed_params, stack, head_params, batch, sums=None) -> (loss, sums)``, to call under
  ``jax.jit`` (donate ``sums``): ``stack`` is the blocks' parameters (a :class:`StreamedStack`),
  ``sums`` the running sums of the gradients ``(embed, stack, head)`` (``None`` at the first
  micro-batch of a step: the returned sums are then its gradients). The embedding and head sums
  stay on the device; the stack's is a :class:`StreamedStack` at ``sum_location``: ``None``
  (default) where ``stack`` lives, else ``"device"`` or a store location (the planner's choice
  per class: :func:`jax_ssdtrain.choose_stack_location`).

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
  _check_bool(in_place, "in_place")
  sum_dtype = np.dtype(sum_dtype)
  if not jnp.issubdtype(sum_dtype, jnp.floating):
    raise ValueError(f"sum_dtype: expected a floating dtype, got {sum_dtype}")
  sum_loc = None if sum_location is None else _parse_location(sum_location, "sum_location")
  save_loc = Location.parse(save_inputs, what="save_inputs")
  if not (save_loc.in_store or save_loc is Location.DEVICE):
    raise ValueError(
      f"save_inputs: expected 'device', 'host', 'nvme' or 'host,nvme', got {save_inputs!r}"
    )

  input_site = new_site_id()  # the saved inputs' site (counted: one load per entry)

  def step(embed_params, stack, head_params, batch, sums=None):
    lay = _check_stack(stack, "stack", role="params")
    sum_lay = _sum_layout(lay, sum_dtype, lay.location if sum_loc is None else sum_loc)
    if sums is not None:
      embed_sum, stack_sum, head_sum = _check_sums(sums, sum_lay, embed_params, head_params)
    num_layers = lay.num_layers

    def save(x):
      if save_loc is Location.DEVICE:
        return x
      return store_p.bind(
        x, site=input_site, tier=TIER_CODES[save_loc], name="layer_stream.input", uses=None
      )[1]

    def restore(saved, like):
      if save_loc is Location.DEVICE:
        return saved
      aval = jax.core.ShapedArray(like.shape, like.dtype)
      return load_p.bind(
        saved, aval=aval, site=input_site, tier=TIER_CODES[save_loc], name="layer_stream.input"
      )

    def block(p, x):
      y = block_fn(p, x)
      if not (_is_array(y) and y.shape == x.shape and y.dtype == x.dtype):
        raise ValueError(
          f"block_fn must return an array shaped like its input x ({_describe(x)}), "
          f"got {_describe(y)}"
        )
      return y

    def add(i, g, after=None):
      """Layer ``i``'s gradient into the sum: its new entries (per leaf), and a token of the old
      sum's loads (None without sums) that the next layer's loads wait for (``after``): the
      engine predicts a stack's loads from their order, which XLA would otherwise choose."""
      g = [x.astype(sum_dtype) for x in jax.tree.leaves(g)]
      token = None
      if sums is not None:
        old = _load_layer(stack_sum, i, sum_pass, consume=in_place, after=[after])
        old = jax.tree.leaves(old)
        token = _token(old)
        g = [o.astype(sum_dtype) + x for o, x in zip(old, g)]
      return _store_layer(sum_lay, jax.tree.unflatten(sum_lay.treedef, g), store_pass), token

    x0, embed_vjp = jax.vjp(lambda ep: embed_fn(ep, batch), embed_params)
    if not _is_array(x0):
      raise ValueError(
        "embed_fn must return one array (the first block's input x: the blocks carry one "
        f"array, which block_fn returns shaped like it), got {_describe(x0)}"
      )
    # Forward: layer i computes while layer i + 1's parameters load (the carry holds both).
    # the sums' loads and stores go down the layers with the backward pass
    fwd_pass, bwd_pass, sum_pass, store_pass = new_pass(1), new_pass(-1), new_pass(-1), new_pass(-1)
    p = _load_layer(stack, 0, fwd_pass)
    saved = None
    x = x0
    if num_layers > 1:

      def fwd(carry, i):
        x, p = carry
        p_next = _load_layer(stack, _after(i, _token32(jax.tree.leaves(p))) + 1, fwd_pass)
        return (block(p, x), p_next), save(x)

      (x, p), saved = jax.lax.scan(fwd, (x, p), jnp.arange(num_layers - 1, dtype=jnp.int32))
    y, last_vjp = jax.vjp(block, p, x)  # the last layer: its vjp serves the backward pass
    loss, head_vjp = jax.vjp(lambda hp, y: head_fn(hp, y, batch), head_params, y)
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise ValueError(
        f"head_fn must return a floating scalar loss, got {jnp.result_type(loss)}{list(jnp.shape(loss))}"
      )
    g_head, ct = head_vjp(jnp.ones_like(loss))
    # Backward: layer i's gradient into the sum while layer i - 1's parameters load.
    # The backward pass's first parameter load after the forward pass (after ct): it holds one
    # layer less on the device than a load XLA would move up.
    turn_after = ct
    g, ct = last_vjp(ct)
    last, token = add(num_layers - 1, g)
    parts = [[h[None] for h in last]]
    if num_layers > 1:
      # the other layers' stores after this one (ct waits for it): the sums' entries are stored
      # in layer order, which their loads' prediction follows; XLA would move this store
      ct = opaque_copy(ct, *last, effect=False)
      p = _load_layer(stack, num_layers - 2, bwd_pass, after=[turn_after])
      if num_layers > 2:

        def bwd(carry, xs):
          ct, p, token = carry
          i, s = xs
          p_prev = _load_layer(stack, _after(i, _token32(jax.tree.leaves(p))) - 1, bwd_pass)
          x = restore(s, x0)
          _, vjp = jax.vjp(block, p, x)
          g, ct = vjp(ct)
          new, token = add(i, g, after=token)
          return (ct, p_prev, token), new

        rows = jnp.arange(1, num_layers - 1, dtype=jnp.int32)
        (ct, p, token), middle = jax.lax.scan(bwd, (ct, p, token), (rows, saved[1:]), reverse=True)
        parts.insert(0, middle)
      # the first layer's input after the others' (loads of saved inputs come newest first,
      # as the engine predicts them on the GPU; nothing else orders this one after the scan)
      first_input, ct = jax.lax.optimization_barrier((saved[0], ct))
      _, vjp = jax.vjp(block, p, restore(first_input, x0))
      g, ct = vjp(ct)
      first, _ = add(0, g, after=token)
      parts.insert(0, [h[None] for h in first])
    (g_embed,) = embed_vjp(ct)
    new_stack_sum = _stacked(sum_lay, parts)
    cast = lambda t: jax.tree.map(lambda x: x.astype(sum_dtype), t)
    g_embed, g_head = cast(g_embed), cast(g_head)
    if sums is not None:
      g_embed = jax.tree.map(jnp.add, embed_sum, g_embed)
      g_head = jax.tree.map(jnp.add, head_sum, g_head)
    return loss, (g_embed, new_stack_sum, g_head)

  return step


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (tuple, list, dict))


def _describe(tree: Any) -> str:
  """A value for messages: an array's dtype and shape (``float32[4, 16]``); any other pytree's
  type and leaves (``tuple of 2 arrays (float32[4, 16], bool[4])``)."""

  def one(x):
    if _is_array(x):
      return f"{x.dtype}{list(x.shape)}"
    return type(x).__name__

  if _is_array(tree):
    return one(tree)
  leaves = jax.tree.leaves(tree)
  if not leaves or leaves == [tree]:
    return type(tree).__name__
  shown = ", ".join(one(x) for x in leaves[:6]) + (", ..." if len(leaves) > 6 else "")
  arrays = all(_is_array(x) for x in leaves)
  noun = ("arrays" if arrays else "leaves") if len(leaves) > 1 else ("array" if arrays else "leaf")
  return f"{type(tree).__name__} of {len(leaves)} {noun} ({shown})"


def _sum_layout(lay: _Layout, sum_dtype: np.dtype, location: Location) -> _Layout:
  """The layout of a gradient sum of the stack ``lay`` (its leaves in ``sum_dtype``) at
  ``location``."""
  layer = jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(s, sum_dtype) for s in lay.shapes])
  return _make_layout(layer, lay.num_layers, location, "grad_sum", "stack")


def _check_sums(sums: Any, sum_lay: _Layout, embed_params: Any, head_params: Any):
  if not (isinstance(sums, (tuple, list)) and len(sums) == 3):
    raise TypeError(
      "sums: expected the (embed, stack, head) sums a previous micro-step returned, or None, "
      f"got {type(sums).__name__}"
    )
  embed_sum, stack_sum, head_sum = sums
  lay = _check_stack(stack_sum, "sums[1]")
  if lay != sum_lay:
    mine = f"{lay.num_layers} layers of {[f'{d.name}{list(s)}' for s, d in zip(lay.shapes, lay.dtypes)]} at {lay.location.value!r}"
    want = f"{sum_lay.num_layers} layers of {[f'{d.name}{list(s)}' for s, d in zip(sum_lay.shapes, sum_lay.dtypes)]} at {sum_lay.location.value!r}"
    raise ValueError(
      f"sums[1]: a gradient sum of {mine}, but this stack's (sum_dtype {sum_lay.dtypes[0].name}) "
      f"is {want}"
    )
  for what, s, p in (("sums[0]", embed_sum, embed_params), ("sums[2]", head_sum, head_params)):
    if jax.tree.structure(s) != jax.tree.structure(p) or any(
      np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(p))
    ):
      raise ValueError(f"{what}: its tree or shapes differ from the parameters it sums")
  return embed_sum, stack_sum, head_sum
