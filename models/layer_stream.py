"""The repository's GPT trained through jax_ssdtrain's layer stream (issue 35).

Owns two things that ``scripts/train.py --stream-layers`` and ``scripts/bench_layer_stream.py``
share:

* :func:`gpt_pieces`: the GPT of ``models`` (its ``Block``, ``Embedding`` and an untied
  ``LMHead`` with the final norm and the loss) cut into the functions the layer stream takes: one
  layer's ``init_layer`` (bfloat16) and ``block``, and the ``embed`` and ``head`` whose
  parameters (float32) stay on the device.
* :func:`llama_pieces`: the Llama of ``models.llama`` cut the same way (its head with the
  final norm and the loss in ``loss_chunks`` sequence chunks).
* :class:`StreamedTraining`: one optimizer step of ``micro_batches`` micro-steps of
  ``jax_ssdtrain.value_and_grad_streamed`` (the stack's bfloat16 parameters loaded layer by
  layer, its gradients added into a running sum in the store), then
  ``apply_streamed_update`` (the float32 master copy and the optimizer's state in the store)
  and ``apply_device_update`` for the embedding and the head. With ``location="device"`` the
  same programs keep every stack on the device: the reference the store's steps equal bit for
  bit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_ssdtrain as ssd
from models.common import Block, Embedding, LMHead, Norm, cross_entropy, get_config


@dataclasses.dataclass(frozen=True)
class GPTPieces:
  """A GPT cut for the layer stream (see :func:`gpt_pieces`)."""

  cfg: Any  # the models.ModelConfig (untied embeddings)
  init_layer: Callable[[Any], Any]  # key -> one layer's parameters (bfloat16)
  block: Callable[[Any, Any], Any]  # (layer params, x) -> x
  init_side: Callable[[Any, Any], Any]  # (key, batch) -> (embedding params, head params)
  embed: Callable[[Any, Any], Any]  # (embedding params, batch) -> x
  head: Callable[[Any, Any, Any], Any]  # (head params, x, batch) -> the mean loss


def gpt_pieces(preset: str, num_layers: int | None = None, **overrides: Any) -> GPTPieces:
  """The GPT of ``preset`` (``num_layers``: the stack's depth, default the preset's) cut for the
  layer stream. The head is untied from the embedding (their parameters are separate trees).
  A batch is int32 tokens ``[batch, seq + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
  if num_layers is not None:
    overrides["num_layers"] = num_layers
  cfg = get_config("gpt", preset, tie_embeddings=False, **overrides)

  class Head(nn.Module):  # the final norm, the untied head and the loss
    cfg: Any

    @nn.compact
    def __call__(self, x, targets):
      logits = LMHead(self.cfg, name="head")(Norm(self.cfg, "ln_final")(x), None)
      return cross_entropy(logits, targets)[0]

  block_mod, embed_mod, head_mod = Block(cfg, causal=True), Embedding(cfg), Head(cfg)

  def init_layer(key):  # bfloat16 (the float32 master copy starts from these values)
    x = jnp.zeros((1, 8, cfg.hidden), cfg.compute_dtype)
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), block_mod.init(key, x)["params"])

  def block(p, x):
    return block_mod.apply({"params": p}, x)[0]

  def embed(ep, batch):
    return embed_mod.apply({"params": ep}, batch[:, :-1])

  def head(hp, x, batch):
    return head_mod.apply({"params": hp}, x, batch[:, 1:])

  def init_side(key, batch):
    k1, k2 = jax.random.split(key)
    ep = embed_mod.init(k1, batch[:, :-1])["params"]
    x = jnp.zeros(batch[:, :-1].shape + (cfg.hidden,), cfg.compute_dtype)
    return ep, head_mod.init(k2, x, batch[:, 1:])["params"]

  return GPTPieces(cfg, init_layer, block, init_side, embed, head)


def llama_pieces(preset: str, num_layers: int | None = None, **overrides: Any) -> GPTPieces:
  """The Llama of ``preset`` cut for the layer stream as :func:`gpt_pieces` cuts the GPT: its
  ``LlamaBlock``, ``LlamaEmbedding``, and a head of the final norm and ``LlamaHead``'s loss (in
  ``loss_chunks`` chunks); the same batches ``[batch, seq + 1]``."""
  from models.llama import LlamaBlock, LlamaEmbedding, LlamaHead, RMSNorm

  if num_layers is not None:
    overrides["num_layers"] = num_layers
  cfg = get_config("llama", preset, **overrides)

  class Head(nn.Module):  # the final norm, the head and the loss
    cfg: Any

    @nn.compact
    def __call__(self, x, targets):
      return LlamaHead(self.cfg, name="head")(RMSNorm(self.cfg, "ln_final")(x), targets)[0]

  return _pieces(cfg, LlamaBlock(cfg), LlamaEmbedding(cfg), Head(cfg))


