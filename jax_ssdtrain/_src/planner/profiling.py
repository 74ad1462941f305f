"""The planner's profiling and measurement: ``profile`` times one layer of a scan as the
training step runs it (compiling its scans on threads on the CPU, with a progress bar or a
line per step), reads its tagged bytes and FLOPs from the jaxpr, and takes the store's
bandwidth (``measured_bandwidth``) and the host tier's link rate (``measured_link_gbps``)."""

from __future__ import annotations

import concurrent.futures
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import config, jax_internals
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.measure import link as link_probe
from jax_ssdtrain._src.measure.disk import measured_bandwidth
from jax_ssdtrain._src.measure.timing import median_time
from jax_ssdtrain._src.planner.checks import _check_int, _check_number
from jax_ssdtrain._src.planner.types import (
  DEFAULT_HOST_GBPS,
  DEFAULT_STAGING_BYTES,
  Profile,
  TagProfile,
)
from jax_ssdtrain._src.policies import (
  DEFAULT_MIN_BYTES,
  location_policy,
  name_p,
  nbytes,
  tree_nbytes,
)

MIN_DIFFERENCE_S = 0.02  # profile: the long and short scans differ by at least this much


def profile(
  layer_fn: Callable,
  params: Any,
  x: Any,
  *,
  num_layers: int,
  directory: str | os.PathLike | None = None,
  bandwidth: tuple[float, float] | None = None,
  host_gbps: float | None = None,
  host_cache_bytes: int | None = None,
  staging_bytes: int | None = None,
  host_tier_bytes: int | None = None,
  other_s: float = 0.0,
  update_s: float = 0.0,
  batch: int | None = None,
  repeats: int = 10,
  warmup: int = 2,
  progress: bool | None = None,
) -> Profile:
  """Times one layer ``layer_fn(params, x) -> y`` (``y`` shaped like ``x``: a scan body) as the
  training step runs it, reads the tagged bytes from its jaxpr, and takes the store bandwidth:
  ``bandwidth`` as (write, read) GB/s if given, else :func:`measured_bandwidth` of
  ``directory``, by default the store's own directory (the first of
  :func:`~jax_ssdtrain.store_directories`: ``ssd.configure``'s, else the private temporary
  one). The bandwidth probe writes and reads back what a step of this stack could send to the
  store (all its tags in all ``num_layers`` layers), in tensors of its largest tag, each
  rounded up to a power of two and kept between 16 MiB and 256 MiB (tensors: 1 MiB to
  64 MiB); it is measured once per filesystem and size, then cached on disk.

  Forward and backward times are per layer of a ``lax.scan`` with every tag saved on the device
  (the plan's all-on-device baseline): the difference between scans of 2 and of 4 or more
  layers (more for small layers, see ``_layer_times``), per layer, so that launch and transfer
  costs outside the layers cancel. The same scans with nothing saved give the cost of
  recomputing a layer (XLA fuses recomputed element-wise work into the backward, so it is often
  far below the forward time), which the tags share by FLOPs; with the input tag (else the
  smallest tag) in the host tier, the cost of one store and its load (``offload_s``: it goes
  through the store, which is set up if it is not yet).
  ``host_gbps`` (the host tier's link) defaults to the rate the engine's copies reached while
  the offload probe's layers computed (CUDA events; the store's statistics are reset), else to
  :func:`measured_link_gbps` (the link idle, cached).
  ``host_cache_bytes``, ``staging_bytes`` and ``host_tier_bytes`` default to the current store
  configuration's.

  It compiles the scans above (four, three where the layer has no tag) at both lengths (on
  the CPU each length's at once, on threads) and runs each ``warmup + 1 + repeats`` times.
  ``progress``: show each step (a tqdm bar where tqdm is installed, else a line per step on
  stderr); None shows it when stderr is a terminal."""
  _check_int("num_layers", num_layers, low=1)
  _check_int("repeats", repeats, low=1)
  _check_int("warmup", warmup)
  if progress is not None and not isinstance(progress, bool):
    raise ValueError(f"progress: expected True, False or None, got {progress!r}")
  if bandwidth is not None:
    if not isinstance(bandwidth, (tuple, list)) or len(bandwidth) != 2:
      raise ValueError(f"bandwidth: expected (write, read) GB/s, got {bandwidth!r}")
    _check_number("bandwidth[0] (write GB/s)", bandwidth[0])
    _check_number("bandwidth[1] (read GB/s)", bandwidth[1])
  cfg = config.current() or config.defaults()  # defaults: SSDTRAIN_* environment
  sizes = {
    k: getattr(cfg, k) if v is None else v
    for k, v in (
      ("host_cache_bytes", host_cache_bytes),
      ("staging_bytes", staging_bytes),
      ("host_tier_bytes", host_tier_bytes),
    )
  }
  if sizes["staging_bytes"] is None:  # staging_bytes="auto": its floor
    sizes["staging_bytes"] = DEFAULT_STAGING_BYTES
  tags, flops, input_tag = _tagged(layer_fn, params, x)
  # the offload cost is measured on the input tag, else the smallest tag the policies offload
  big = [n for n in tags if tags[n] >= DEFAULT_MIN_BYTES] or list(tags)
  probe_tag = input_tag or min(big, key=tags.get, default=None)
  programs = 3 + (probe_tag is not None)
  with _Progress(2 * (1 + programs) + (bandwidth is None), enabled=progress) as bar:
    if bandwidth is None:
      if directory is None:
        directory = config.store_directories()[0]
      probe_bytes, tensor_bytes = _probe_sizes(tags, num_layers)
      bar.start(f"store bandwidth of {os.fspath(directory)} ({probe_bytes >> 20} MiB)")
      bandwidth = measured_bandwidth(directory, probe_bytes, tensor_bytes=tensor_bytes)
      bar.finish()
    write_gbps, read_gbps = bandwidth
    if host_gbps is None and probe_tag is not None:
      config.reset_stats()
    forward_s, backward_s, recompute_s, offload_s = _layer_times(
      layer_fn, params, x, tuple(tags), probe_tag, repeats, warmup, bar
    )
  if host_gbps is None:
    host_gbps = _achieved_link_gbps() if probe_tag is not None else None
    host_gbps = host_gbps or measured_link_gbps()
  total = sum(flops.values()) or 1.0
  return Profile(
    num_layers=num_layers,
    forward_s=forward_s,
    backward_s=backward_s,
    tags=tuple(TagProfile(n, b, recompute_s * flops[n] / total) for n, b in tags.items()),
    write_gbps=float(write_gbps),
    read_gbps=float(read_gbps),
    host_gbps=float(host_gbps),
    **{k: int(v) for k, v in sizes.items()},
    input_bytes=tree_nbytes(x),
    input_tag=input_tag,
    param_bytes=tree_nbytes(params),
    offload_s=offload_s,
    other_s=other_s,
    update_s=update_s,
    batch=batch,
  )


