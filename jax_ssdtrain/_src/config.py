"""The process-wide store: configuration, defaults from ``SSDTRAIN_*`` variables, statistics.

``configure()`` (re)creates the engine of this process; the first offloading program configures
it from the defaults when nobody has. Defaults come from environment variables:

=========================== ======================================== =====================
variable                    option                                   default
=========================== ======================================== =====================
``SSDTRAIN_DIR``            ``directory`` (``:``-separated: striped)  private temp dir
``SSDTRAIN_CAPACITY``       ``capacity_bytes`` (file space, total)    90% of free space
``SSDTRAIN_HOST_CACHE``     ``host_cache_bytes`` (write-behind,       1 GiB
                            forwarding and read-ahead buffers)
``SSDTRAIN_HOST_TIER``      ``host_tier_bytes`` (``host`` location)   8 GiB
``SSDTRAIN_STAGING``        ``staging_bytes`` (GPU staging arena)     1 GiB
``SSDTRAIN_IO_THREADS``     ``io_threads``                            8
``SSDTRAIN_CHUNK``          ``chunk_bytes`` (one I/O request)         8 MiB
``SSDTRAIN_PREFETCH``       ``prefetch_bytes`` (read-ahead budget)    1 GiB
``SSDTRAIN_O_DIRECT``       ``o_direct`` (auto / on / off)            auto
``SSDTRAIN_GDS``            ``gds`` (auto / on / off)                 auto
``SSDTRAIN_FORWARDING``     ``forwarding`` (on / off)                 on
``SSDTRAIN_ON_FULL``        ``on_full`` (error / keep)                error
``SSDTRAIN_VERIFY``         ``verify`` (crc32c checks, on / off)      off
``SSDTRAIN_EXACT_LOADS``    ``exact_loads`` (GPU loads read their     off
                            handle first instead of predicting it)
``SSDTRAIN_BANDWIDTH_CAP``  ``bandwidth_cap`` (bytes/s per direction  none
                            of the file I/O, e.g. ``7GB/s``)
=========================== ======================================== =====================

Sizes accept suffixes (``512MiB``, ``4G``, ``1.5GB``). Host memory is taken lazily, as used.

A directory may contain ``{process}`` (this process's index, ``jax.process_index()``: one
store per process of a multi-host job) and ``{device}`` (expanded to one directory per local
device, e.g. one NVMe drive per GPU: each device's tensors go to its own directory only, and
``capacity_bytes`` is split evenly; ``device_groups`` records it). Configure after
``jax.distributed.initialize()`` when using them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno as _errno
import os
import re
import shutil
import string
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from jax_ssdtrain._src import lifetimes, native

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class StoreConfig:
  """The store's settings. ``directories`` empty means a private temp dir removed at exit."""

  directories: tuple[str, ...] = ()
  capacity_bytes: int | None = None
  host_cache_bytes: int = 1 * GiB
  host_tier_bytes: int = 8 * GiB
  staging_bytes: int = 1 * GiB
  io_threads: int = 8
  chunk_bytes: int = 8 * MiB
  prefetch_bytes: int = 1 * GiB
  o_direct: bool | None = None
  gds: bool | None = None
  forwarding: bool = True
  on_full: str = "error"
  verify: bool = False
  exact_loads: bool = False
  bandwidth_cap: int | None = None  # bytes/s each way (emulates a slower array), None: no cap
  # Set by a ``{device}`` directory: directory i holds only local device i % device_groups's
  # tensors (its own files; capacity split evenly). 0: every tensor striped over all of them.
  device_groups: int = 0


class UnknownOptionError(TypeError, ValueError):
  """``configure()`` got an option it does not know (both a TypeError and a ValueError)."""


