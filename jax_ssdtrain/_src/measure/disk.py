"""A store directory's bandwidth: through the engine (``measure``, run in a child process,
``worker``, and cached per filesystem and request in ``cache``), raw O_DIRECT (``raw_rates``,
run by the worker) and read and written at once (``measure_disk_duplex``, in this process, not
cached); the stripe layout a measurement probes; ``measured_bandwidth``, the planner's shorthand
for ``measure``'s two rates."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno as _errno
import fcntl
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jax_ssdtrain._src.measure import cache
from jax_ssdtrain._src.measure.checks import positive
from jax_ssdtrain._src.options import GiB, MiB, parse_bandwidth, parse_size

DEFAULT_SIZE = 4 * GiB
DEFAULT_TENSOR = 64 * MiB
RAW_BLOCK = 8 * MiB


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
  key = Request.make(directory, size, threads, tensor_bytes, bandwidth_cap, stripes)
  if not refresh:
    hit = cached(key, raw)
    if hit is not None:
      return hit
  _check_free(key.directory, key.size, key.size + 64 * MiB, "the probe")
  request = dataclasses.asdict(key) | {"raw": raw}
  env = dict(os.environ)
  package_root = str(Path(__file__).resolve().parents[3])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
  env["JAX_PLATFORMS"] = "cpu"  # the worker computes nothing: it must not take GPU memory
  cmd = [sys.executable, "-m", "jax_ssdtrain._src.measure.worker", json.dumps(request)]
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
  cache.remember(key.cache_key(), result)
  return result


def measured_bandwidth(
  directory: str | os.PathLike, nbytes: int = 256 << 20, *, tensor_bytes: int | None = None
) -> tuple[float, float]:
  """(write GB/s, read GB/s) of ``directory`` through the engine: a shorthand for
  ``jax_ssdtrain.probe.measure(directory, nbytes, tensor_bytes=...)``'s ``write_gbps`` and
  ``read_gbps``, ``nbytes`` written and read back in tensors of ``tensor_bytes`` (default:
  ``nbytes``, at most 64 MiB; both rounded down to 4096-byte multiples).

  Measured once per filesystem and size, then cached on disk (``probe.measure``'s cache).
  """
  path = os.path.realpath(os.fspath(directory))
  if not os.path.isdir(path):
    raise ValueError(f"directory: {directory!r} is not a directory")
  _check_int("nbytes", nbytes, low=4096)
  size = nbytes // 4096 * 4096
  if tensor_bytes is None:
    tensor_bytes = min(size, 64 << 20)
  _check_int("tensor_bytes", tensor_bytes, low=4096)
  result = measure(path, size=size, tensor_bytes=min(size, tensor_bytes // 4096 * 4096))
  return result.write_gbps, result.read_gbps


def _check_int(what: str, value, low: int = 0) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{what}: expected an integer >= {low}, got {value!r}")


def measure_disk_duplex(
  directory: str | os.PathLike, size: int | str = 1 * GiB, *, threads: int = 8
) -> DiskDuplexResult:
  """Reads ``size`` bytes of ``directory`` while it writes ``size`` others (plain pwrite/pread
  of RAW_BLOCK blocks on an unlinked file, O_DIRECT where the filesystem allows it; half of
  ``threads`` each way), after writing the bytes read. Needs ``2 * size`` bytes free."""
  size = parse_size(size)
  positive("size", size)
  if threads < 2:
    raise ValueError(f"threads={threads}: at least 2 (one reads while one writes)")
  blocks = max(1, size // RAW_BLOCK)
  size = blocks * RAW_BLOCK
  directory = os.path.realpath(os.fspath(directory))
  _check_free(directory, size, 2 * size + 64 * MiB, "the duplex probe")
  with _raw_file(directory, threads) as (fd, direct, bufs):
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
  return DiskDuplexResult(
    directory=directory,
    size=size,
    threads=threads,
    seconds=end - t0,
    read_gbps=size / (max(done[False]) - t0) / 1e9,
    write_gbps=size / (end - t0) / 1e9,  # its fsync included
    o_direct=direct,
  )


def stripe_directories(directory: str | os.PathLike, stripes: int) -> list[str]:
  """The store directories of ``directory`` striped over ``stripes`` files: the directory
  itself for one, else its subdirectories ``stripe0`` ... (the layout :func:`measure` probes)."""
  if stripes <= 1:
    return [os.fspath(directory)]
  return [os.path.join(directory, f"stripe{i}") for i in range(stripes)]


def raw_rates(directory: str, size: int, threads: int) -> tuple[float, float, bool]:
  """Plain pwrite then pread of ``size`` bytes in RAW_BLOCK blocks over ``threads`` threads, on
  an unlinked file opened with O_DIRECT (buffered where the filesystem refuses it)."""
  blocks = size // RAW_BLOCK

  def timed(fd: int, bufs: list, write: bool) -> float:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for f in [
        pool.submit(_blocks, fd, bufs[t], write, t, threads, blocks, 0) for t in range(threads)
      ]:
        f.result()
    if write:
      os.fsync(fd)
    return blocks * RAW_BLOCK / (time.perf_counter() - t0) / 1e9

  with _raw_file(directory, threads) as (fd, direct, bufs):
    return timed(fd, bufs, True), timed(fd, bufs, False), direct


@contextlib.contextmanager
def _raw_file(directory: str, buffers: int):
  """The raw probes' file and buffers: ``(fd, O_DIRECT on, bufs)``, an unlinked file of
  ``directory`` (:func:`open_private`) and ``buffers`` page-aligned RAW_BLOCK buffers of random
  bytes, all closed when the block is left."""
  fd, direct = open_private(directory)
  bufs: list[mmap.mmap] = []
  try:
    bufs = [mmap.mmap(-1, RAW_BLOCK) for _ in range(buffers)]  # page aligned
    for b in bufs:
      b.write(os.urandom(RAW_BLOCK))
    yield fd, direct, bufs
  finally:
    os.close(fd)
    for b in bufs:
      b.close()


def _check_free(directory: str, size: int, need: int, what: str) -> None:
  """ValueError unless ``directory``'s filesystem has ``need`` bytes free for ``what`` (a probe
  of ``size`` bytes)."""
  free = shutil.disk_usage(directory).free
  if need > free:
    raise ValueError(
      f"size={size} ({size / GiB:.2f} GiB): {what} needs {need} bytes free in {directory!r}, "
      f"which has {free}"
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


def open_private(directory: str) -> tuple[int, bool]:
  """An unlinked read-write file in ``directory``: (fd, O_DIRECT on)."""
  try:
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
  except (AttributeError, OSError):
    fd_, path = tempfile.mkstemp(dir=directory, prefix=".ssdtrain-probe-")
    os.unlink(path)
    fd = fd_
  flags = fcntl.fcntl(fd, fcntl.F_GETFL)
  try:
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    return fd, True
  except OSError:
    return fd, False


# ---------------------------------------------------------------------------------------------
# The request and its cache entry


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked ``measure`` request (the directory created if missing); what the worker gets."""

  directory: str
  device: int
  size: int
  threads: int
  tensor_bytes: int
  bandwidth_cap: int | None
  stripes: int = 1

  @classmethod
  def make(cls, directory, size, threads, tensor_bytes, bandwidth_cap, stripes: int = 1) -> Request:
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
      f"{mount_point(self.directory)}|dev={self.device}|size={self.size}|"
      f"threads={self.threads}|"
      f"tensor={self.tensor_bytes}|cap={self.bandwidth_cap or 0}"
      + (f"|stripes={self.stripes}" if self.stripes > 1 else "")
    )


def mount_point(path: str) -> str:
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


def cached(key: Request, raw: bool) -> ProbeResult | None:
  """The cached result of ``key``, marked ``cached`` (None where none, or without the raw rates
  ``raw`` asks)."""
  result = cache.entry(key.cache_key(), ProbeResult)
  if result is None or (raw and result.raw_write_gbps is None):
    return None
  return result