def _tagged(
  layer_fn: Callable, params: Any, x: Any
) -> tuple[dict[str, int], dict[str, float], str | None]:
  """``({tag: bytes per layer}, {tag: forward FLOPs since the previous tag}, input tag)`` from
  the jaxpr; the input tag names the layer input ``x`` itself (a single array), else None."""
  with jax_internals.remat3(False):  # under jax_remat3 tags are not name_p eqns
    closed = jax.make_jaxpr(layer_fn)(params, x)
  n_x = len(jax.tree.leaves(x))
  inputs = set(closed.jaxpr.invars[-n_x:]) if n_x == 1 else set()
  sizes: dict[str, int] = {}
  flops: dict[str, float] = {}
  input_tags: set[str] = set()
  acc = 0.0
  for eqn, aliases in _walk(closed.jaxpr, inputs):
    if eqn.primitive is name_p:
      name = eqn.params["name"]
      sizes[name] = sizes.get(name, 0) + nbytes(eqn.invars[0].aval)
      flops[name] = flops.get(name, 0.0) + acc
      acc = 0.0
      if eqn.invars[0] in aliases:
        input_tags.add(name)
    else:
      acc += _flops(eqn)
  # a name that also tags other values does not free the input when it is offloaded
  input_tag = next((n for n in input_tags if sizes[n] == tree_nbytes(x)), None)
  return sizes, flops, input_tag


def _achieved_link_gbps() -> float | None:
  """The slower direction of the host tier's copies since the last reset, in GB/s of copy-
  stream busy time (None where none ran: no GPU, or every copy stayed in staging)."""
  s = config.stats()
  rates = [s[f"link_{d}_GBps"] for d in ("d2h", "h2d") if s.get(f"link_{d}_bytes", 0) >= 1 << 26]
  return min(rates) if rates else None