_ENV = {  # option -> (variable, parser)
  "directories": ("SSDTRAIN_DIR", lambda v: _directories([p for p in v.split(":") if p])),
  "device_groups": ("SSDTRAIN_DIR", lambda v: _device_groups([p for p in v.split(":") if p])),
  "capacity_bytes": ("SSDTRAIN_CAPACITY", lambda v: parse_size(v, what="SSDTRAIN_CAPACITY")),
  "host_cache_bytes": ("SSDTRAIN_HOST_CACHE", lambda v: parse_size(v, what="SSDTRAIN_HOST_CACHE")),
  "host_tier_bytes": ("SSDTRAIN_HOST_TIER", lambda v: parse_size(v, what="SSDTRAIN_HOST_TIER")),
  "staging_bytes": ("SSDTRAIN_STAGING", lambda v: parse_size(v, what="SSDTRAIN_STAGING")),
  "io_threads": ("SSDTRAIN_IO_THREADS", lambda v: _parse_int(v, what="SSDTRAIN_IO_THREADS")),
  "chunk_bytes": ("SSDTRAIN_CHUNK", lambda v: parse_size(v, what="SSDTRAIN_CHUNK")),
  "prefetch_bytes": ("SSDTRAIN_PREFETCH", lambda v: parse_size(v, what="SSDTRAIN_PREFETCH")),
  "o_direct": ("SSDTRAIN_O_DIRECT", lambda v: _parse_switch(v, what="SSDTRAIN_O_DIRECT")),
  "gds": ("SSDTRAIN_GDS", lambda v: _parse_switch(v, what="SSDTRAIN_GDS")),
  "forwarding": (
    "SSDTRAIN_FORWARDING",
    lambda v: _parse_switch(v, what="SSDTRAIN_FORWARDING", auto=False),
  ),
  "on_full": ("SSDTRAIN_ON_FULL", lambda v: v.lower()),
  "verify": ("SSDTRAIN_VERIFY", lambda v: _parse_switch(v, what="SSDTRAIN_VERIFY", auto=False)),
  "exact_loads": (
    "SSDTRAIN_EXACT_LOADS",
    lambda v: _parse_switch(v, what="SSDTRAIN_EXACT_LOADS", auto=False),
  ),
  "bandwidth_cap": (
    "SSDTRAIN_BANDWIDTH_CAP",
    lambda v: parse_bandwidth(v, what="SSDTRAIN_BANDWIDTH_CAP"),
  ),
}


def defaults() -> StoreConfig:
  """The configuration given by the environment (``SSDTRAIN_*``) over the built-in defaults."""
  values = {}
  for option, (var, parse) in _ENV.items():
    raw = os.environ.get(var)
    if raw is not None and raw.strip():
      values[option] = parse(raw.strip())
  return _validated(StoreConfig(**values))


def configure(
  directory: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
  capacity_bytes: int | str | None = None,
  **options: Any,
) -> StoreConfig:
  """(Re)creates this process's store and returns its configuration.

  ``directory``: one directory or a list (one per NVMe drive; tensors are striped across
  them); None keeps the current one (initially ``$SSDTRAIN_DIR`` or a private temp dir).
  ``capacity_bytes``: file space in all. Other options are the fields of :class:`StoreConfig`;
  sizes may be strings such as ``"4GiB"``. Reconfiguring drops every stored activation.
  """
  unknown = sorted(
    set(options) - {f.name for f in dataclasses.fields(StoreConfig)} - {"directories"}
  )
  if unknown:
    raise UnknownOptionError(
      f"configure: unknown option(s) {unknown}; known: "
      f"{[f.name for f in dataclasses.fields(StoreConfig)]}"
    )
  with _lock:
    base = _state.config if _state.config is not None else defaults()
    changes = dict(options)
    if directory is not None:
      changes["directories"] = _directories(directory)
      if "device_groups" not in options:  # else given explicitly: directory i -> device i % it
        changes["device_groups"] = _device_groups(directory)
    if capacity_bytes is not None:
      changes["capacity_bytes"] = capacity_bytes
    for key in (
      "capacity_bytes",
      "host_cache_bytes",
      "host_tier_bytes",
      "staging_bytes",
      "chunk_bytes",
      "prefetch_bytes",
    ):
      if isinstance(changes.get(key), str):
        changes[key] = parse_size(changes[key], what=key)
    if "bandwidth_cap" in changes:
      changes["bandwidth_cap"] = parse_bandwidth(changes["bandwidth_cap"], what="bandwidth_cap")
    cfg = _validated(dataclasses.replace(base, **changes))
    _apply(cfg)
    return cfg


def current() -> StoreConfig | None:
  """The configuration in force, or None before the store is first used."""
  return _state.config


def ensure_configured() -> StoreConfig:
  with _lock:
    if _state.config is None:
      _apply(defaults())
    return _state.config


@contextlib.contextmanager
def configured(directory=None, capacity_bytes=None, **options) -> Iterator[StoreConfig]:
  """Scoped configuration (for tests): the previous one is restored on exit."""
  previous = _state.config
  try:
    yield configure(directory, capacity_bytes, **options)
  finally:
    with _lock:
      if previous is None:
        _shutdown_locked()
      else:
        _apply(previous)


