"""Store bandwidth probe: ``python -m jax_ssdtrain.probe DIR``.

Measures how fast the engine writes and reads a store directory (O_DIRECT where the
filesystem allows it, the engine's I/O threads, ``--size`` bytes in tensors of
``--tensor-size``), next to a raw O_DIRECT measurement of the same directory, then prints a
recommendation (I/O threads, host cache / read-ahead / host tier / staging sizes, bytes per
step that the store can move within ``--step-ms``) and the SSD wear of a plan (bytes written
per step x steps per day against the drive's rated endurance, ``--tbw`` or ``--dwpd`` and
``--capacity``).

    python -m jax_ssdtrain.probe /nvme/ssdtrain --step-ms 150 --bytes-per-step 1.2GB --tbw 1200
    python -m jax_ssdtrain.probe /dev/shm/x --bandwidth-cap 7GB/s --threads 8 --json

From Python, :func:`measure` returns a :class:`ProbeResult` (``write_gbps``, ``read_gbps``),
cached per directory (real path and device), size, threads, tensor size and cap in
``$XDG_CACHE_HOME/jax_ssdtrain/probe.json``; ``refresh=True`` measures again. The measurement
runs in a child process: the caller's store is left alone.

:func:`measure_disk_duplex` measures a directory reading and writing at once (plain O_DIRECT,
in this process, not cached): the load on a disk of a stream that reads one version of a state
while it writes the next, as ``offload_optimizer(location="nvme")`` does.

``python -m jax_ssdtrain.probe --link`` (and :func:`measure_link`) measures the PCIe link of a
GPU instead: pinned host <-> device copies, each direction alone and both at once, cached per
host, GPU model and size. The host tier moves its bytes over this link; the planner takes its
rate from here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import errno as _errno
import json
import math
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from jax_ssdtrain._src.config import GiB, MiB, parse_bandwidth, parse_size

__all__ = [
  "DiskDuplexResult",
  "LinkResult",
  "ProbeResult",
  "Recommendation",
  "Wear",
  "measure",
  "measure_disk_duplex",
  "measure_link",
  "recommend",
  "wear",
  "main",
]

DEFAULT_SIZE = 4 * GiB
DEFAULT_TENSOR = 64 * MiB
RAW_BLOCK = 8 * MiB
# Keys of a plan JSON read by --plan (the first present wins; top level or one level down).
PLAN_BYTES_KEYS = (
  "disk_bytes_written_per_step",
  "nvme_bytes_per_step",
  "bytes_written_per_step",
  "offloaded_bytes_per_step",
)
PLAN_STEP_KEYS = ("predicted_step_ms", "step_ms")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
  """One measurement of a store directory. GB/s are 1e9 bytes per second."""

  directory: str  # real path
  device: int  # st_dev of the directory
  size: int  # bytes written, then read, by each measurement
  threads: int  # engine I/O threads (and raw threads)
  tensor_bytes: int
  bandwidth_cap: int | None
  write_gbps: float  # engine: first store until flush() returned
  read_gbps: float  # engine: loads in reverse order (read-ahead on), first to last
  engine_write_gbps: float  # engine's own counters: bytes / time with a write in flight
  engine_read_gbps: float
  o_direct: bool
  backend: str
  raw_write_gbps: float | None = None  # plain pwrite/pread of RAW_BLOCK blocks, same threads
  raw_read_gbps: float | None = None
  raw_o_direct: bool | None = None
  measured_at: float = 0.0  # time.time()
  cached: bool = False
  stripes: int = 1  # files the engine striped the bytes over (subdirectories stripe<i>)


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


@dataclasses.dataclass(frozen=True)
class DiskDuplexResult:
  """A directory read and written at once: ``size`` bytes each way (GB/s = 1e9 bytes/s)."""

  directory: str
  size: int  # bytes read, and bytes written, at the same time
  threads: int  # half read, half write
  seconds: float  # until both directions finished
  read_gbps: float  # each direction's bytes over its own time
  write_gbps: float
  o_direct: bool

  @property
  def each_way_gbps(self) -> float:
    """``size`` over the time both directions took together."""
    return self.size / self.seconds / 1e9


@dataclasses.dataclass(frozen=True)
class Recommendation:
  """Starting points from measured bandwidth (see :func:`recommend` for the model)."""

  io_threads: int
  write_gbps: float
  read_gbps: float
  fit_bytes_per_step: int | None  # bytes the store writes and reads back within a step
  host_cache_bytes: int
  prefetch_bytes: int
  host_tier_bytes: int  # for the bytes per step beyond fit_bytes_per_step
  staging_bytes: int
  notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Wear:
  bytes_per_step: int
  steps_per_day: float
  tb_per_day: float
  rated_tbw: float | None  # TB written over the drive's warranty
  days_to_rated: float | None
  drive_writes_per_day: float | None  # tb_per_day / capacity


def measure(
  directory: str | os.PathLike,
  size: int | str = DEFAULT_SIZE,
  *,
  threads: int = 8,
  tensor_bytes: int | str = DEFAULT_TENSOR,
  bandwidth_cap: int | str | None = None,
  raw: bool = False,
  refresh: bool = False,
  timeout: float = 900,
  stripes: int = 1,
) -> ProbeResult:
  """Write and read bandwidth of ``directory`` through the engine (cached; see the module doc).

  ``raw=True`` also measures plain O_DIRECT pwrite/pread. ``bandwidth_cap`` emulates a slower
  array (bytes/s or e.g. ``"7GB/s"``); None measures the device as it is. ``stripes`` > 1
  stripes the engine's bytes over that many files (subdirectories ``stripe<i>`` of
  ``directory``), as a store configured with several directories does: on tmpfs, writes to one
  file are serialised by its inode lock, so a RAM store needs several to go past one copy loop.
  """
  key = _Request.make(directory, size, threads, tensor_bytes, bandwidth_cap, stripes)
  if not refresh:
    hit = _cache_get(key, raw)
    if hit is not None:
      return dataclasses.replace(hit, cached=True)
  need = key.size + (64 * MiB)
  free = shutil.disk_usage(key.directory).free
  if need > free:
    raise ValueError(
      f"size={key.size} ({key.size / GiB:.2f} GiB): the probe needs {need} bytes "
      f"free in {key.directory!r}, which has {free}"
    )
  request = dataclasses.asdict(key) | {"raw": raw}
  env = dict(os.environ)
  package_root = str(Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
  env["JAX_PLATFORMS"] = "cpu"  # the worker computes nothing: it must not take GPU memory
  cmd = [sys.executable, "-m", "jax_ssdtrain.probe", "--worker", json.dumps(request)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    raise TimeoutError(f"probe of {key.directory!r} did not finish in {timeout:.0f} s") from None
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    raise OSError(
      _errno.EIO,
      f"probe of {key.directory!r} failed (exit status "
      f"{proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}",
    )
  result = ProbeResult(**json.loads(lines[-1]))
  _cache_put(key, result)
  return result


def measure_disk_duplex(
  directory: str | os.PathLike, size: int | str = 1 * GiB, *, threads: int = 8
) -> DiskDuplexResult:
  """Reads ``size`` bytes of ``directory`` while it writes ``size`` others (plain pwrite/pread
  of RAW_BLOCK blocks on an unlinked file, O_DIRECT where the filesystem allows it; half of
  ``threads`` each way), after writing the bytes read. Needs ``2 * size`` bytes free."""
  size = parse_size(size)
  _positive("size", size)
  if threads < 2:
    raise ValueError(f"threads={threads}: at least 2 (one reads while one writes)")
  blocks = max(1, size // RAW_BLOCK)
  size = blocks * RAW_BLOCK
  directory = os.path.realpath(os.fspath(directory))
  free = shutil.disk_usage(directory).free
  if 2 * size + 64 * MiB > free:
    raise ValueError(
      f"size={size} ({size / GiB:.2f} GiB): the duplex probe needs {2 * size + 64 * MiB} bytes "
      f"free in {directory!r}, which has {free}"
    )
  fd, direct = _open_private(directory)
  bufs = [mmap.mmap(-1, RAW_BLOCK) for _ in range(threads)]  # page aligned
  try:
    for b in bufs:
      b.write(os.urandom(RAW_BLOCK))
    half = threads // 2
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for f in [pool.submit(_blocks, fd, bufs[t], True, t, half, blocks, 0) for t in range(half)]:
        f.result()
      os.fsync(fd)
      done: dict[bool, list[float]] = {True: [], False: []}  # each thread's end

      def side(write: bool, t: int, n: int) -> None:
        first = 0 if write else half
        _blocks(fd, bufs[first + t], write, t, n, blocks, size if write else 0)
        done[write].append(time.perf_counter())

      t0 = time.perf_counter()
      futures = [pool.submit(side, True, t, half) for t in range(half)]
      futures += [pool.submit(side, False, t, threads - half) for t in range(threads - half)]
      for f in futures:
        f.result()
      os.fsync(fd)
      end = time.perf_counter()
  finally:
    os.close(fd)
    for b in bufs:
      b.close()
  return DiskDuplexResult(
    directory=directory,
    size=size,
    threads=threads,
    seconds=end - t0,
    read_gbps=size / (max(done[False]) - t0) / 1e9,
    write_gbps=size / (end - t0) / 1e9,  # its fsync included
    o_direct=direct,
  )


def _blocks(fd: int, buf, write: bool, t: int, stride: int, blocks: int, base: int) -> None:
  """Blocks t, t + stride, ... of ``blocks`` RAW_BLOCK blocks from file offset ``base``, each
  written from (or read into) ``buf``; a transfer of 0 bytes raises."""
  view = memoryview(buf)
  for i in range(t, blocks, stride):
    off, moved = base + i * RAW_BLOCK, 0
    while moved < RAW_BLOCK:
      n = (
        os.pwrite(fd, view[moved:], off + moved)
        if write
        else os.preadv(fd, [view[moved:]], off + moved)
      )
      if n <= 0:
        raise OSError(
          _errno.EIO,
          f"raw probe: {'pwrite' if write else 'pread'} moved 0 bytes at offset {off + moved}",
        )
      moved += n


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
  from jax_ssdtrain._src import native

  if host not in native.LINK_HOST_KINDS:
    raise ValueError(f"host: expected one of {sorted(native.LINK_HOST_KINDS)}, got {host!r}")
  nbytes = parse_size(size, what="size")
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats: expected a positive integer, got {repeats!r}")
  if isinstance(device, bool) or not isinstance(device, int) or device < 0:
    raise ValueError(f"device: expected a CUDA ordinal >= 0, got {device!r}")
  kind = _gpu_kind(device)
  key = f"link|{os.uname().nodename}|{kind}|ordinal={device}|size={nbytes}|host={host}"
  if not refresh:
    entry = _cache_load().get(key)
    try:
      if isinstance(entry, dict):
        return dataclasses.replace(LinkResult(**entry), cached=True)
    except TypeError:  # written by another version
      pass
  rates = native.probe_link(device, nbytes, repeats, host)
  result = LinkResult(
    device,
    kind,
    nbytes,
    rates.d2h,
    rates.h2d,
    rates.duplex_d2h,
    rates.duplex_h2d,
    host,
    measured_at=time.time(),
  )
  _cache_write(key, dataclasses.asdict(result) | {"cached": False})
  return result


def _gpu_kind(device: int) -> str:
  """The model of CUDA GPU ``device`` as JAX names it (without JAX: "cuda:<ordinal>")."""
  try:
    import jax

    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  except (ImportError, RuntimeError):
    gpus = []
  return gpus[device].device_kind if device < len(gpus) else f"cuda:{device}"


def stripe_directories(directory: str | os.PathLike, stripes: int) -> list[str]:
  """The store directories of ``directory`` striped over ``stripes`` files: the directory
  itself for one, else its subdirectories ``stripe0`` ... (the layout :func:`measure` probes)."""
  if stripes <= 1:
    return [os.fspath(directory)]
  return [os.path.join(directory, f"stripe{i}") for i in range(stripes)]


def recommend(
  results: Sequence[ProbeResult], *, step_ms: float | None = None, bytes_per_step: int | None = None
) -> Recommendation:
  """Settings from probe results at one or more thread counts.

  Threads: the fewest whose slower direction is within 5% of the best. Bytes per step that fit:
  the store must write them and read them back within the step, one direction after the other
  on a shared device: ``step / (1/W + 1/R)``. Host cache: the forward pass (a third of the
  step) produces the bytes faster than the store drains them; the backlog plus the read-ahead
  stay in the cache. Read-ahead: a tenth of a step of reading. Host tier: the bytes per step
  beyond the fit. Staging: two tensors.
  """
  if not results:
    raise ValueError("recommend: no probe results")
  best = max(min(r.write_gbps, r.read_gbps) for r in results)
  pick = min(
    (r for r in results if min(r.write_gbps, r.read_gbps) >= 0.95 * best), key=lambda r: r.threads
  )
  w, r = pick.write_gbps * 1e9, pick.read_gbps * 1e9
  notes = []
  fit = None
  prefetch = 256 * MiB
  cache = 1 * GiB
  tier = 0
  if step_ms is not None:
    step = step_ms / 1e3
    fit = int(step / (1 / w + 1 / r))
    prefetch = max(prefetch, _round_mib(r * step / 10))
    if bytes_per_step is not None:
      backlog = max(0, bytes_per_step - w * step / 3)
      cache = max(cache, _round_mib(backlog + prefetch))
      tier = _round_mib(max(0, bytes_per_step - fit))
      if tier:
        notes.append(
          f"{bytes_per_step / 1e9:.2f} GB per step is more than the store moves in "
          f"{step_ms:g} ms ({fit / 1e9:.2f} GB): put {tier / 1e9:.2f} GB in the host "
          f"tier (or recompute it), or expect stalls"
        )
  if pick.bandwidth_cap:
    notes.append(
      f"bandwidth capped at {pick.bandwidth_cap / 1e9:.2f} GB/s per direction (emulation)"
    )
  if not pick.o_direct:
    notes.append("O_DIRECT is not available here: buffered I/O (page cache) was measured")
  if pick.raw_write_gbps and pick.raw_read_gbps and not pick.bandwidth_cap:
    for io, eng, raw in (
      ("write", pick.write_gbps, pick.raw_write_gbps),
      ("read", pick.read_gbps, pick.raw_read_gbps),
    ):
      if eng < 0.8 * raw:
        notes.append(
          f"engine {io} {eng:.2f} GB/s is below 80% of raw {raw:.2f} GB/s: try more "
          f"io_threads or a larger chunk_bytes"
        )
  return Recommendation(
    io_threads=pick.threads,
    write_gbps=pick.write_gbps,
    read_gbps=pick.read_gbps,
    fit_bytes_per_step=fit,
    host_cache_bytes=cache,
    prefetch_bytes=prefetch,
    host_tier_bytes=tier,
    staging_bytes=max(256 * MiB, 2 * pick.tensor_bytes),
    notes=tuple(notes),
  )


def wear(
  bytes_per_step: int,
  *,
  step_ms: float | None = None,
  steps_per_day: float | None = None,
  tbw: float | None = None,
  dwpd: float | None = None,
  capacity_bytes: int | None = None,
  warranty_years: float = 5.0,
) -> Wear:
  """TB written per day and days to the drive's rated endurance.

  Steps per day: ``steps_per_day`` or 86400 s / step. Rated endurance: ``tbw`` (TB) or
  ``dwpd`` x capacity x 365 x ``warranty_years``.
  """
  _positive("bytes_per_step", bytes_per_step, zero=True)
  if steps_per_day is None:
    if step_ms is None:
      raise ValueError("wear: give step_ms or steps_per_day")
    _positive("step_ms", step_ms)
    steps_per_day = 86400e3 / step_ms
  _positive("steps_per_day", steps_per_day)
  for name, v in (("tbw", tbw), ("dwpd", dwpd), ("capacity_bytes", capacity_bytes)):
    if v is not None:
      _positive(name, v)
  _positive("warranty_years", warranty_years)
  if tbw is not None and dwpd is not None:
    raise ValueError(f"wear: give tbw={tbw!r} or dwpd={dwpd!r}, not both")
  if dwpd is not None and capacity_bytes is None:
    raise ValueError(f"wear: dwpd={dwpd!r} needs capacity_bytes (the drive's size)")
  tb_day = bytes_per_step * steps_per_day / 1e12
  rated = (
    tbw
    if tbw is not None
    else (dwpd * capacity_bytes / 1e12 * 365 * warranty_years if dwpd is not None else None)
  )
  return Wear(
    bytes_per_step=int(bytes_per_step),
    steps_per_day=steps_per_day,
    tb_per_day=tb_day,
    rated_tbw=rated,
    days_to_rated=(
      rated / tb_day
      if rated is not None and tb_day > 0
      else (math.inf if rated is not None else None)
    ),
    drive_writes_per_day=tb_day / (capacity_bytes / 1e12) if capacity_bytes else None,
  )


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse_args(argv)
  if args.worker:
    print(json.dumps(_work(json.loads(args.worker))), flush=True)
    return 0
  if args.link:
    return _link_main(args)
  bytes_per_step, step_ms = args.bytes_per_step, args.step_ms
  try:
    if args.plan:
      plan_bytes, plan_ms = _read_plan(args.plan)
      bytes_per_step = bytes_per_step if bytes_per_step is not None else plan_bytes
      step_ms = step_ms if step_ms is not None else plan_ms
    results = [
      measure(
        args.directory,
        args.size,
        threads=t,
        tensor_bytes=args.tensor_size,
        bandwidth_cap=args.bandwidth_cap,
        raw=args.raw,
        refresh=args.refresh,
        stripes=args.stripes,
      )
      for t in args.threads
    ]
    rec = recommend(results, step_ms=step_ms, bytes_per_step=bytes_per_step)
    worn = None
    if bytes_per_step is not None and (step_ms is not None or args.steps_per_day is not None):
      worn = wear(
        bytes_per_step,
        step_ms=step_ms,
        steps_per_day=args.steps_per_day,
        tbw=args.tbw,
        dwpd=args.dwpd,
        capacity_bytes=args.capacity,
        warranty_years=args.warranty_years,
      )
  except (OSError, ValueError) as e:
    print(f"probe: error: {e}", file=sys.stderr)
    return 1
  if args.json:
    print(
      json.dumps(
        {
          "results": [dataclasses.asdict(r) for r in results],
          "recommendation": dataclasses.asdict(rec),
          "wear": dataclasses.asdict(worn) if worn else None,
          "step_ms": step_ms,
          "bytes_per_step": bytes_per_step,
        },
        indent=1,
      )
    )
  else:
    print(_report(results, rec, worn, step_ms))
  return 0


# ---------------------------------------------------------------------------------------------
# Implementation


@dataclasses.dataclass(frozen=True)
class _Request:
  directory: str
  device: int
  size: int
  threads: int
  tensor_bytes: int
  bandwidth_cap: int | None
  stripes: int = 1

  @classmethod
  def make(
    cls, directory, size, threads, tensor_bytes, bandwidth_cap, stripes: int = 1
  ) -> _Request:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
      raise ValueError(f"directory: expected a path, got {directory!r}")
    path = os.path.realpath(os.fspath(directory))
    if not os.path.lexists(path):  # created as the store would create it (private, 0700)
      try:
        os.makedirs(path, mode=0o700, exist_ok=True)
      except OSError as e:
        raise type(e)(
          e.errno, f"probe directory {os.fspath(directory)!r} cannot be created: {e.strerror}"
        ) from None
    if not os.path.isdir(path):
      raise NotADirectoryError(
        _errno.ENOTDIR, f"probe directory {os.fspath(directory)!r} is not a directory"
      )
    if not os.access(path, os.W_OK | os.X_OK):
      raise PermissionError(
        _errno.EACCES, f"probe directory {os.fspath(directory)!r} is not writable"
      )
    size_b = parse_size(size, what="size")
    tensor_b = parse_size(tensor_bytes, what="tensor_bytes")
    if tensor_b < 4096 or tensor_b % 4096:
      raise ValueError(f"tensor_bytes: expected a positive multiple of 4096, got {tensor_bytes!r}")
    if size_b < tensor_b:
      raise ValueError(f"size: expected at least tensor_bytes ({tensor_b}), got {size!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
      raise ValueError(f"threads: expected an integer in [1, 256], got {threads!r}")
    if isinstance(stripes, bool) or not isinstance(stripes, int) or not 1 <= stripes <= 64:
      raise ValueError(f"stripes: expected an integer in [1, 64], got {stripes!r}")
    return cls(
      path,
      os.stat(path).st_dev,
      size_b,
      threads,
      tensor_b,
      parse_bandwidth(bandwidth_cap, what="bandwidth_cap"),
      stripes,
    )

  def cache_key(self) -> str:
    # Keyed by the filesystem (its mount point and device), not the directory: every directory
    # of one filesystem has its bandwidth, and the store's private temp dir is new each run.
    return (
      f"{_mount_point(self.directory)}|dev={self.device}|size={self.size}|"
      f"threads={self.threads}|"
      f"tensor={self.tensor_bytes}|cap={self.bandwidth_cap or 0}"
      + (f"|stripes={self.stripes}" if self.stripes > 1 else "")
    )


def _mount_point(path: str) -> str:
  """The mount point of the filesystem holding ``path``."""
  path = os.path.realpath(path)
  dev = os.stat(path).st_dev
  while path != os.path.dirname(path):
    parent = os.path.dirname(path)
    try:
      if os.stat(parent).st_dev != dev:
        break
    except OSError:
      break
    path = parent
  return path


def _cache_path() -> Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jax_ssdtrain" / "probe.json"


def _cache_load() -> dict:
  try:
    doc = json.loads(_cache_path().read_text())
  except (OSError, ValueError):
    return {}
  return doc if isinstance(doc, dict) else {}


def _cache_get(key: _Request, raw: bool) -> ProbeResult | None:
  entry = _cache_load().get(key.cache_key())
  try:
    result = ProbeResult(**entry) if isinstance(entry, dict) else None
  except TypeError:  # written by another version
    return None
  if result is None or (raw and result.raw_write_gbps is None):
    return None
  return result


def _cache_put(key: _Request, result: ProbeResult) -> None:
  _cache_write(key.cache_key(), dataclasses.asdict(result) | {"cached": False})


def _cache_write(key: str, entry: dict) -> None:
  path = _cache_path()
  doc = _cache_load()
  doc[key] = entry
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
  except OSError as e:  # a cache that cannot be written only costs a new measurement
    print(f"jax_ssdtrain.probe: cannot write the cache {path}: {e}", file=sys.stderr)


def _work(req: dict) -> dict:
  """Child process: the engine measurement, then (raw=True) the raw one."""
  import warnings

  import numpy as np

  import jax_ssdtrain as ssd
  from jax_ssdtrain._src import native

  size, tensor, threads = req["size"], req["tensor_bytes"], req["threads"]
  n = size // tensor
  cache = min(1 * GiB, max(4 * tensor, size // 4))
  stripes = req.get("stripes", 1)
  dirs = stripe_directories(req["directory"], stripes)
  made = [d for d in dirs if not os.path.isdir(d)]
  for d in made:
    os.makedirs(d)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # no O_DIRECT on tmpfs: recorded below
    ssd.configure(
      dirs,
      capacity_bytes=n * tensor + 16 * MiB * stripes,
      io_threads=threads,
      host_cache_bytes=cache,
      prefetch_bytes=cache // 2,
      host_tier_bytes=0,
      forwarding=False,
      on_full="error",
      verify=False,
      bandwidth_cap=req["bandwidth_cap"],
    )
  src = np.random.default_rng(0).integers(0, 256, tensor, dtype=np.uint8)
  dst = np.zeros_like(src)
  try:
    # Untimed pass: the file space and host cache exist before timing (a training step
    # overwrites the space of the previous one).
    for i in range(n):
      native.store_host(src.ctypes.data, tensor, i)
    ssd.flush()
    ssd.release_all()
    ssd.reset_stats()
    t0 = time.perf_counter()
    handles = [native.store_host(src.ctypes.data, tensor, i) for i in range(n)]
    ssd.flush()
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in reversed(range(n)):  # the order of a backward pass
      native.load_host(handles[i], dst.ctypes.data, tensor, i)
    t_read = time.perf_counter() - t0
    s = ssd.stats()
    if not np.array_equal(src, dst):
      raise OSError(_errno.EIO, "probe: the bytes read back differ from those written")
    if s["disk_bytes_read"] < n * tensor:
      raise OSError(
        _errno.EIO,
        f"probe: only {s['disk_bytes_read']} of {n * tensor} bytes were read from the store file",
      )
  finally:
    ssd.shutdown()
    for d in made:
      try:
        os.rmdir(d)
      except OSError:
        pass
  out = dict(
    directory=req["directory"],
    device=req["device"],
    size=n * tensor,
    threads=threads,
    stripes=stripes,
    tensor_bytes=tensor,
    bandwidth_cap=req["bandwidth_cap"],
    write_gbps=n * tensor / t_write / 1e9,
    read_gbps=n * tensor / t_read / 1e9,
    engine_write_gbps=s["write_GBps"],
    engine_read_gbps=s["read_GBps"],
    o_direct=bool(s["o_direct"]),
    backend=str(s["backend"]),
    measured_at=time.time(),
  )
  if req["raw"]:
    w, r, direct = _raw(req["directory"], n * tensor, threads)
    out |= dict(raw_write_gbps=w, raw_read_gbps=r, raw_o_direct=direct)
  return out


def _raw(directory: str, size: int, threads: int) -> tuple[float, float, bool]:
  """Plain pwrite then pread of ``size`` bytes in RAW_BLOCK blocks over ``threads`` threads, on
  an unlinked file opened with O_DIRECT (buffered where the filesystem refuses it)."""
  fd, direct = _open_private(directory)
  blocks = size // RAW_BLOCK
  bufs = [mmap.mmap(-1, RAW_BLOCK) for _ in range(threads)]  # page aligned
  for b in bufs:
    b.write(os.urandom(RAW_BLOCK))

  def timed(write: bool) -> float:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for f in [
        pool.submit(_blocks, fd, bufs[t], write, t, threads, blocks, 0) for t in range(threads)
      ]:
        f.result()
    if write:
      os.fsync(fd)
    return blocks * RAW_BLOCK / (time.perf_counter() - t0) / 1e9

  try:
    return timed(True), timed(False), direct
  finally:
    os.close(fd)
    for b in bufs:
      b.close()


def _open_private(directory: str) -> tuple[int, bool]:
  """An unlinked read-write file in ``directory``: (fd, O_DIRECT on)."""
  try:
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
  except (AttributeError, OSError):
    fd_, path = tempfile.mkstemp(dir=directory, prefix=".ssdtrain-probe-")
    os.unlink(path)
    fd = fd_
  import fcntl

  flags = fcntl.fcntl(fd, fcntl.F_GETFL)
  try:
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    return fd, True
  except OSError:
    return fd, False


def _round_mib(n: float) -> int:
  return int(math.ceil(n / MiB)) * MiB


def _positive(name: str, value, zero: bool = False) -> None:
  ok = (
    not isinstance(value, bool)
    and isinstance(value, (int, float))
    and math.isfinite(value)
    and (value >= 0 if zero else value > 0)
  )
  if not ok:
    raise ValueError(
      f"{name}: expected a {'non-negative' if zero else 'positive'} number, got {value!r}"
    )


def _read_plan(path: str) -> tuple[int | None, float | None]:
  """Bytes written per step and step time (ms) of a plan JSON (PLAN_*_KEYS)."""
  try:
    doc = json.loads(Path(path).read_text())
  except OSError as e:
    raise OSError(e.errno, f"--plan {path!r}: {e.strerror}") from None
  except ValueError as e:
    raise ValueError(f"--plan {path!r} is not JSON: {e}") from None
  scopes = [doc] + [v for v in doc.values() if isinstance(v, dict)] if isinstance(doc, dict) else []
  pick = lambda keys: next((s[k] for s in scopes for k in keys if k in s), None)  # noqa: E731
  nbytes, step_ms = pick(PLAN_BYTES_KEYS), pick(PLAN_STEP_KEYS)
  if nbytes is None:
    raise ValueError(
      f"--plan {path!r}: none of the keys {list(PLAN_BYTES_KEYS)} (top level or one level down)"
    )
  _positive(f"--plan {path!r}: bytes per step", nbytes, zero=True)
  if step_ms is not None:
    _positive(f"--plan {path!r}: step_ms", step_ms)
  return int(nbytes), step_ms


def _fmt_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _report(
  results: Sequence[ProbeResult], rec: Recommendation, worn: Wear | None, step_ms: float | None
) -> str:
  r0 = results[0]
  lines = [
    f"store {r0.directory} (device {r0.device}), {r0.size / GiB:.2f} GiB in "
    f"{r0.tensor_bytes // MiB} MiB tensors, backend {r0.backend}, "
    f"O_DIRECT {'on' if r0.o_direct else 'off'}"
    + (f", cap {r0.bandwidth_cap / 1e9:.2f} GB/s" if r0.bandwidth_cap else ""),
    "",
  ]
  head = (
    "threads",
    "write GB/s",
    "read GB/s",
    "engine busy w/r",
    "raw write",
    "raw read",
    "cached",
  )
  rows = [
    (
      str(r.threads),
      f"{r.write_gbps:.2f}",
      f"{r.read_gbps:.2f}",
      f"{r.engine_write_gbps:.2f}/{r.engine_read_gbps:.2f}",
      "-" if r.raw_write_gbps is None else f"{r.raw_write_gbps:.2f}",
      "-" if r.raw_read_gbps is None else f"{r.raw_read_gbps:.2f}",
      "yes" if r.cached else "no",
    )
    for r in results
  ]
  widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
  lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [head] + rows]
  lines += [
    "",
    "recommended settings:",
    f"  io_threads       {rec.io_threads}",
    f"  host_cache_bytes {_fmt_bytes(rec.host_cache_bytes)}",
    f"  prefetch_bytes   {_fmt_bytes(rec.prefetch_bytes)}",
    f"  host_tier_bytes  {_fmt_bytes(rec.host_tier_bytes)}",
    f"  staging_bytes    {_fmt_bytes(rec.staging_bytes)}",
  ]
  if rec.fit_bytes_per_step is not None:
    lines.append(
      f"  fits per step    {rec.fit_bytes_per_step / 1e9:.2f} GB written and read "
      f"back in {step_ms:g} ms (at {rec.write_gbps:.2f} / {rec.read_gbps:.2f} GB/s)"
    )
  else:
    lines.append("  fits per step    (give --step-ms)")
  lines += [f"  note: {n}" for n in rec.notes]
  if worn is not None:
    lines += [
      "",
      "SSD wear:",
      f"  {worn.bytes_per_step / 1e9:.3f} GB written per step x "
      f"{worn.steps_per_day:,.0f} steps/day = {worn.tb_per_day:.2f} TB/day",
    ]
    if worn.drive_writes_per_day is not None:
      lines.append(f"  {worn.drive_writes_per_day:.2f} drive writes per day")
    if worn.rated_tbw is not None:
      days = worn.days_to_rated
      when = "never" if math.isinf(days) else f"{days:,.0f} days ({days / 365:.1f} years)"
      lines.append(f"  rated endurance {worn.rated_tbw:,.0f} TBW reached in {when}")
    else:
      lines.append("  (give --tbw, or --dwpd and --capacity, for days to rated endurance)")
  return "\n".join(lines)


def _arg(parse, what: str):
  """An argparse type from parse_size / parse_bandwidth."""

  def convert(text: str):
    try:
      return parse(text, what=what)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None

  return convert


def _threads(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or any(not 1 <= v <= 256 for v in values):
    raise argparse.ArgumentTypeError(
      f"--threads: expected integers in [1, 256] separated by commas, got {text!r}"
    )
  return sorted(set(values))


def _number(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value <= 0:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
  return value


def _link_main(args) -> int:
  size = args.size if args.size != DEFAULT_SIZE else 1 * GiB
  try:
    r = measure_link(args.device, size, host=args.host_memory, refresh=args.refresh)
  except (OSError, ValueError) as e:
    print(f"probe: error: {e}", file=sys.stderr)
    return 1
  if args.json:
    print(json.dumps(dataclasses.asdict(r)))  # one line: bench_rok.py reads it
  else:
    print(
      f"GPU {r.device} ({r.device_kind}), pinned copies of {_fmt_bytes(r.size)} "
      f"({r.host} host memory)"
      f"{' (cached)' if r.cached else ''}:\n"
      f"  device -> host {r.d2h_gbps:6.1f} GB/s alone, {r.duplex_d2h_gbps:6.1f} while both run\n"
      f"  host -> device {r.h2d_gbps:6.1f} GB/s alone, {r.duplex_h2d_gbps:6.1f} while both run"
    )
  return 0


def _plain(doc: str) -> str:
  """A docstring as plain text for --help (no reStructuredText roles or literals)."""
  doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
  return doc.replace("``", "")


def _parse_args(argv):
  p = argparse.ArgumentParser(
    prog="python -m jax_ssdtrain.probe",
    description=_plain(__doc__),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument(
    "directory",
    nargs="?",
    help="store directory to measure (created, private, if it does not exist)",
  )
  p.add_argument(
    "--size",
    type=_arg(parse_size, "--size"),
    default=DEFAULT_SIZE,
    help="bytes written and read per measurement (default 4GiB)",
  )
  p.add_argument(
    "--threads",
    type=_threads,
    default=[4, 8, 16],
    help="engine I/O thread counts to try (default 4,8,16)",
  )
  p.add_argument(
    "--tensor-size",
    type=_arg(parse_size, "--tensor-size"),
    default=DEFAULT_TENSOR,
    help="size of one stored tensor (default 64MiB)",
  )
  p.add_argument(
    "--bandwidth-cap",
    type=_arg(parse_bandwidth, "--bandwidth-cap"),
    default=None,
    help="measure the store capped at this rate (e.g. 7GB/s: emulation)",
  )
  p.add_argument(
    "--raw",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also measure raw O_DIRECT pwrite/pread (default on)",
  )
  p.add_argument(
    "--stripes",
    type=int,
    default=1,
    help="stripe the engine's bytes over N files in DIR/stripe<i> (RAM stores)",
  )
  p.add_argument("--refresh", action="store_true", help="measure again (ignore the cache)")
  p.add_argument("--step-ms", type=_number, help="training step time, ms")
  p.add_argument(
    "--bytes-per-step",
    type=_arg(parse_size, "--bytes-per-step"),
    help="bytes written to the store per step (e.g. 1.2GB)",
  )
  p.add_argument(
    "--plan",
    help=f"plan JSON giving one of {', '.join(PLAN_BYTES_KEYS)} (and "
    f"optionally {' or '.join(PLAN_STEP_KEYS)})",
  )
  p.add_argument("--steps-per-day", type=_number, help="default: 86400 s / step time")
  p.add_argument("--tbw", type=_number, help="drive's rated endurance, TB written")
  p.add_argument("--dwpd", type=_number, help="drive's rated drive writes per day")
  p.add_argument(
    "--capacity",
    type=_arg(parse_size, "--capacity"),
    help="drive capacity (with --dwpd), e.g. 3.84TB",
  )
  p.add_argument("--warranty-years", type=_number, default=5.0)
  p.add_argument("--json", action="store_true", help="print JSON instead of the table")
  p.add_argument(
    "--link",
    action="store_true",
    help="measure the PCIe link of a GPU (pinned host <-> device) instead of a "
    "directory (--size default 1GiB)",
  )
  p.add_argument("--device", type=int, default=0, help="CUDA ordinal for --link (default 0)")
  p.add_argument(
    "--host-memory",
    default="registered",
    choices=["registered", "alloc", "registered_hugepages"],
    help="--link: host buffers registered as the engine's arenas (default), "
    "cudaHostAlloc'ed, or registered on huge pages",
  )
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.link and args.directory:
    p.error("--link measures a GPU's link, not a directory: give one or the other")
  if not args.worker and not args.link and not args.directory:
    p.error("the store DIRECTORY to measure is required (or --link)")
  if args.tbw is not None and args.dwpd is not None:
    p.error("give --tbw or --dwpd, not both")
  if args.dwpd is not None and args.capacity is None:
    p.error("--dwpd needs --capacity")
  return args


if __name__ == "__main__":
  sys.exit(main())
