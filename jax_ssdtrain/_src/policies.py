"""Remat policies that send tagged activations to the SSD store.

Public API first (factories and the ready policy), implementation after. A policy is a
small frozen, hashable dataclass: JAX's partial-eval cache keys on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src.location import STORE_LOCATIONS, Location  # noqa: F401 (re-exported)

name_p = ji.name_p

DEFAULT_MIN_BYTES = 1 << 20


def offload_policy(
  names_to_offload: Iterable[str],
  names_to_save: Iterable[str] = (),
  *,
  min_bytes: int = DEFAULT_MIN_BYTES,
  base: Callable[..., Any] | None = None,
  location: str | Location = Location.NVME,
) -> OffloadPolicy:
  """Counterpart of ``jax.checkpoint_policies.save_and_offload_only_these_names``.

  Tensors tagged with ``checkpoint_name`` and listed in ``names_to_offload`` go to the store
  (``location``: ``"nvme"``, ``"host"`` or ``"host,nvme"``, the host tier spilling to the files
  when it is full) when they are at least ``min_bytes`` large, and are
  saved on the device otherwise; ``names_to_save`` stay on the device; every other equation is
  decided by ``base`` (default: recompute).
  """
  offload = _names("names_to_offload", names_to_offload)
  save = _names("names_to_save", names_to_save)
  both = sorted(set(offload) & set(save))
  if both:
    raise ValueError(f"names {both} are in both names_to_offload and names_to_save")
  loc = Location.parse(location, what="location")
  if not loc.in_store:
    raise ValueError(
      f"location: offload_policy offloads to 'nvme', 'host' or 'host,nvme', got {location!r}"
    )
  if base is not None and not callable(base):
    raise TypeError(f"base: expected a remat policy (callable) or None, got {base!r}")
  locations = {n: loc for n in offload} | {n: Location.DEVICE for n in save}
  return OffloadPolicy(
    _freeze(locations), _min_bytes(min_bytes), default=None, below_min=Location.DEVICE, base=base
  )


def location_policy(
  locations: Mapping[str, str | Location],
  *,
  min_bytes: int = DEFAULT_MIN_BYTES,
  default: str | Location = Location.REMAT,
) -> OffloadPolicy:
  """A policy from a per-name location map (``remat | device | host | nvme | host,nvme``).

  Tagged names that are not in ``locations`` get ``default``; untagged values are recomputed.
  A host or nvme tensor smaller than ``min_bytes`` is saved on the device instead.
  """
  if not isinstance(locations, Mapping):
    raise TypeError(f"locations: expected a mapping of tag name to location, got {locations!r}")
  parsed = {
    _names("locations", [k])[0]: Location.parse(v, what=f"locations[{k!r}]")
    for k, v in locations.items()
  }
  return OffloadPolicy(
    _freeze(parsed),
    _min_bytes(min_bytes),
    default=Location.parse(default, what="default"),
    below_min=Location.DEVICE,
    base=None,
  )


def flash_attention_saveable(prim, *_, **__) -> bool:
  """A remat policy that saves what cuDNN's flash attention computes in the forward pass: its
  output and softmax statistics (``jax.nn.dot_product_attention`` with cuDNN's implementation,
  on a GPU), on the device, so that a recomputed layer does not run attention's forward pass
  again; its queries, keys and values are recomputed from what the layer saves (cheap: linear
  in the sequence, where attention is quadratic). Everything else is recomputed.

  Compose it as ``jax.checkpoint_policies.dots_saveable`` composes:
  ``offload_policy(["layer_in"], location="host,nvme", base=flash_attention_saveable)``, or
  with JAX's own boolean policies ``jax.checkpoint_policies.save_from_both_policies(
  save_only_these_names("layer_in"), flash_attention_saveable)``. It
  costs ``2·S·N·D + 4·N·S`` bytes a layer of ``S`` positions and ``N`` heads of ``D`` (bfloat16
  output, float32 statistics) and spares attention's forward FLOPs, ``2·S²·N·D`` a layer. XLA's
  own attention (on a CPU, or ``implementation="xla"``) is not cuDNN's: there it saves nothing.
  """
  return prim.name == ji.FLASH_ATTENTION_FORWARD


# ---------------------------------------------------------------------------------------------
# Implementation


@dataclasses.dataclass(frozen=True)
class StoreDecision:
  """What an OffloadPolicy answers for a tag that goes to the store.

  JAX itself never sees it: the partial-eval hook (``remat.py``) rewrites those tags into a
  store/load pair first. Were the hook bypassed, JAX would reject it loudly (TypeError).
  """

  location: Location


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
  """Per-name locations for ``checkpoint_name`` tags; other equations go to ``base``.

  Attributes:
    locations: sorted ``(name, Location)`` pairs.
    default: location of tagged names not listed (None: ask ``base``).
    below_min: location of a host/nvme tag smaller than ``min_bytes``.
    base: policy for untagged equations and, when ``default`` is None, unlisted names
      (None: recompute).
  """

  locations: tuple[tuple[str, Location], ...]
  min_bytes: int
  default: Location | None
  below_min: Location
  base: Callable[..., Any] | None

  def location_of(self, name: str, aval) -> Location | None:
    """The location of a tag, or None when ``base`` decides it."""
    loc = dict(self.locations).get(name, self.default)
    if loc is not None and loc.in_store and nbytes(aval) < self.min_bytes:
      return self.below_min
    return loc

  def __call__(self, prim, *avals, **params):
    if prim is name_p:
      loc = self.location_of(params["name"], avals[0])
      if loc is not None:
        return _DECISIONS[loc]
    return self.base(prim, *avals, **params) if self.base is not None else False

  def offloads(self) -> bool:
    return any(loc.in_store for _, loc in self.locations) or (
      self.default is not None and self.default.in_store
    )

  def store_names(self) -> tuple[str, ...]:
    """The tags this policy names for the store (a program without them offloads nothing for
    them: remat.py warns)."""
    return tuple(name for name, loc in self.locations if loc.in_store)

  def too_small(self, name: str, aval) -> bool:
    """True when ``name`` is meant for the store but ``aval`` is below ``min_bytes``."""
    loc = dict(self.locations).get(name, self.default)
    return loc is not None and loc.in_store and nbytes(aval) < self.min_bytes


_DECISIONS = {
  Location.REMAT: False,
  Location.DEVICE: True,
  Location.HOST: StoreDecision(Location.HOST),
  Location.NVME: StoreDecision(Location.NVME),
  Location.HOST_NVME: StoreDecision(Location.HOST_NVME),
}

# Every tagged tensor of at least 1 MiB goes to the store; everything else is recomputed.
ssd_offload_policy = OffloadPolicy(
  (), DEFAULT_MIN_BYTES, default=Location.NVME, below_min=Location.REMAT, base=None
)


@dataclasses.dataclass(frozen=True)
class ComposedPolicy:
  """Two policies combined as ``jax.checkpoint_policies.save_from_both_policies`` combines
  them, extended to our decisions: for each equation the higher-ranked answer wins:
  saved on the device > our store (host / nvme) > JAX's pinned-host offload > recompute.

  Built by the partial-eval hook when one of the two policies (at any depth) is ours; JAX's
  own combinator would reject our answers ("should be a boolean").
  """

  parts: tuple[Callable[..., Any], Callable[..., Any]]

  def __call__(self, prim, *avals, **params):
    best, best_rank = False, -1
    for part in self.parts:
      decision = part(prim, *avals, **params)
      rank = decision_rank(decision)
      if rank > best_rank:
        best, best_rank = decision, rank
    return best

  def offloads(self) -> bool:
    return any(getattr(p, "offloads", lambda: False)() for p in self.parts)

  def store_names(self) -> tuple[str, ...]:
    return tuple(n for p in self.parts for n in getattr(p, "store_names", tuple)())

  def too_small(self, name: str, aval) -> bool:
    return any(getattr(p, "too_small", lambda *a: False)(name, aval) for p in self.parts)


def decision_rank(decision) -> int:
  """3: saved on the device, 2: our store, 1: JAX's host offload, 0: recomputed."""
  if isinstance(decision, StoreDecision):
    return 2
  if isinstance(decision, ji.Offloadable):
    return 1
  if decision is True or isinstance(decision, ji.SaveableType):
    return 3
  if decision is False or decision is None or isinstance(decision, ji.RecomputeType):
    return 0
  raise TypeError(
    f"remat policy returned {decision!r}; expected a bool, "
    "jax.checkpoint_policies' Saveable/Recompute/Offloadable, or a jax_ssdtrain "
    "decision"
  )