def measured_link_gbps(device: int = 0) -> float:
  """GB/s of the host tier's copies over GPU ``device``'s link: the slower direction of pinned
  copies between the engine's kind of host memory and the device (``probe.measure_link``,
  measured once per machine and cached); ``DEFAULT_HOST_GBPS`` where JAX has no GPU."""
  if not any(d.platform == "gpu" for d in jax.local_devices()):
    return DEFAULT_HOST_GBPS
  return link_probe.measure_link(device).gbps


def _probe_sizes(tags: Mapping[str, int], num_layers: int) -> tuple[int, int]:
  """``(bytes, tensor bytes)`` of the bandwidth probe for a stack: what one step could send to
  the store (every tag of every layer) in tensors of its largest tag, each rounded up to a
  power of two, the bytes between 16 MiB and 256 MiB, the tensors between 1 MiB and 64 MiB."""
  per_step = num_layers * sum(tags.values())
  total = min(max(_pow2_ceil(per_step), 16 << 20), 256 << 20)
  tensor = min(max(_pow2_ceil(max(tags.values(), default=0)), 1 << 20), 64 << 20, total)
  return total, tensor


def _pow2_ceil(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def _walk(jaxpr, aliases: frozenset | set = frozenset()) -> Iterable[tuple[Any, set]]:
  """``(equation, variables holding the traced input)`` in program order, descending into
  sub-jaxprs (pjit, custom_vjp, scan, ...); ``aliases`` follow the input into a sub-jaxpr
  whose inputs are its equation's operands (pjit, closed_call: same count)."""
  for eqn in jaxpr.eqns:
    subs = [v for v in eqn.params.values() if _is_jaxpr(v)]
    subs += [
      s for v in eqn.params.values() if isinstance(v, (tuple, list)) for s in v if _is_jaxpr(s)
    ]
    if subs and eqn.primitive is not name_p:
      sub = getattr(subs[0], "jaxpr", subs[0])  # branches/fwd-bwd pairs: the first is the forward
      inner = set()
      if len(sub.invars) == len(eqn.invars):
        inner = {v for v, outer in zip(sub.invars, eqn.invars) if _in(outer, aliases)}
      yield from _walk(sub, inner)
    else:
      yield eqn, aliases


def _in(var, aliases) -> bool:
  try:
    return var in aliases
  except TypeError:  # literals are not hashable
    return False


def _is_jaxpr(v) -> bool:
  return hasattr(v, "eqns") or (hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"))


def _flops(eqn) -> float:
  """The forward FLOPs of one equation that the next tag's share of a recomputed layer holds."""
  name = eqn.primitive.name
  if name == jax_internals.FLASH_ATTENTION_FORWARD:
    # cuDNN's flash attention: its backward pass reads its forward pass's own outputs (the
    # softmax statistics among them), which no tag names, so a recomputed layer runs it again
    # whatever its tags save (the attn tag too): no tag's to spare (flash_attention_saveable
    # spares them, outside the tags)
    return 0.0
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contract = int(np.prod([lhs[d] for d in lc], dtype=np.int64))
    return 2.0 * contract * int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
  if "attention" in name or "cudnn" in name:  # fused attention: QK^T and PV, (B,T,N,D)x(B,S,N,D)
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if len(q) == 4 and len(k) == 4:
      return 4.0 * q[0] * q[1] * k[1] * q[2] * q[3]
  return 0.0


def _layer_times(
  layer_fn, params, x, names, probe_tag, repeats: int, warmup: int, bar: _Progress | None = None
) -> tuple[float, float, float, float]:
  """(forward, backward, recompute, offload) seconds of one layer inside a scan: forward and
  backward with every tag saved on the device; recompute: what the backward adds when nothing
  is saved; offload: what the step adds when ``probe_tag`` goes to the host tier (0 if None)."""
  bar = bar or _Progress(0, enabled=False)

  def stack_of(policy):
    # prevent_cse=False as the models' and benchmarks' scanned layers (barriers cost time)
    body = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)
    return lambda ps, v: jax.lax.scan(lambda h, p: (body(p, h), None), v, ps)[0]

  def train_of(stack):  # forward with residuals, then the backward of a ones cotangent
    def train(ps, v):
      y, pullback = jax.vjp(stack, ps, v)
      return pullback(jnp.ones_like(y))

    return jax.jit(train)

  on_device = {n: Location.DEVICE for n in names}
  saved = stack_of(location_policy(on_device, min_bytes=0))
  fwd, fwd_bwd = jax.jit(saved), train_of(saved)
  remat_bwd = train_of(stack_of(jax.checkpoint_policies.nothing_saveable))
  fns = {
    "forward": fwd,
    "forward and backward": fwd_bwd,
    "recomputing backward": remat_bwd,
  }
  if probe_tag is not None:
    host = location_policy({**on_device, probe_tag: Location.HOST}, min_bytes=0)
    fns[f"{probe_tag!r} in the host tier"] = train_of(stack_of(host))
  v = jnp.asarray(x)

  def times_at(n):  # median seconds of each function on a scan of n layers
    bar.start(f"compiling {len(fns)} scans of {n} layers")
    # one program stacks every leaf: (n, ...) per leaf
    ps = jax.jit(lambda p: jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), p))(
      params
    )
    compiled = _compile_all([f.lower(ps, v) for f in fns.values()])
    bar.finish()
    times = []
    for what, c in zip(fns, compiled):
      bar.start(f"timing the {what} of {n} layers")
      times.append(median_time(lambda c=c: c(ps, v), repeats, warmup))
      bar.finish()
    return times

  # Two layers and more: a scan of one is no loop at all (XLA removes it, and with it the
  # per-layer slicing and stacking of residuals), so a difference against it overstates a layer.
  # The longer scan has at least 4 layers, more for small layers (up to 32), so that the
  # difference is at least MIN_DIFFERENCE_S of training time and not lost in timing noise.
  lo = 2
  short = times_at(lo)
  per_layer = max(short[1] / lo, 1e-9)
  hi = min(32, max(4, 2 * math.ceil((lo + MIN_DIFFERENCE_S / per_layer) / 2)))
  long = times_at(hi)
  # per layer: (T(hi) - T(2)) / (hi - 2); where timing noise makes it <= 0, T(hi) / hi
  d = [(b - a) / (hi - lo) for a, b in zip(short, long)]
  if min(d) <= 0 or d[1] <= d[0]:
    d = [b / hi for b in long]
  f, t, r = d[:3]
  # recomputing costs at least nothing and at most a forward (timing noise either way)
  return (
    f,
    (t - f if t > f else t / 2),
    min(max(r - t, 0.0), f),
    max(d[3] - t, 0.0) if probe_tag is not None else 0.0,
  )