def store_directories() -> tuple[str, ...]:
  """The directories the store files live in now (the temp dir when none was given)."""
  cfg = ensure_configured()
  return cfg.directories or (_state.temp_dir,)


def stats() -> dict[str, float]:
  """Engine counters since the last :func:`reset_stats` (see the README for the keys)."""
  ensure_configured()
  s = native.stats()
  _warn_if_kept(s)
  s["write_GBps"] = (
    s["disk_bytes_written"] / s["write_seconds"] / 1e9 if s.get("write_seconds") else 0.0
  )
  s["read_GBps"] = s["disk_bytes_read"] / s["read_seconds"] / 1e9 if s.get("read_seconds") else 0.0
  return s


def timeline() -> list[dict[str, Any]]:
  """The GPU copies and waits of the latest steps (up to 32768, oldest first), then forgets
  them: ``{"op", "device", "bytes", "start", "end", "name"}`` with times in seconds of the
  host's monotonic clock. ``op``: ``stage_in`` (store: into device staging), ``d2h`` (staging
  to pinned host), ``read_ahead`` (pinned host to staging), ``load_staged`` / ``load_host``
  (load: from staging / from pinned host, on the compute stream) and ``compute_wait`` (the
  compute stream waited for staging room or a read-ahead). Waits for the copies already issued
  (call it between steps). Empty without a GPU.
  ``scripts/bench_rok.py --timeline`` writes one as a Chrome trace."""
  ensure_configured()
  return native.timeline()


def device_stats() -> dict[int, dict[str, int]]:
  """Per-device counters since :func:`reset_stats`: ``{device ordinal: {"bytes_written",
  "tensors_written", "bytes_read", "tensors_read"}}``, keyed by the ordinal XLA hands the
  custom call: the local CUDA ordinal on GPUs, the device id (``jax.Device.id``) on CPU."""
  ensure_configured()
  out: dict[int, dict[str, int]] = {}
  for key, value in native.stats().items():
    m = re.fullmatch(r"device(\d+)_(\w+)", key)
    if m:
      out.setdefault(int(m.group(1)), {})[m.group(2)] = int(value)
  return out


def flush() -> None:
  """Waits for the work already dispatched (every live ``jax.Array`` ready), then for the
  store's writes and reads, and releases what no program can load any more (a sweep, see
  :func:`collect`). After ``step(...); ssd.flush()``, ``stats()`` is exact for that step.

  Raises the error of a failed asynchronous write, if any.
  """
  if _state.config is not None:
    import jax

    jax.block_until_ready(lifetimes.live_arrays())
    native.flush()
    lifetimes.collect()
    _warn_if_kept(native.stats())


def collect() -> int:
  """Releases every stored tensor that no program can load any more and returns how many: those
  whose handle left the execution that stored them (a ``jax.vjp`` across jits, eager stores)
  and that no live ``jax.Array`` holds. Runs by itself in a background thread when such
  entries pile up; waits for the live arrays to be ready."""
  if _state.config is None:
    return 0
  return lifetimes.collect()


def reset_stats() -> None:
  ensure_configured()
  native.reset_stats()


def release_all() -> None:
  """Frees every stored activation (waits for in-flight I/O). Handles held become invalid."""
  if _state.config is not None:
    native.release_all()


def shutdown() -> None:
  """Closes the store and deletes its files (and the private temp dir)."""
  with _lock:
    _shutdown_locked()


def parse_size(value: int | str, *, what: str) -> int:
  """``"512MiB"``, ``"4G"``, ``"1.5GB"``, ``1048576`` -> bytes."""
  if isinstance(value, bool):
    raise ValueError(f"{what}: expected a size in bytes, got {value!r}")
  if isinstance(value, int):
    return value
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", str(value), re.IGNORECASE)
  if not m:
    raise ValueError(f"{what}: cannot read {value!r} as a size (e.g. 1048576, 512MiB, 4G)")
  number, prefix, suffix = m.groups()
  power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
  unit = (1024 if (suffix.lower().startswith("i") or suffix == "") else 1000) ** power
  return int(float(number) * unit)


