"""The planner at long context: the byte arithmetic of a Llama-style stack at sequence length S
(``long_context_bytes``), the refusal of a sequence that cannot fit before its first step
(``check_long_context``, ``LongContextError``), and the choice of the chunk counts of the MLP
and the loss together with each tag's location and the split (``plan_long_context``: the
search of ``plan_for_budget`` once per chunk count, the fastest plan that fits the budget).

The model's shape is read from a config object with the attributes of ``models.ModelConfig``
(``num_layers``, ``hidden``, ``num_heads``, ``kv_heads`` (or ``num_kv_heads``), ``head_dim``
(else ``hidden // num_heads``), ``mlp_dim``, ``vocab_size``, ``dtype``, ``param_dtype``): the
library does not import the example models. The byte counts below are those of
``models/llama.py``'s tensors (its tags ``layer_in``, ``qkv``, ``attn``, ``mlp_up``; its
``parameter_count``), restated here so that the planner stays free of the models package.

The device floor of a configuration (what a step holds whatever XLA does; XLA's memory analysis
of the compiled step is the exact figure, this is a lower bound used to refuse and to skip
compiles):

    resident  = tags on the device (all layers' layer_in unless offloaded; the kept layers')
              + the parameters and their gradients (+ the optimizer state where on the device)
              + the staging arena
    working   = max(q, k, v and the attention output of one layer,
                    one MLP chunk's hidden activation, one loss chunk's float32 logits)
    floor     = resident + working

and the store must hold the offloaded tags of the offloading layers in the host tier and the
files.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.planner.checks import _check_int
from jax_ssdtrain._src.planner.search import plan_for_budget
from jax_ssdtrain._src.planner.types import OFFLOADED, PLANNED, Plan, Profile

# AdamW under with_master_weights on the device: the float32 master copy and two float32
# moments, per parameter.
OPTIMIZER_BYTES_PER_PARAM = 12
# plan_long_context's default chunk sizes, in positions per chunk: (MLP, loss) pairs.
DEFAULT_CHUNK_TOKENS = ((None, None), (16384, 8192), (8192, 4096), (4096, 2048))


class LongContextError(ValueError):
  """A sequence that cannot fit the device (or the store), refused before its first step; the
  message has the arithmetic and what to change. ``arithmetic`` is the
  :class:`LongContextBytes` it was refused with."""

  def __init__(self, message: str, arithmetic: LongContextBytes):
    super().__init__(message)
    self.arithmetic = arithmetic


@dataclasses.dataclass(frozen=True)
class LongContextBytes:
  """The bytes of one configuration of a Llama-style stack at ``seq_len`` (all per step)."""

  seq_len: int
  batch: int
  num_layers: int
  mlp_chunks: int
  loss_chunks: int
  tag_bytes: tuple[tuple[str, int], ...]  # per layer, whole (every chunk's mlp_up)
  locations: tuple[tuple[str, str], ...]  # each tag's location in the offloading layers
  offload_layers: int
  attention_bytes: int  # one layer's q, k, v and attention output
  mlp_chunk_bytes: int  # one MLP chunk's hidden activation (gate and up)
  loss_chunk_bytes: int  # one loss chunk's float32 logits
  parameters: int
  param_bytes: int  # on the device: the parameters and their gradients (0: in the store)
  optimizer_bytes: int  # on the device (0: in the store)
  staging_bytes: int
  resident_tag_bytes: int  # tags on the device, all layers
  store_bytes: tuple[tuple[str, int], ...]  # offloaded tags per step, by location

  @property
  def working_bytes(self) -> int:
    return max(self.attention_bytes, self.mlp_chunk_bytes, self.loss_chunk_bytes)

  @property
  def resident_bytes(self) -> int:
    return self.resident_tag_bytes + self.param_bytes + self.optimizer_bytes + self.staging_bytes

  @property
  def floor_bytes(self) -> int:
    """The least device memory of the step: :attr:`resident_bytes` + :attr:`working_bytes`."""
    return self.resident_bytes + self.working_bytes

  def lines(self) -> list[str]:
    """The arithmetic, one class of bytes a line."""
    S, B, L = self.seq_len, self.batch, self.num_layers
    tags = dict(self.tag_bytes)
    where = dict(self.locations)
    k = self.offload_layers
    out = [f"S={S:,} positions, batch {B}, {L} layers"]
    for name, b in self.tag_bytes:
      loc = where.get(name, "remat")
      held = {"device": L, "remat": L if name == "layer_in" else 0}.get(loc, L - k)
      out.append(
        f"  {name}: {b:,} bytes a layer ({_gb(b)}), {loc}"
        + (f" in {k} layers" if loc in ("host", "nvme", "host,nvme") else "")
        + f": {held} x {_gb(b)} = {_gb(held * b)} on the device"
      )
    out.append(
      f"  parameters: {self.parameters:,}; on the device with their gradients "
      f"{_gb(self.param_bytes)}, optimizer state {_gb(self.optimizer_bytes)}"
    )
    if self.staging_bytes:
      out.append(f"  staging arena: {_gb(self.staging_bytes)}")
    out.append(
      f"  working set, the largest of: q, k, v and the attention output "
      f"{_gb(self.attention_bytes)}; one of {self.mlp_chunks} MLP chunks "
      f"{_gb(self.mlp_chunk_bytes)} (whole: {_gb(tags.get('mlp_up', 0))}); one of "
      f"{self.loss_chunks} loss chunks' float32 logits {_gb(self.loss_chunk_bytes)}"
    )
    out.append(
      f"  device floor: {_gb(self.resident_bytes)} resident + {_gb(self.working_bytes)} "
      f"working = {_gb(self.floor_bytes)}"
    )
    stored = [f"{loc} {_gb(b)}" for loc, b in self.store_bytes if b]
    if stored:
      out.append(f"  in the store per step: {', '.join(stored)}")
    return out

  def __str__(self) -> str:
    return "\n".join(self.lines())


def long_context_bytes(
  cfg: Any,
  seq_len: int,
  batch: int = 1,
  *,
  mlp_chunks: int | None = None,
  loss_chunks: int | None = None,
  locations: Mapping[str, str | Location] | None = None,
  offload_layers: int | None = None,
  params_on_device: bool = True,
  optimizer_on_device: bool = False,
  param_dtype: Any = None,
  staging_bytes: int = 0,
) -> LongContextBytes:
  """The arithmetic of the module docstring for ``cfg`` at ``seq_len`` positions and ``batch``.

  mlp_chunks, loss_chunks: default ``cfg``'s. locations: each tag's location in the offloading
  layers (default: ``layer_in`` on the device, the rest recomputed); offload_layers: how many
  layers offload (default all). params_on_device: the parameters and their gradients on the
  device, in ``param_dtype`` (default ``cfg.param_dtype``); optimizer_on_device: AdamW's
  moments and float32 master copy there too (12 bytes a parameter).
  """
  _check_int("seq_len", seq_len, low=1)
  _check_int("batch", batch, low=1)
  L = cfg.num_layers
  mlp_chunks = cfg.mlp_chunks if mlp_chunks is None else mlp_chunks
  loss_chunks = cfg.loss_chunks if loss_chunks is None else loss_chunks
  _check_int("mlp_chunks", mlp_chunks, low=1)
  _check_int("loss_chunks", loss_chunks, low=1)
  k = L if offload_layers is None else offload_layers
  _check_int("offload_layers", k)
  if k > L:
    raise ValueError(f"offload_layers: {k} > the config's num_layers {L}")
  H, N, K, D, F, V = _shape(cfg)
  a = np.dtype(cfg.dtype).itemsize  # the activations' (compute) dtype
  S, B = seq_len, batch
  tags = {
    "layer_in": a * B * S * H,
    "qkv": a * B * S * (N + 2 * K) * D,
    "attn": a * B * S * N * D,
    "mlp_up": a * B * S * 2 * F,
  }
  where = {n: "remat" for n in tags} | {"layer_in": "device"}
  for name, loc in (locations or {}).items():
    if name not in tags:
      raise ValueError(f"locations: unknown tag {name!r}; the tags are {list(tags)}")
    where[name] = Location.parse(loc, what=f"locations[{name!r}]").value
  resident = 0
  stored = dict.fromkeys(("host", "nvme", "host,nvme"), 0)
  for name, b in tags.items():
    loc = where[name]
    if loc == "device" or (loc == "remat" and name == "layer_in"):
      resident += L * b  # recomputation starts from the saved layer input
    elif loc in stored:
      resident += (L - k) * b
      stored[loc] += k * b
  parameters = _parameter_count(H, N, K, D, F, V, L)
  p = np.dtype(cfg.param_dtype if param_dtype is None else param_dtype).itemsize
  return LongContextBytes(
    seq_len=S,
    batch=B,
    num_layers=L,
    mlp_chunks=mlp_chunks,
    loss_chunks=loss_chunks,
    tag_bytes=tuple(tags.items()),
    locations=tuple(where.items()),
    offload_layers=k,
    attention_bytes=tags["qkv"] + tags["attn"],
    mlp_chunk_bytes=a * B * -(-S // mlp_chunks) * 2 * F,
    loss_chunk_bytes=4 * B * -(-S // loss_chunks) * V,
    parameters=parameters,
    param_bytes=2 * p * parameters if params_on_device else 0,
    optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * parameters if optimizer_on_device else 0,
    staging_bytes=int(staging_bytes),
    resident_tag_bytes=resident,
    store_bytes=tuple(stored.items()),
  )


def check_long_context(
  cfg: Any,
  seq_len: int,
  batch: int = 1,
  *,
  budget_bytes: int,
  host_tier_bytes: int = 0,
  disk_free_bytes: int = 0,
  **options,
) -> LongContextBytes:
  """Refuses a configuration that cannot fit, before anything compiles: raises
  :class:`LongContextError` listing the arithmetic (:func:`long_context_bytes` with
  ``options``), which classes of bytes do not fit and what to change (more MLP or loss chunks,
  the layer inputs to the host tier or the files, the optimizer state to the store, a shorter
  sequence). Returns the arithmetic when its device floor fits ``budget_bytes`` and the stored
  tags fit ``host_tier_bytes`` (host) and ``disk_free_bytes`` (nvme; host,nvme: both)."""
  _check_int("budget_bytes", budget_bytes, low=1)
  _check_int("host_tier_bytes", host_tier_bytes)
  _check_int("disk_free_bytes", disk_free_bytes)
  ar = long_context_bytes(cfg, seq_len, batch, **options)
  fixes, why = [], []
  where, tags = dict(ar.locations), dict(ar.tag_bytes)
  room = budget_bytes - ar.resident_bytes
  if room < 0 or ar.floor_bytes > budget_bytes:
    why.append(f"the device floor {_gb(ar.floor_bytes)} exceeds the budget {_gb(budget_bytes)}")
  if room < ar.working_bytes:
    if where["layer_in"] in ("device", "remat") and ar.num_layers * tags["layer_in"] > max(room, 0):
      fixes.append(
        f"offload the layer inputs ({ar.num_layers} x {_gb(tags['layer_in'])} = "
        f"{_gb(ar.num_layers * tags['layer_in'])}) to the host tier or the files "
        "(layer_in: host, nvme or host,nvme)"
      )
    if ar.optimizer_bytes:
      fixes.append(f"the optimizer state ({_gb(ar.optimizer_bytes)}) to the store")
    # the room once the layer inputs (and the optimizer state) leave the device
    freed = budget_bytes - (
      ar.resident_bytes
      - (ar.num_layers * tags["layer_in"] if where["layer_in"] in ("device", "remat") else 0)
      - ar.optimizer_bytes
    )
    if ar.mlp_chunk_bytes > max(freed, 0):
      need = _chunks_for(tags["mlp_up"], freed, seq_len)
      fixes.append(f"more MLP chunks (mlp_chunks >= {need})" if need else "")
    if ar.loss_chunk_bytes > max(freed, 0):
      need = _chunks_for(4 * batch * seq_len * _shape(cfg)[5], freed, seq_len)
      fixes.append(f"more loss chunks (loss_chunks >= {need})" if need else "")
    if ar.attention_bytes > max(freed, 0):
      fixes.append(
        f"the attention's q, k, v and output ({_gb(ar.attention_bytes)}) grow with S and no "
        "chunk count shrinks them"
      )
    # every class grows linearly in S but the parameters: the longest S these choices hold
    fixed = ar.param_bytes + ar.optimizer_bytes + ar.staging_bytes
    per_position = (ar.floor_bytes - fixed) / seq_len
    longest = int((budget_bytes - fixed) / per_position) if budget_bytes > fixed else 0
    fixes.append(f"a shorter sequence (these choices hold S <= {longest:,} in this budget)")
  store = dict(ar.store_bytes)
  rooms = {"host": host_tier_bytes, "nvme": disk_free_bytes}
  rooms["host,nvme"] = host_tier_bytes + disk_free_bytes
  host_need = store["host"] + store["host,nvme"]
  nvme_need = store["nvme"] + store["host,nvme"]
  for loc, need, have in (
    ("host", store["host"], rooms["host"]),
    ("nvme", store["nvme"], rooms["nvme"]),
    ("host,nvme", host_need + nvme_need - store["host,nvme"], rooms["host,nvme"]),
  ):
    if need > have:
      why.append(
        f"the tags in {loc} need {_gb(need)} in the store, more than its room {_gb(have)} "
        f"(host tier {_gb(host_tier_bytes)}, disk free {_gb(disk_free_bytes)})"
      )
      fixes.append(
        "more store room (ssd.configure(host_tier_bytes=...), a disk with more free space), "
        "host,nvme to use both, or a shorter sequence"
      )
  if not why:
    return ar
  fixes = list(dict.fromkeys(f for f in fixes if f))
  message = (
    f"sequence length {seq_len:,} (batch {batch}) cannot fit: "
    + "; ".join(why)
    + ".\n"
    + "\n".join(ar.lines())
    + "\nWhat to change: "
    + "; ".join(fixes)
  )
  raise LongContextError(message, ar)


def plan_long_context(
  cfg: Any,
  seq_len: int,
  batch: int,
  budget_bytes: int,
  profile_fn: Callable[[int, int], Profile],
  memory_fn: Callable[[int, int, Plan], int],
  *,
  chunk_options: Sequence[tuple[int, int]] | None = None,
  host_tier_bytes: int | None = None,
  disk_free_bytes: int = 0,
  params_on_device: bool = True,
  optimizer_on_device: bool = False,
  param_dtype: Any = None,
  allowed: Iterable[str | Location] = PLANNED,
  max_compiles: int = 2,
  **plan_options,
) -> Plan:
  """The fastest plan of a long sequence that fits ``budget_bytes``: each tag's location, the
  split, and the chunk counts of the MLP and the loss (``Plan.chunks``,
  ``Plan.model_options()``), with its predicted step (``Plan.step_s``) and the device memory
  XLA measured (``Plan.measured_device_bytes``, the staging arena included).

  A function of its own rather than an option of :func:`plan_for_budget`: the chunk counts are
  the model's options, not a policy's, so choosing them needs the model's shape and the
  sequence length, which ``plan_for_budget`` does not see; with them it refuses a sequence that
  cannot fit before anything compiles (:func:`check_long_context`), skips the compiles the
  arithmetic rules out, and puts each tag's bytes at the model's (a chunked ``mlp_up`` is
  ``mlp_chunks`` tensors a layer). For each chunk count it runs ``plan_for_budget``'s search.
  A profile without ``other_s`` gets the head's and the loss's time from their FLOPs at the
  layer's measured rate.

  Args:
    cfg: the model's config (``models.get_config("llama", ...)``; see the module docstring).
    seq_len, batch: positions per sequence and sequences per step.
    budget_bytes: the device memory the step must fit in.
    profile_fn: ``(mlp_chunks, loss_chunks) -> Profile`` of one layer at ``seq_len`` and
      ``batch`` (``ssd.profile``: the measured compute times of the tags' producers, the link's
      and the disk's rates); one profile for every count will do.
    memory_fn: ``(mlp_chunks, loss_chunks, plan) -> bytes``: XLA's device memory of the step
      so configured (``compiled.memory_analysis()``: temp + arguments + outputs - aliased; the
      staging arena is added here).
    chunk_options: ``(mlp_chunks, loss_chunks)`` pairs (default: the whole sequence, then
      chunks of 16K/8K, 8K/4K and 4K/2K positions).
    host_tier_bytes: the host tier's room (default: the profile's); disk_free_bytes: the
      files' (0: no plan uses the files).
    params_on_device, optimizer_on_device, param_dtype: as :func:`long_context_bytes`'s.
    allowed, max_compiles, plan_options: as :func:`plan_for_budget`'s (``min_bytes``, ...).

  Raises:
    LongContextError: no chunk count fits even with the layer inputs in the store, with the
      arithmetic; ValueError: no plan fits (what was measured).
  """
  _check_int("budget_bytes", budget_bytes, low=1)
  options = _chunk_options(seq_len, chunk_options)
  allowed = tuple(Location.parse(a, what="allowed") for a in allowed)
  stores = [loc for loc in allowed if loc in OFFLOADED]
  lenient = {"layer_in": stores[0].value} if stores else {}
  common = dict(
    params_on_device=params_on_device, optimizer_on_device=optimizer_on_device,
    param_dtype=param_dtype,
  )  # fmt: skip
  # the arithmetic's floor of the most lenient placement: options it rules out are not tried
  fit, refused = [], None
  room = dict(budget_bytes=budget_bytes, host_tier_bytes=1 << 62, disk_free_bytes=1 << 62)
  for m, lc in options:
    try:
      check_long_context(
        cfg, seq_len, batch, mlp_chunks=m, loss_chunks=lc, locations=lenient, **room, **common
      )
      fit.append((m, lc))
    except LongContextError as e:
      if refused is None or e.arithmetic.floor_bytes < refused.arithmetic.floor_bytes:
        refused = e
  if not fit:
    raise refused
  best, tried = None, []
  for m, lc in fit:
    base = profile_fn(m, lc)
    tiers = {} if host_tier_bytes is None else {"host_tier_bytes": int(host_tier_bytes)}
    prof = _with_model_bytes(dataclasses.replace(base, batch=batch, **tiers), cfg, seq_len, batch)
    if not prof.other_s:  # the head and its chunked loss, at the layer's measured FLOP rate
      prof = dataclasses.replace(prof, other_s=_head_seconds(cfg, seq_len, batch, prof))

    def memory(_batch, plan, m=m, lc=lc):
      locs = {n: loc.value for n, loc in plan.locations}
      ar = long_context_bytes(
        cfg, seq_len, batch, mlp_chunks=m, loss_chunks=lc, locations=locs,
        offload_layers=plan.offload_layers, staging_bytes=plan.staging_bytes, **common,
      )  # fmt: skip
      if dict(ar.store_bytes)["nvme"] > disk_free_bytes:
        return budget_bytes + 1  # the files cannot hold it: not compiled
      if ar.floor_bytes > budget_bytes:
        return ar.floor_bytes  # the arithmetic rules it out: not compiled
      return int(memory_fn(m, lc, plan)) + plan.staging_bytes

    if not disk_free_bytes:
      allowed_here = tuple(loc for loc in allowed if loc is not Location.NVME)
    else:
      allowed_here = allowed
    try:
      p = plan_for_budget(
        budget_bytes, [batch], lambda _b, prof=prof: prof, memory,
        max_compiles=max_compiles, allowed=allowed_here, **plan_options,
      )  # fmt: skip
    except ValueError as e:
      tried.append(f"mlp_chunks={m}, loss_chunks={lc}: {e}")
      continue
    tried.append(f"mlp_chunks={m}, loss_chunks={lc}: {p.step_s:.4g} s predicted")
    if best is None or p.step_s < best.step_s * (1 - 1e-9):
      best = dataclasses.replace(p, chunks=(("loss_chunks", lc), ("mlp_chunks", m)))
  if best is None:
    raise ValueError(
      f"budget_bytes={budget_bytes} ({budget_bytes / 1e9:.2f} GB): no plan of sequence length "
      f"{seq_len} fits at any chunk count; tried: " + "; ".join(tried)
    )
  return best


def _chunk_options(seq_len: int, chunk_options) -> list[tuple[int, int]]:
  if chunk_options is None:
    chunk_options = [
      (
        1 if m is None else max(1, math.ceil(seq_len / m)),
        1 if lc is None else max(1, math.ceil(seq_len / lc)),
      )
      for m, lc in DEFAULT_CHUNK_TOKENS
    ]
  out = []
  for i, pair in enumerate(chunk_options):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise ValueError(f"chunk_options[{i}]: expected (mlp_chunks, loss_chunks), got {pair!r}")
    _check_int(f"chunk_options[{i}][0] (mlp_chunks)", pair[0], low=1)
    _check_int(f"chunk_options[{i}][1] (loss_chunks)", pair[1], low=1)
    if tuple(pair) not in out:
      out.append((int(pair[0]), int(pair[1])))
  if not out:
    raise ValueError("chunk_options: expected at least one (mlp_chunks, loss_chunks) pair")
  return out


def _with_model_bytes(profile: Profile, cfg: Any, seq_len: int, batch: int) -> Profile:
  """``profile`` with the bytes of the model's tags (whole layers: a profile of a chunked MLP
  reads one chunk's ``mlp_up`` from the jaxpr) and the layer input's."""
  tags = dict(long_context_bytes(cfg, seq_len, batch).tag_bytes)
  return dataclasses.replace(
    profile,
    input_bytes=tags["layer_in"],
    tags=tuple(
      dataclasses.replace(t, bytes=tags[t.name]) if t.name in tags else t for t in profile.tags
    ),
  )


def _head_seconds(cfg: Any, seq_len: int, batch: int, profile: Profile) -> float:
  """The head's and the loss's forward and backward seconds, at the FLOP rate of the profile's
  layer (its forward and backward time): the head ``2 B S H V`` FLOP forward, a layer
  ``2 B S (H (N + 2K) D + N D H + 3 H F) + 2 B N D S^2`` (its matmuls and causal attention's
  two, half of the square each); the backward passes twice the forwards."""
  H, N, K, D, F, V = _shape(cfg)
  B, S = batch, seq_len
  layer = 2.0 * B * S * (H * (N + 2 * K) * D + N * D * H + 3 * H * F) + 2.0 * B * N * D * S * S
  return (profile.forward_s + profile.backward_s) * (2.0 * B * S * H * V) / layer


def _shape(cfg: Any) -> tuple[int, int, int, int, int, int]:
  """``(H, N, K, D, F, V)`` of a config (the attributes of ``models.ModelConfig``)."""
  H, N = cfg.hidden, cfg.num_heads
  K = getattr(cfg, "kv_heads", None) or getattr(cfg, "num_kv_heads", None) or N
  D = getattr(cfg, "head_dim", None) or H // N
  return H, N, K, D, cfg.mlp_dim, cfg.vocab_size


def _parameter_count(H: int, N: int, K: int, D: int, F: int, V: int, L: int) -> int:
  """The parameters of ``models.llama.Llama`` (its ``parameter_count``): per layer
  ``H (N + 2K) D + N D H + 3 H F + 2 H``, the embedding and the head ``2 V H``, the final
  norm ``H``."""
  return L * (H * (N + 2 * K) * D + N * D * H + 3 * H * F + 2 * H) + 2 * V * H + H


def _chunks_for(whole: int, room: int, seq_len: int) -> int | None:
  """The least chunk count whose chunk of ``whole`` bytes fits ``room`` (None: none does)."""
  if room <= 0:
    return None
  n = max(1, math.ceil(whole / room))
  while n <= seq_len and whole * (-(-seq_len // n)) / seq_len > room:
    n += 1
  return n if n <= seq_len else None


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.1f} MB"