def _pieces(cfg, block_mod, embed_mod, head_mod) -> GPTPieces:
  """The layer stream's functions of a block, an embedding and a head module."""

  def init_layer(key):  # bfloat16 (the float32 master copy starts from these values)
    x = jnp.zeros((1, 8, cfg.hidden), cfg.compute_dtype)
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), block_mod.init(key, x)["params"])

  def block(p, x):
    return block_mod.apply({"params": p}, x)[0]

  def embed(ep, batch):
    return embed_mod.apply({"params": ep}, batch[:, :-1])

  def head(hp, x, batch):
    return head_mod.apply({"params": hp}, x, batch[:, 1:])

  def init_side(key, batch):
    k1, k2 = jax.random.split(key)
    ep = embed_mod.init(k1, batch[:, :-1])["params"]
    x = jnp.zeros(batch[:, :-1].shape + (cfg.hidden,), cfg.compute_dtype)
    return ep, head_mod.init(k2, x, batch[:, 1:])["params"]

  return GPTPieces(cfg, init_layer, block, init_side, embed, head)


# The store options the layer stream sizes from its layers (ssd.read_ahead_sizes), and the
# variables that set them instead
READ_AHEAD_OPTIONS = {"prefetch_bytes": "SSDTRAIN_PREFETCH", "staging_bytes": "SSDTRAIN_STAGING"}


def sized_read_ahead_options() -> list[str]:
  """The read-ahead options the layer stream sizes: those the environment does not set."""
  return [option for option, env in READ_AHEAD_OPTIONS.items() if env not in os.environ]


