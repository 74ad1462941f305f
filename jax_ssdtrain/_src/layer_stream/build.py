"""Making and reading stacks: :func:`init_streamed`, :func:`stack_from_tree`,
:func:`stack_to_tree` and :func:`map_stack`.

Owns the programs that make a stack layer by layer (a ``lax.scan`` whose iteration makes and
stores one layer: the device holds one layer at a time), read one back whole onto the device
(tests, small models, a gradient sum read back), and run a function layer by layer over stacks
with its results stored as a new stack (the update path of a hand-written optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src.layer_stream.stack import (
  StreamedStack,
  _after,
  _check_bool,
  _check_num_layers,
  _check_stack,
  _load_layer,
  _make_layout,
  _parse_location,
  _scan_layers,
  _token32,
  new_pass,
)


def init_streamed(
  init_layer_fn: Callable[[Any], Any], key: Any, num_layers: int, *, location: Any = "host"
) -> StreamedStack:
  """Initialises a stack of ``num_layers`` layers straight into the store, layer by layer.

  ``init_layer_fn(key) -> layer`` makes one layer's parameters (a pytree of arrays); layer ``i``
  gets ``jax.random.split(key, num_layers)[i]``, so the stack equals
  ``jax.vmap(init_layer_fn)(jax.random.split(key, num_layers))`` without ever being whole on the
  device. ``location``: ``"host"``, ``"nvme"``, ``"host,nvme"`` or ``"device"`` (the reference:
  the stacked tree on the device). Pure: ``jax.eval_shape`` of it gives the stack's structure.
  """
  loc = _parse_location(location)
  num_layers = _check_num_layers(num_layers)
  keys = jax.random.split(key, num_layers)
  layer = jax.eval_shape(init_layer_fn, keys[0])
  lay = _make_layout(layer, num_layers, loc, "params", "init_layer_fn's result")
  return _init_jit(init_layer_fn, lay, keys)


@jax.jit(static_argnums=(0, 1))
def _init_jit(init_layer_fn, lay, keys):
  return _scan_layers(lay, lambda i: init_layer_fn(keys[i]))


def stack_from_tree(tree: Any, *, location: Any = "host", kind: str = "params") -> StreamedStack:
  """Stores a stacked tree (leaves ``[L, ...]``, on the device) layer by layer: for stacks that
  fit on the device (tests, a checkpoint restored whole). :func:`init_streamed` makes one that
  does not fit."""
  loc = _parse_location(location)
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError("tree: no arrays")
  lengths = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(lengths) != 1 or None in lengths:
    raise ValueError(
      f"tree: every leaf needs the same leading layer axis, got leading sizes "
      f"{sorted(str(n) for n in lengths)}"
    )
  (num_layers,) = lengths
  num_layers = _check_num_layers(num_layers)
  layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.asarray(x).dtype), tree)
  lay = _make_layout(layer, num_layers, loc, kind, "tree")
  return _from_tree_jit(lay, tree)


@jax.jit(static_argnums=0)
def _from_tree_jit(lay, tree):
  return _scan_layers(
    lay, lambda i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), tree)
  )


def stack_to_tree(stack: StreamedStack) -> Any:
  """The whole stack as a stacked tree (leaves ``[L, ...]``) on the device: for tests, small
  models and reading a gradient sum back. Loads layer by layer."""
  lay = _check_stack(stack, "stack")
  if lay.on_device:
    return stack.handles
  return _to_tree_jit(stack)


@jax.jit
def _to_tree_jit(stack):
  lay = stack.layout

  def body(token, i):
    # The loads read their handles (stream_pass None): streamed, this program's loads ran one
    # layer behind the engine's prediction on a GPU (the training programs' do not); it serves
    # tests and small models, where a read handle costs little.
    leaves = jax.tree.leaves(_load_layer(stack, _after(i, token), None))
    return _token32(leaves), leaves

  rows = jnp.arange(lay.num_layers, dtype=jnp.int32)
  _, leaves = jax.lax.scan(body, jnp.zeros((1,), jnp.float32), rows)
  return jax.tree.unflatten(lay.treedef, leaves)


def map_stack(
  fn: Callable[..., Any], *stacks: StreamedStack, kind: str | None = None, in_place: bool = False
):
  """``fn`` layer by layer over stacks of equal depth; its results stored as a new stack where
  the first lives. ``fn(*layers) -> layer``: one layer of each stack in, one layer's tree out. The
  update path: ``params = map_stack(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)``
  reads each layer's bfloat16 parameters and float32 gradient sum and writes the new bfloat16
  copy straight back to the store (the device holds one layer). A result shaped like the first
  stack keeps its kind and sites (``kind`` names another). Call it under ``jax.jit`` or not.

  ``in_place``: each layer's loads are its entries' last: the engine releases the input stacks'
  entries as the layers are read, so that the store holds one version of the parameters instead
  of two. The input stacks are then gone (using them again raises), and an update that fails
  part way leaves no consistent state: resume from a checkpoint. Default ``False``: the new stack
  is written beside the inputs, which stay whole until no live array holds their handles."""
  if not stacks:
    raise TypeError("map_stack: expected at least one StreamedStack")
  _check_bool(in_place, "in_place")
  lays = [_check_stack(s, f"stacks[{k}]") for k, s in enumerate(stacks)]
  first = lays[0]
  for k, lay in enumerate(lays[1:], 1):
    if lay.num_layers != first.num_layers:
      raise ValueError(
        f"map_stack: stacks[{k}] has {lay.num_layers} layers, stacks[0] {first.num_layers}: "
        "they must agree"
      )
  layer = jax.eval_shape(fn, *[lay.layer_struct() for lay in lays])
  out_kind = kind or first.kind
  lay = _make_layout(layer, first.num_layers, first.location, out_kind, "map_stack's fn result")
  if kind is None and (lay.treedef, lay.shapes, lay.dtypes) != (
    first.treedef,
    first.shapes,
    first.dtypes,
  ):
    lay = _make_layout(layer, first.num_layers, first.location, "mapped", "fn's result")

  return _map_jit(fn, lay, in_place, list(stacks))


@jax.jit(static_argnums=(0, 1, 2))
def _map_jit(fn, lay, in_place, stacks):
  # a pass per stack: the engine follows a pass's loads per site, and stacks of one kind and
  # structure (two parameter stacks) share their sites
  passes = [new_pass(1) for _ in stacks]
  return _scan_layers(
    lay, lambda i: fn(*[_load_layer(s, i, p, consume=in_place) for s, p in zip(stacks, passes)])
  )
