"""The PCIe link of a GPU: pinned host <-> device copies, each direction alone and both at once
(``measure_link``, cached per host, GPU model, ordinal, size and host memory in ``cache``). The
host tier moves its bytes over this link; the planner takes its rate from here. Several GPUs
copying at once (``measure_links``): on a node the host's memory system, not each GPU's link,
may bind, so a sharded stream compares with the rate each GPU gets while the others copy too."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence

import jax

from jax_ssdtrain._src import native
from jax_ssdtrain._src.measure import cache
from jax_ssdtrain._src.options import GiB, parse_size


@dataclasses.dataclass(frozen=True)
class LinkResult:
  """Pinned host <-> GPU copy rates (GB/s = 1e9 bytes/s), medians of ``repeats`` copies."""

  device: int  # local CUDA ordinal
  device_kind: str
  size: int  # bytes per copy
  d2h_gbps: float  # device to host, alone
  h2d_gbps: float  # host to device, alone
  duplex_d2h_gbps: float  # device to host while host to device runs
  duplex_h2d_gbps: float
  host: str = "alloc"  # host buffers: alloc | registered | registered_hugepages
  measured_at: float = 0.0
  cached: bool = False

  @property
  def gbps(self) -> float:
    """One rate for both directions, as the planner's host model takes it: the slower
    direction alone (the forward pass copies to the host, the backward pass back)."""
    return min(self.d2h_gbps, self.h2d_gbps)


def measure_link(
  device: int = 0,
  size: int | str = 1 * GiB,
  *,
  repeats: int = 5,
  host: str = "registered",
  refresh: bool = False,
) -> LinkResult:
  """The PCIe link of local GPU ``device`` (cached per host, GPU model, ordinal, size and host
  memory; ``refresh=True`` measures again). Runs in this process on two pinned buffers and two
  device buffers of ``size`` (freed before it returns). ``host``: ``"registered"`` (mmap'ed and
  registered, as the engine's host tier: what the engine can reach), ``"alloc"``
  (cudaHostAlloc: what a plain pinned-copy benchmark measures) or ``"registered_hugepages"``.
  OSError where no CUDA handler was built or no such GPU is visible."""
  _check_host(host)
  nbytes = parse_size(size, what="size")
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats: expected a positive integer, got {repeats!r}")
  if isinstance(device, bool) or not isinstance(device, int) or device < 0:
    raise ValueError(f"device: expected a CUDA ordinal >= 0, got {device!r}")
  kind = gpu_kind(device)
  key = f"link|{os.uname().nodename}|{kind}|ordinal={device}|size={nbytes}|host={host}"
  hit = None if refresh else cache.entry(key, LinkResult)
  if hit is not None:
    return hit
  rates = native.probe_link(device, nbytes, repeats, host)
  result = _result(device, kind, nbytes, rates, host, time.time())
  cache.remember(key, result)
  return result


def measure_links(
  devices: Sequence[int], size: int | str = 1 * GiB, *, repeats: int = 5, host: str = "registered"
) -> list[LinkResult]:
  """The links of local GPUs ``devices`` measured at once: one thread per GPU, their copies
  started together (each probe's buffers ready first), each GPU copying what
  :func:`measure_link` copies. Per GPU rates, in ``devices``' order; not cached (what the
  others do matters). OSError as :func:`measure_link`."""
  devices = list(devices)
  if not devices or len(set(devices)) != len(devices):
    raise ValueError(f"devices: expected distinct CUDA ordinals, got {devices!r}")
  _check_host(host)
  nbytes = parse_size(size, what="size")
  kinds = [gpu_kind(d) for d in devices]
  start = threading.Barrier(len(devices))
  rates: list = [None] * len(devices)
  errors: list[BaseException] = []

  def probe(i: int) -> None:
    try:
      rates[i] = native.probe_link(devices[i], nbytes, repeats, host, on_ready=start.wait)
    except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
      start.abort()  # the others stop waiting
      errors.append(e)

  threads = [threading.Thread(target=probe, args=(i,)) for i in range(len(devices))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:  # the cause, not another thread's broken barrier
    raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
  now = time.time()
  return [_result(d, k, nbytes, r, host, now) for d, k, r in zip(devices, kinds, rates)]


def _result(device: int, kind: str, nbytes: int, rates, host: str, when: float) -> LinkResult:
  """The :class:`LinkResult` of one GPU's ``native.probe_link`` rates."""
  return LinkResult(
    device,
    kind,
    nbytes,
    rates.d2h,
    rates.h2d,
    rates.duplex_d2h,
    rates.duplex_h2d,
    host,
    measured_at=when,
  )


def _check_host(host: str) -> None:
  if host not in native.LINK_HOST_KINDS:
    raise ValueError(f"host: expected one of {sorted(native.LINK_HOST_KINDS)}, got {host!r}")


def gpu_kind(device: int) -> str:
  """The model of CUDA GPU ``device`` as JAX names it (where JAX sees no such GPU:
  "cuda:<ordinal>")."""
  try:
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  except RuntimeError:  # no backend
    gpus = []
  return gpus[device].device_kind if device < len(gpus) else f"cuda:{device}"