def _compile_all(lowered: Sequence[Any]) -> list[Any]:
  """Compiles lowered programs: on the CPU at once, on threads (XLA compiles without holding
  the GIL; the lowering, which runs our hooks, stays on the caller's thread); elsewhere one at
  a time, as a GPU compiler's autotuning times kernels on the device and would time them
  against each other."""
  if len(lowered) < 2 or jax.default_backend() != "cpu":
    return [low.compile() for low in lowered]
  with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
    return list(pool.map(lambda low: low.compile(), lowered))


class _Progress:
  """``profile``'s steps: a tqdm bar where tqdm is installed, else a line per step on stderr;
  shown where ``enabled`` (None: when stderr is a terminal)."""

  def __init__(self, total: int, *, enabled: bool | None):
    self.total, self.done, self.bar, self.lines = total, 0, None, False
    if enabled is None:
      enabled = sys.stderr.isatty()
    if not enabled:
      return
    try:
      from tqdm import tqdm  # optional (the demo extra): a bar where installed, else lines
    except ImportError:
      self.lines = True
      return
    self.bar = tqdm(total=total, desc="ssd.profile", unit="step", file=sys.stderr, leave=True)

  def start(self, what: str) -> None:
    if self.bar is not None:
      self.bar.set_postfix_str(what)
    elif self.lines:
      print(f"ssd.profile [{self.done + 1}/{self.total}] {what}", file=sys.stderr, flush=True)

  def finish(self) -> None:
    self.done += 1
    if self.bar is not None:
      self.bar.update(1)

  def __enter__(self) -> _Progress:
    return self

  def __exit__(self, *exc) -> None:
    if self.bar is not None:
      self.bar.close()