@dataclasses.dataclass(frozen=True)
class StreamedTraining:
  """One optimizer step of a streamed GPT (see the module doc). ``location``: where the stack's
  parameters live (``"host"``, ``"nvme"``, ``"host,nvme"``, or ``"device"``: the reference), and
  by default their gradients' running sum, the master copy and the optimizer's state too;
  ``sum_location``, ``state_location``: those classes' own (``ssd.choose_stack_location``'s
  placement); ``sum_dtype``: the running sum's; ``in_place``: one version of the sum, state and
  master copy in the store; ``save_inputs``: where each layer's input waits for the backward
  pass; ``clip``: global-norm clipping of the mean gradient (None: none); ``collect``:
  ``ssd.collect()`` after each micro-step and update (old versions leave the store at once, as
  ``check_streamed_room``'s arithmetic assumes)."""

  pieces: GPTPieces
  tx: Any  # an optax transformation (the stack's and the side's)
  num_layers: int
  location: str = "host"
  micro_batches: int = 1
  sum_location: str | None = None  # None: location
  state_location: str | None = None  # None: location
  sum_dtype: str = "float32"
  in_place: bool = False
  save_inputs: str = "device"
  clip: float | None = None
  collect: bool = True

  def _init_stack(self, key):
    return ssd.init_streamed(self.pieces.init_layer, key, self.num_layers, location=self.location)

  def stack_shape(self, key):
    """The stack's structure where it lives (``jax.eval_shape`` of its init: nothing made)."""
    return jax.eval_shape(self._init_stack, key)

  def check_room(self, key, name: str) -> dict:
    """``ssd.check_streamed_room`` of the run (nothing stored yet): raises
    ``StreamedRoomError`` with the arithmetic where the model does not fit the store."""
    shape = self.stack_shape(key)
    return ssd.check_streamed_room(
      shape,
      self.tx,
      sum_dtype=jnp.dtype(self.sum_dtype),
      in_place=self.in_place,
      sum_location=self.sum_location,
      state_location=self.state_location,
      name=name,
    )

  def read_ahead(self, key) -> dict:
    """``ssd.read_ahead_sizes`` of the run: the store's read-ahead budget and staging arena
    that read its passes whole layers ahead (nothing made)."""
    return ssd.read_ahead_sizes(
      self.stack_shape(key),
      self.tx,
      sum_dtype=jnp.dtype(self.sum_dtype),
      in_place=self.in_place,
      sum_location=self.sum_location,
      state_location=self.state_location,
    )

  def configure_read_ahead(self, key) -> dict:
    """Configures the store with :meth:`read_ahead`'s sizes where the environment does not set
    them (``SSDTRAIN_PREFETCH``, ``SSDTRAIN_STAGING``); call it before anything is stored
    (reconfiguring drops the store's entries). Returns the sizes it set."""
    sized = sized_read_ahead_options()
    sizes = {option: v for option, v in self.read_ahead(key).items() if v and option in sized}
    if sizes:
      ssd.configure(**sizes)
    return sizes

  def placed(self, locations: dict) -> StreamedTraining:
    """This run with each class where ``locations`` says (``ssd.StackPlacement.locations``:
    ``params``, ``grad_sum``, ``optimizer_state`` and, where given, ``activations``: the saved
    layer inputs)."""
    return dataclasses.replace(
      self,
      location=locations["params"],
      sum_location=locations["grad_sum"],
      state_location=locations["optimizer_state"],
      save_inputs=locations.get("activations", self.save_inputs),
    )

  def activation_bytes(self, side_key, batch) -> int:
    """The bytes of the layer inputs one micro-step saves for the backward pass (``save_inputs``):
    the embedding's output for every layer but the last (nothing made)."""
    side = jax.eval_shape(self.pieces.init_side, side_key, batch)
    x = jax.eval_shape(self.pieces.embed, side[0], batch)
    return (self.num_layers - 1) * x.size * x.dtype.itemsize

  def device_bytes(self, key, side_key, batch) -> int:
    """The device memory of this run (its classes where it places them: ``placed({...all
    "device"})`` for everything on the device), from XLA's memory analysis of its compiled
    programs (nothing run or stored): the state and the sums resident beside a micro-step's
    temporaries, or the update's whole program, whichever is larger."""
    state = jax.eval_shape(self.init, key, side_key, batch)
    stack, opt, side, side_state = state
    sums = jax.eval_shape(self._micro, side[0], stack, side[1], batch, None)[1]
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state, sums)))
    micro = self._micro.lower(side[0], stack, side[1], batch, sums).compile().memory_analysis()
    update = self._update.lower(stack, sums, opt, side, side_state).compile().memory_analysis()
    micro_need = nbytes + micro.temp_size_in_bytes
    update_need = (
      update.argument_size_in_bytes
      + update.output_size_in_bytes
      + update.temp_size_in_bytes
      - update.alias_size_in_bytes
    )
    return int(max(micro_need, update_need))

  def init(self, key, side_key, batch) -> tuple:
    """The training state ``(stack, opt, side, side_state)``: the stack initialised layer by
    layer straight where it lives, its optimizer state (the float32 master copy and the
    moments), the embedding's and head's parameters and their optimizer state."""
    stack = self._init_stack(key)
    opt = ssd.init_streamed_optimizer(self.tx, stack, location=self.state_location)
    side = jax.jit(self.pieces.init_side)(side_key, batch)
    return stack, opt, side, self.tx.init(side)

  @functools.cached_property
  def _micro(self):  # one program for every step (a frozen dataclass: cached in its __dict__)
    p = self.pieces
    fn = ssd.value_and_grad_streamed(
      p.embed,
      p.block,
      p.head,
      save_inputs=self.save_inputs,
      sum_dtype=jnp.dtype(self.sum_dtype),
      sum_location=self.sum_location,
      in_place=self.in_place,
    )
    return jax.jit(fn, donate_argnums=4)

  @functools.cached_property
  def _update(self):
    tx, k, clip, in_place = self.tx, self.micro_batches, self.clip, self.in_place

    def update(stack, sums, opt, side, side_state):
      scale = 1.0 / k
      # a pass of loads over the whole sum: only where clipping needs it
      norm = ssd.streamed_global_norm(sums[1], (sums[0], sums[2]), scale=scale) if clip else None
      stack, opt = ssd.apply_streamed_update(
        tx,
        stack,
        sums[1],
        opt,
        scale=scale,
        clip_global_norm=clip,
        global_norm=norm,
        in_place=in_place,
      )
      side, side_state = ssd.apply_device_update(
        tx,
        side,
        (sums[0], sums[2]),
        side_state,
        scale=scale,
        clip_global_norm=clip,
        global_norm=norm,
      )
      return (stack, opt, side, side_state), norm

    # the sums not donated: nothing the update returns has their shapes (XLA would warn)
    return jax.jit(update, donate_argnums=(0, 2, 3, 4))

  def step(self, state: tuple, batches: Sequence[Any]) -> tuple[dict, tuple]:
    """One optimizer step over ``batches`` (``micro_batches`` of them): ``(metrics, new
    state)``, metrics ``loss`` (the last micro-batch's) and, with ``clip``, ``grad_norm`` (of
    the mean gradient, before clipping). The old state is donated."""
    if len(batches) != self.micro_batches:
      raise ValueError(f"batches: {len(batches)} given, micro_batches={self.micro_batches}")
    stack, opt, side, side_state = state
    del state
    sums = None
    for batch in batches:
      loss, sums = self._micro(side[0], stack, side[1], batch, sums)
      if self.collect:  # the old sum's entries go now, not at the daemon's next sweep
        ssd.collect()
    state, norm = self._update(stack, sums, opt, side, side_state)
    del stack, opt, sums
    if self.collect:  # the old parameters, state and sum
      ssd.collect()
    return {"loss": loss} | ({"grad_norm": norm} if self.clip else {}), state