def parse_bandwidth(value: int | float | str | None, *, what: str) -> int | None:
  """``"7GB/s"``, ``"512MiB/s"``, ``7e9`` -> bytes/s; None, ``"off"``, ``"none"`` -> None (no cap)."""
  if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off", "none")):
    return None
  if isinstance(value, bool):
    raise ValueError(f"{what}: expected a bandwidth in bytes/s (e.g. 7GB/s), got {value!r}")
  try:
    if isinstance(value, str):
      rate = parse_size(re.sub(r"/s\s*$", "", value.strip(), flags=re.IGNORECASE), what=what)
    else:
      rate = int(value)
  except (ValueError, TypeError, OverflowError):
    raise ValueError(
      f"{what}: cannot read {value!r} as a bandwidth (e.g. 7GB/s, 512MiB/s, 7e9, or 'off')"
    ) from None
  if rate <= 0:
    raise ValueError(
      f"{what}: expected a positive bandwidth in bytes/s, got {value!r} (None or 'off' for no cap)"
    )
  return rate


# ---------------------------------------------------------------------------------------------
# Implementation


class _State:
  config: StoreConfig | None = None
  temp_dir: str | None = None
  targets_registered = False
  warned_kept = False
  warned_o_direct: set = set()


_state = _State()
_lock = threading.RLock()


def _apply(cfg: StoreConfig) -> None:
  if not _state.targets_registered:
    native.register_targets()
    _state.targets_registered = True
  directories = cfg.directories
  if not directories:
    if _state.temp_dir is None:
      _state.temp_dir = tempfile.mkdtemp(prefix="jax_ssdtrain-")  # mode 0700
    directories = (_state.temp_dir,)
  if cfg.directories:
    for d in cfg.directories:
      _check_directory(d)
  native.configure(_engine_options(cfg, directories))
  _state.config = cfg
  lifetimes.sweeper.start()
  _state.warned_kept = False
  if (
    cfg.o_direct is None
    and native.stats().get("o_direct") == 0
    and directories not in _state.warned_o_direct
  ):
    _state.warned_o_direct.add(directories)
    warnings.warn(
      f"jax_ssdtrain: O_DIRECT is not supported by the filesystem of the store "
      f"directory {', '.join(directories)} (e.g. tmpfs); using buffered I/O "
      f"(o_direct=None/auto). Pass o_direct=False to silence this.",
      RuntimeWarning,
      stacklevel=3,
    )
  if cfg.directories and _state.temp_dir is not None:
    _remove_temp_dir()


def _engine_options(cfg: StoreConfig, directories: tuple[str, ...]) -> dict[str, Any]:
  capacity = cfg.capacity_bytes
  free = _free_bytes_total(directories)
  if free < 1 << 20:
    raise OSError(
      _errno.ENOSPC,
      f"store directory {', '.join(directories)} cannot hold the "
      f"store's files: its filesystem has {free} bytes free (set SSDTRAIN_DIR or "
      "configure(directory=...) to a directory on a local disk)",
    )
  if capacity is None:
    capacity = int(0.9 * free)
  elif capacity > free:
    raise ValueError(
      f"capacity_bytes={capacity} ({capacity / GiB:.2f} GiB) is beyond the free "
      f"space of the store directories {list(directories)}: {free} bytes "
      f"({free / GiB:.2f} GiB)"
    )
  switch = {None: 2, True: 1, False: 0}
  return dict(
    directories=":".join(directories),
    capacity_bytes=capacity,
    host_cache_bytes=cfg.host_cache_bytes,
    host_tier_bytes=cfg.host_tier_bytes,
    staging_bytes=cfg.staging_bytes,
    io_threads=cfg.io_threads,
    chunk_bytes=cfg.chunk_bytes,
    prefetch_bytes=cfg.prefetch_bytes,
    o_direct=switch[cfg.o_direct],
    gds=switch[cfg.gds],
    forwarding=int(cfg.forwarding),
    on_full=_ON_FULL[cfg.on_full],
    verify=int(cfg.verify),
    exact_loads=int(cfg.exact_loads),
    bandwidth_cap=cfg.bandwidth_cap or 0,
    device_groups=cfg.device_groups if cfg.directories else 0,
  )


_ON_FULL = {"error": 0, "keep": 1}


def _warn_if_kept(s: dict[str, Any]) -> None:
  if s.get("full_kept_tensors") and not _state.warned_kept:
    _state.warned_kept = True
    warnings.warn(
      f"jax_ssdtrain: the store was full ({s.get('file_bytes_peak')} bytes of file "
      f"space in use at peak); on_full='keep' kept {s['full_kept_tensors']} tensor(s), "
      f"{s['full_kept_bytes']} bytes, in host memory",
      RuntimeWarning,
      stacklevel=3,
    )