def as_offloading(policy) -> OffloadPolicy | ComposedPolicy | None:
  """The policy as one whose tags may go to our store, or None when no part of it is ours
  (then JAX handles it untouched). A factory of ours given as the policy itself, uncalled,
  raises a TypeError saying to call it (JAX would call it with an equation's parameters)."""
  if isinstance(policy, (OffloadPolicy, ComposedPolicy)):
    return policy
  _refuse_factory(policy)
  parts = ji.save_from_both_parts(policy)
  if parts is None:
    return None
  resolved = [as_offloading(p) for p in parts]
  if all(r is None for r in resolved):
    return None
  return ComposedPolicy(tuple(r if r is not None else p for r, p in zip(resolved, parts)))


def _refuse_factory(policy) -> None:
  """A TypeError where ``policy`` is :func:`offload_policy` or :func:`location_policy` itself:
  functions that make a policy, not policies."""
  if policy is offload_policy:
    factory = "offload_policy"
  elif policy is location_policy:
    factory = "location_policy"
  else:  # (by identity: a policy need not be hashable)
    return
  example = {
    "offload_policy": "jax_ssdtrain.offload_policy(['qkv', 'mlp_up'])",
    "location_policy": "jax_ssdtrain.location_policy({'qkv': 'host', 'mlp_up': 'nvme'})",
  }[factory]
  raise TypeError(
    f"policy: got the function jax_ssdtrain.{factory} itself, which makes a remat policy but "
    f"is not one; call it with the tags it places: policy={example} (the checkpoint_name tags "
    "of the activations to offload), or use the ready policy jax_ssdtrain.ssd_offload_policy "
    "(every tagged tensor of at least 1 MiB to the store)"
  )


def nbytes(x) -> int:
  """Bytes of an array, abstract value or ``jax.ShapeDtypeStruct`` (anything with ``shape`` and
  ``dtype``): the size that ``min_bytes`` is compared with. The package's one byte count."""
  return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def tree_nbytes(tree) -> int:
  """Bytes of every array of a pytree (:func:`nbytes` of each leaf)."""
  return sum(nbytes(leaf) for leaf in jax.tree.leaves(tree))


def _names(arg: str, names: Iterable[str]) -> tuple[str, ...]:
  if isinstance(names, str):
    raise TypeError(f"{arg}: expected an iterable of names, got the string {names!r}")
  out = tuple(names)
  for n in out:
    if not isinstance(n, str) or not n:
      raise TypeError(f"{arg}: tag names must be non-empty strings, got {n!r}")
  return out


def _min_bytes(value: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"min_bytes: expected an integer >= 0, got {value!r}")
  return int(value)


def _freeze(locations: Mapping[str, Location]) -> tuple[tuple[str, Location], ...]:
  return tuple(sorted(locations.items()))
