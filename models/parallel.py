"""Data, fully sharded data and tensor parallelism through ``jax.sharding``.

A :class:`Parallelism` names a 2-D mesh ``("data", "model")``:

* ``data`` ways of data parallelism: the batch is split over the ``data`` axis;
* ``fsdp``: parameters and optimizer state are split over ``data`` too (largest dimension
  divisible by the axis size, never the stacked-layer dimension), gathered by XLA where used;
* ``model`` ways of tensor parallelism on the MLP: the up-projection is split by columns and the
  down-projection by rows (Megatron style), so the ``mlp_up`` activation is split over ``model``.

Offloaded activations follow: every device stores and loads only its own shard.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"


@dataclasses.dataclass(frozen=True)
class Parallelism:
  data: int = 1
  model: int = 1
  fsdp: bool = False

  def __post_init__(self):
    for name in ("data", "model"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive number of devices, got {value!r}")
    if not isinstance(self.fsdp, bool):
      raise ValueError(f"fsdp: expected a bool, got {self.fsdp!r}")

  @property
  def size(self) -> int:
    return self.data * self.model

  def mesh(self, devices=None) -> Mesh:
    """The ``(data, model)`` mesh over ``devices``, exactly ``data * model`` of them; by default
    the first ``data * model`` of ``jax.devices()`` (a mesh smaller than the machine leaves the
    other devices out). Several processes: every device of every process by default (each
    process feeds its own rows of the batch), or pass ``devices``."""
    if devices is None:
      devices = default_devices(self.size)
    devices = list(devices)
    if len(devices) != self.size:
      raise ValueError(
        f"mesh data={self.data} x model={self.model} needs {self.size} devices, "
        f"{len(devices)} given"
      )
    return Mesh(np.array(devices).reshape(self.data, self.model), (DATA, MODEL))

  def batch_sharding(self, mesh: Mesh) -> NamedSharding:
    """Tokens (B, L): the batch split over ``data``."""
    return NamedSharding(mesh, P(DATA, None))

  def shardings(self, tree, mesh: Mesh):
    """NamedShardings for a params / train-state pytree (leaves matched by their path)."""
    return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, self.spec(jax.tree_util.keystr(path), np.shape(leaf))),
      tree,
    )

  def spec(self, path: str, shape: tuple[int, ...]) -> P:
    """The PartitionSpec of one parameter (or optimizer slot) named by its pytree path."""
    axes: list[str | None] = [None] * len(shape)
    if self.model > 1:
      dim = _tp_dim(path, len(shape))
      if dim is not None:
        if shape[dim] % self.model:
          raise ValueError(
            f"tensor parallelism: {path} dimension {dim} of shape "
            f"{shape} is not divisible by model={self.model}"
          )
        axes[dim] = MODEL
    if self.fsdp and self.data > 1 and len(shape) >= 2:
      first = 1 if "['layers']" in path else 0  # never the stacked-layer dimension
      free = [d for d in range(first, len(shape)) if axes[d] is None and shape[d] % self.data == 0]
      if free:
        axes[max(free, key=lambda d: (shape[d], -d))] = DATA
    return P(*axes)


@contextlib.contextmanager
def batch_sharded_activations(mesh: Mesh):
  """While tracing inside this context, :func:`constrain_batch` pins activations to the batch
  split over ``data``. Without it, FSDP's sharded weights let the partitioner split
  activations along the hidden dimension instead (partial sums all-reduced in every layer)
  where gathering the weights is what FSDP means."""
  token = _ACTIVATION_SHARDING.set(mesh)
  try:
    yield
  finally:
    _ACTIVATION_SHARDING.reset(token)


def constrain_batch(x):
  """``x`` (B, ...) split over ``data`` on its first axis inside
  :func:`batch_sharded_activations` (the other axes left to the partitioner, e.g. ``model``
  for tensor parallelism); unchanged elsewhere."""
  mesh = _ACTIVATION_SHARDING.get()
  if mesh is None:
    return x
  spec = P(DATA, *[P.UNCONSTRAINED] * (x.ndim - 1))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def gather_weight(w):
  """``w`` replicated on every device inside :func:`batch_sharded_activations` (one
  all-gather of an FSDP-split weight, reused by every use in the step); unchanged elsewhere."""
  mesh = _ACTIVATION_SHARDING.get()
  if mesh is None:
    return w
  return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))


_ACTIVATION_SHARDING: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
  "activation_mesh", default=None
)


def default_devices(n: int) -> list:
  """The first ``n`` of ``jax.devices()`` (a ValueError naming how many there are when fewer).
  With several processes, ``n`` must be all of them: the first ``n`` would leave whole processes
  out of the mesh, whose rows of the batch nothing would take."""
  devices = jax.devices()
  if n > len(devices):
    raise ValueError(
      f"a mesh of {n} devices: there are only {len(devices)} ({', '.join(str(d) for d in devices)})"
    )
  if n < len(devices) and jax.process_count() > 1:
    raise ValueError(
      f"a mesh of {n} of the {len(devices)} devices of {jax.process_count()} processes: "
      "a mesh over several processes takes all their devices (or pass the devices)"
    )
  return devices[:n]


def select_devices(spec: str) -> list:
  """``"0,1"`` -> those devices of ``jax.devices()``, by ``jax.Device.id`` (on one machine: the
  index among its GPUs, after CUDA_VISIBLE_DEVICES), in the order given."""
  by_id = {d.id: d for d in jax.devices()}
  ids = []
  for item in (s.strip() for s in spec.split(",")):
    try:
      ids.append(int(item))
    except ValueError:
      raise ValueError(f"expected device ids like 0,1, got {spec!r}") from None
  if not ids or len(set(ids)) != len(ids):
    raise ValueError(f"expected distinct device ids like 0,1, got {spec!r}")
  missing = [i for i in ids if i not in by_id]
  if missing:
    raise ValueError(
      f"no device {', '.join(map(str, missing))}; there are "
      f"{len(by_id)} (ids {', '.join(map(str, sorted(by_id)))})"
    )
  return [by_id[i] for i in ids]


def parse_mesh(spec: str) -> Parallelism:
  """``"dp=2,tp=2,fsdp"`` -> Parallelism(data=2, model=2, fsdp=True)."""
  values: dict[str, object] = {}
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    key, _, value = item.partition("=")
    key = key.strip().lower()
    if key not in _MESH_KEYS:
      raise ValueError(f"mesh: unknown entry {item!r}; expected dp=N, tp=N or fsdp")
    field, kind = _MESH_KEYS[key]
    if kind is bool:
      if value:
        raise ValueError(f"mesh: {key} takes no value, got {item!r}")
      values[field] = True
      continue
    try:
      values[field] = int(value)
    except ValueError:
      raise ValueError(f"mesh: {key} expects an integer, got {item!r}") from None
  return Parallelism(**values)


_MESH_KEYS = {"dp": ("data", int), "tp": ("model", int), "fsdp": ("fsdp", bool)}


def _tp_dim(path: str, ndim: int) -> int | None:
  """Which dimension of an MLP weight the ``model`` axis splits (None: not split)."""
  if "['mlp']" not in path:
    return None
  if "['up']" in path:  # kernel (..., H, F), bias (..., F): columns
    return ndim - 1
  if "['down']['kernel']" in path:  # (..., F, H): rows
    return ndim - 2
  return None