def _check_directory(directory: str) -> None:
  """Names the problem with a store directory before the engine tries it."""
  probe = directory
  while not os.path.lexists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      break
    probe = parent
  if not os.path.isdir(probe):
    what = "is" if probe == directory else "is below"
    raise NotADirectoryError(
      _errno.ENOTDIR,
      f"store directory {directory!r} {what} {probe!r}, which exists and is not a directory",
    )
  if not os.access(probe, os.W_OK | os.X_OK):
    if probe == directory:
      msg = f"store directory {directory!r} is not writable"
    else:
      msg = f"store directory {directory!r} cannot be created: {probe!r} is not writable"
    raise PermissionError(_errno.EACCES, msg)
  missing = []
  cur = directory
  while cur != probe and cur:
    missing.append(cur)
    cur = os.path.dirname(cur)
  for path in reversed(missing):  # created 0700, as the engine would
    try:
      os.mkdir(path, 0o700)
    except FileExistsError:
      pass
    except OSError as e:
      raise type(e)(
        e.errno,
        f"store directory {directory!r} cannot be created: mkdir({path!r}) failed: {e.strerror}",
      ) from None


def _free_bytes_total(directories: Sequence[str]) -> int:
  """Free space of the directories' filesystems, each filesystem counted once."""
  seen, total = set(), 0
  for d in directories:
    probe = _existing(d)
    try:
      dev = os.stat(probe).st_dev
    except OSError:
      dev = probe
    if dev in seen:
      continue
    seen.add(dev)
    try:
      total += shutil.disk_usage(probe).free
    except OSError as e:
      raise OSError(
        e.errno, f"store directory {d!r}: cannot read free space: {e.strerror}"
      ) from None
  return total


def _existing(directory: str) -> str:
  """The directory, or its nearest existing parent when it is not created yet."""
  probe = directory
  while not os.path.exists(probe):
    parent = os.path.dirname(os.path.abspath(probe))
    if parent == probe:
      break
    probe = parent
  return probe


def _physical_ram() -> int | None:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def _validated(cfg: StoreConfig) -> StoreConfig:
  for key in (
    "host_cache_bytes",
    "host_tier_bytes",
    "staging_bytes",
    "chunk_bytes",
    "prefetch_bytes",
    "io_threads",
  ):
    value = getattr(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{key}: expected an integer >= 0, got {value!r}")
  for key in ("io_threads", "chunk_bytes"):
    if getattr(cfg, key) == 0:
      raise ValueError(f"{key}: must be positive, got 0")
  if cfg.capacity_bytes is not None and (
    isinstance(cfg.capacity_bytes, bool)
    or not isinstance(cfg.capacity_bytes, int)
    or cfg.capacity_bytes <= 0
  ):
    raise ValueError(f"capacity_bytes: expected a positive integer, got {cfg.capacity_bytes!r}")
  for key in ("o_direct", "gds"):
    if getattr(cfg, key) not in (None, True, False):
      raise ValueError(f"{key}: expected True, False or None (auto), got {getattr(cfg, key)!r}")
  for key in ("forwarding", "verify", "exact_loads"):
    if not isinstance(getattr(cfg, key), bool):
      raise ValueError(f"{key}: expected a bool, got {getattr(cfg, key)!r}")
  if cfg.bandwidth_cap is not None and (
    isinstance(cfg.bandwidth_cap, bool)
    or not isinstance(cfg.bandwidth_cap, int)
    or cfg.bandwidth_cap <= 0
  ):
    raise ValueError(
      f"bandwidth_cap: expected a positive integer (bytes/s) or None, got {cfg.bandwidth_cap!r}"
    )
  if cfg.on_full not in _ON_FULL:
    raise ValueError(f"on_full: expected 'error' or 'keep', got {cfg.on_full!r}")
  groups = cfg.device_groups
  if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
    raise ValueError(f"device_groups: expected an integer >= 0, got {groups!r}")
  if groups and len(cfg.directories) % groups:
    raise ValueError(
      f"device_groups={groups} does not divide the {len(cfg.directories)} store "
      f"directories {list(cfg.directories)}"
    )
  ram = _physical_ram()
  if ram:
    for key in ("host_tier_bytes", "host_cache_bytes"):
      if getattr(cfg, key) > ram:
        raise ValueError(
          f"{key}={getattr(cfg, key)} ({getattr(cfg, key) / GiB:.2f} GiB) is "
          f"beyond the physical memory of this machine ({ram / GiB:.2f} GiB)"
        )
    both = cfg.host_tier_bytes + cfg.host_cache_bytes
    if both > ram:
      raise ValueError(
        f"host_tier_bytes + host_cache_bytes = {both} ({both / GiB:.2f} GiB) is "
        f"beyond the physical memory of this machine ({ram / GiB:.2f} GiB)"
      )
  return dataclasses.replace(cfg, directories=_checked_paths(cfg.directories))


def _as_list(value) -> list:
  """``directory=``: one path or a list of paths."""
  return [value] if isinstance(value, (str, os.PathLike)) else list(value)


def _device_groups(value) -> int:
  """The number of local devices when every directory has ``{device}``; 0 when none has."""
  items = _as_list(value)
  per_device = ["{device}" in os.fspath(item) for item in items]
  if not any(per_device):
    return 0
  if not all(per_device):
    raise ValueError(
      f"directory: {{device}} must be in every store directory or in none, got "
      f"{[os.fspath(i) for i in items]}"
    )
  return len(_local_devices())


def _directories(value) -> tuple[str, ...]:
  items = _as_list(value)
  out = []
  for item in items:
    if not isinstance(item, (str, os.PathLike)) or not os.fspath(item):
      raise ValueError(f"directory: expected a path or a list of paths, got {item!r}")
    out.extend(_expand_template(os.fspath(item)))
  return _checked_paths(out)


# Placeholders of a store directory -> their values (one directory per value).
_PLACEHOLDERS = {
  "process": lambda: [str(_process_index())],
  "device": lambda: [str(i) for i in range(len(_local_devices()))],  # local index
}


def _expand_template(path: str) -> list[str]:
  """``{process}`` / ``{device}`` in a directory -> the directories they stand for."""
  if "{" not in path and "}" not in path:
    return [path]
  try:
    parsed = [
      (f, spec, conv) for _, f, spec, conv in string.Formatter().parse(path) if f is not None
    ]
  except ValueError as e:
    raise ValueError(
      f"directory: malformed placeholder in {path!r} ({e}); use {{process}} or "
      f"{{device}}, and {{{{ }}}} for literal braces"
    ) from None
  for field, spec, conv in parsed:
    if field not in _PLACEHOLDERS or spec or conv:
      raise ValueError(
        f"directory: unknown placeholder {{{field}}} in {path!r}; known: "
        f"{', '.join('{' + k + '}' for k in _PLACEHOLDERS)}"
      )
  values = {name: _PLACEHOLDERS[name]() for name in sorted({f for f, _, _ in parsed})}
  out = [path]
  for name, choices in values.items():
    out = [p.replace("{" + name + "}", v) for p in out for v in choices]
  return [p.replace("{{", "{").replace("}}", "}") for p in out]


def _process_index() -> int:
  # The distributed client's id: set by jax.distributed.initialize(), without starting backends.
  from jax_ssdtrain._src import jax_internals

  return jax_internals.process_index_without_backends()


def _local_devices():
  import jax

  return jax.local_devices()


def _checked_paths(paths) -> tuple[str, ...]:
  out = []
  for raw in paths:
    path = os.path.abspath(raw)
    if ":" in path:
      raise ValueError(f"directory: a path may not contain ':', got {path!r}")
    out.append(path)
  if len(set(out)) != len(out):
    raise ValueError(f"directory: the same directory is listed twice: {out}")
  return tuple(out)


def _parse_int(value: str, *, what: str) -> int:
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{what}: expected an integer, got {value!r}") from None


def _parse_switch(value: str, *, what: str, auto: bool = True) -> bool | None:
  v = value.lower()
  if v in ("1", "on", "true", "yes"):
    return True
  if v in ("0", "off", "false", "no"):
    return False
  if auto and v == "auto":
    return None
  raise ValueError(f"{what}: expected on/off{'/auto' if auto else ''}, got {value!r}")


def _shutdown_locked() -> None:
  lifetimes.sweeper.stop()
  if _state.config is not None:
    native.shutdown()
    _state.config = None
  _remove_temp_dir()


def _remove_temp_dir() -> None:
  if _state.temp_dir is not None:
    shutil.rmtree(_state.temp_dir, ignore_errors=True)
    _state.temp_dir = None


atexit.register(shutdown)
