"""The process-wide store: configuration, statistics, shutdown.

``configure()`` (re)creates the engine of this process; the first offloading program configures
it from the defaults when nobody has. The options, their ``SSDTRAIN_*`` environment variables
and defaults are one table, ``options.OPTIONS`` (the docs' Store options page is generated from
it); this module reads them through it.

The store has three states. *Never configured* (a fresh process, or after a
``configured(...)`` block that opened the first store): the first run of a program that
offloads, or ``stats()``, opens a store from the defaults. *Open*: after ``configure()``. *Shut down* by the
user (``shutdown()``): nothing opens a store by itself any more; a program that offloads, old or
new, and ``stats()`` raise an error saying so until ``configure()`` is called again.

The store opens when it is first needed, never while a program is lowered or compiled: the
store and load lowerings only mark their program (:func:`mark_uses_store`), and the first run of
a marked program opens it (:func:`install_dispatch_hook`), before anything is dispatched: a bad
configuration or a shut-down store raises its Python error there. Later runs of that program go
straight to the engine (JAX's C++ dispatch), which refuses them when the store was closed since.

A directory may contain ``{process}`` (this process's index, ``jax.process_index()``: one
store per process of a multi-host job) and ``{device}`` (expanded to one directory per local
device, e.g. one NVMe drive per GPU: each device's tensors go to its own directory only, and
``capacity_bytes`` is split evenly; ``device_groups`` records it). Configure after
``jax.distributed.initialize()`` when using them.

The device staging arena under ``staging_bytes="auto"`` (the default) is sized from the
programs (``options/staging.py``): the first run of each program that stores computes the arena
its stores need (their sizes are listed when it is lowered, ``lifetimes.program_stores``) within
a budget (``staging_max_bytes`` and half of what the program leaves on its device). A store that
is not open yet opens with it; an open store's arena grows to it (``native.grow_staging``: the
engine evicts the arena's copies and waits for its users, before this program is dispatched) and
never shrinks. Where it cannot grow, a warning says so, once. ``stats()["staging_bytes"]``
reports the size in force.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno as _errno
import fcntl
import functools
import logging
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from jax_ssdtrain._src import attributes, lifetimes, native
from jax_ssdtrain._src import jax_internals as ji
from jax_ssdtrain._src import options as _options
from jax_ssdtrain._src.options import (  # noqa: F401 - re-exported
  GiB,
  MiB,
  StoreConfig,
  UnknownOptionError,
  device_free,
  parse_bandwidth,
  parse_size,
)
from jax_ssdtrain._src.options import staging as _staging


class StoreShutDownError(RuntimeError):
  """The store was shut down by ``jax_ssdtrain.shutdown()`` and not configured again."""


SHUT_DOWN_MESSAGE = (
  "jax_ssdtrain: the store was shut down (jax_ssdtrain.shutdown()); call "
  "jax_ssdtrain.configure(...) to open a store again before running or compiling a program "
  "that offloads, or reading its statistics"
)


def defaults() -> StoreConfig:
  """The configuration given by the environment (``SSDTRAIN_*``) over the built-in defaults."""
  return _options.from_environment()


def configure(
  directory: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
  capacity_bytes: int | str | None = None,
  **options: Any,
) -> StoreConfig:
  """(Re)creates this process's store and returns its configuration.

  ``directory``: one directory or a list (one per NVMe drive; tensors are striped across
  them); None keeps the current one (initially ``$SSDTRAIN_DIR`` or a private temp dir).
  ``capacity_bytes``: file space in all; None keeps the current one. The other options are the
  fields of :class:`StoreConfig` (the docs' Store options page lists them); sizes may be
  strings such as ``"4GiB"``. Options not given keep their current values (initially the
  defaults and ``SSDTRAIN_*`` variables). After :func:`shutdown`, it opens the store again.

  Reconfiguring replaces the open store: it first waits for the work already dispatched (every
  live ``jax.Array`` ready, as :func:`flush` does), so that a program that was still running
  finishes in the old store, then drops everything stored (activations, streamed stacks,
  offloaded optimizer state). A program given a handle made before is refused with an error
  saying its entry belongs to a store that was replaced: make such state again after
  ``configure()``, or configure the store before making it.
  """
  given = dict(options)
  if directory is not None:
    given["directory"] = directory
  if capacity_bytes is not None:
    given["capacity_bytes"] = capacity_bytes
  changes = _options.read_changes(given)
  _wait_for_dispatched()
  with _lock:
    base = _state.config if _state.config is not None else defaults()
    cfg = _options.check(dataclasses.replace(base, **changes))
    _apply(cfg)
    return cfg


def current() -> StoreConfig | None:
  """The configuration in force, or None before the store is first used (or after shutdown)."""
  return _state.config


def ensure_configured() -> StoreConfig:
  """The configuration in force; a store that was never configured opens from the defaults.
  Raises :class:`StoreShutDownError` after :func:`shutdown` until :func:`configure`."""
  with _lock:
    if _state.config is None:
      if _state.shut_down:
        raise StoreShutDownError(SHUT_DOWN_MESSAGE)
      _apply(defaults())
    return _state.config


@contextlib.contextmanager
def configured(directory=None, capacity_bytes=None, **options) -> Iterator[StoreConfig]:
  """Scoped configuration (for tests): the previous one is restored on exit (where there was
  none, the store closes and the process is as before: never configured, or shut down)."""
  previous, was_shut_down = _state.config, _state.shut_down
  try:
    yield configure(directory, capacity_bytes, **options)
  finally:
    _wait_for_dispatched()
    with _lock:
      if previous is None:
        _shutdown_locked()
        _state.shut_down = was_shut_down
      else:
        _apply(previous)


def store_directories() -> tuple[str, ...]:
  """The directories the store files live in now (the temp dir when none was given)."""
  cfg = ensure_configured()
  return cfg.directories or (_state.temp_dir,)


def stats() -> dict[str, float]:
  """Engine counters since the last :func:`reset_stats` (see the README for the keys), and
  ``staging_bytes``: the device staging arena in force (``staging_bytes="auto"``'s choice)."""
  ensure_configured()
  s = native.stats()
  _warn_if_kept(s)
  # The arena each GPU allocates with its first store (no arena on the CPU: the size it would
  # have), as the engine was configured: staging_bytes, or what "auto" chose.
  s["staging_bytes"] = int(native.engine_config()["staging_bytes"])
  s["write_GBps"] = (
    s["disk_bytes_written"] / s["write_seconds"] / 1e9 if s.get("write_seconds") else 0.0
  )
  s["read_GBps"] = s["disk_bytes_read"] / s["read_seconds"] / 1e9 if s.get("read_seconds") else 0.0
  return s


def timeline() -> list[dict[str, Any]]:
  """The GPU copies and waits of the latest steps (up to 32768, oldest first), then forgets
  them: ``{"op", "device", "bytes", "start", "end", "name"}`` with times in seconds of the
  host's monotonic clock. ``op``: ``stage_in`` (store: into device staging), ``store_direct``
  (store: the bytes past the arena's room, device to pinned host on the compute stream), ``d2h``
  (staging to pinned host), ``read_ahead`` (pinned host to staging), ``load_staged`` / ``load_host``
  (load: from staging / from pinned host, on the compute stream) and ``compute_wait`` (the
  compute stream waited for staging room or a read-ahead). Waits for the copies already issued
  (call it between steps). Empty without a GPU.
  ``scripts/bench_rok.py --timeline`` writes one as a Chrome trace."""
  ensure_configured()
  return native.timeline()


def device_stats() -> dict[int, dict[str, int]]:
  """Per-device counters since :func:`reset_stats`: ``{device ordinal: {"bytes_written",
  "tensors_written", "bytes_read", "tensors_read"}}`` (and ``"staging_bytes"`` on a GPU that
  allocated its staging arena: its size now), keyed by the ordinal XLA hands the
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
    lifetimes.ready_live_arrays()
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
  """Sets the store's counters (:func:`stats`) back to zero; the entries it holds stay."""
  ensure_configured()
  native.reset_stats()


def release_all() -> None:
  """Frees every stored activation (waits for in-flight I/O). Handles held become invalid."""
  if _state.config is not None:
    native.release_all()


def shutdown() -> None:
  """Closes the store and deletes its files (and the private temp dir). Until the next
  :func:`configure`, programs that offload (compiled before or after) and :func:`stats` raise
  an error saying so, instead of opening a store of their own. Waits first for the work already
  dispatched (every live ``jax.Array`` ready), so that no running program loses its store."""
  _wait_for_dispatched()
  with _lock:
    _shutdown_locked()
    _state.shut_down = True


def is_shut_down() -> bool:
  """True after :func:`shutdown` until the next :func:`configure`."""
  return _state.shut_down


def reset_to_unconfigured() -> None:
  """Closes the store and returns the process to its first state, never configured (the next
  program that offloads opens a store from the defaults). For tests; ``atexit`` does this."""
  with _lock:
    _shutdown_locked()
    _state.shut_down = False
    _state.staging_auto = None
    _state.warned_staging_fixed = _state.warned_staging_small = False


# ---------------------------------------------------------------------------------------------
# Opening the store when a program that uses it first runs


class _UsesStore:
  """The mark a store or load lowering leaves among its program's keepalives; ``ran``: the
  program has opened the store (its first run did); ``stores``: the program's stores, ``(name,
  bytes)`` in program order (``lifetimes.program_stores``), which size the staging arena."""

  __slots__ = ("ran", "stores")

  def __init__(self, stores=()):
    self.ran = False
    self.stores = tuple(stores)


def mark_uses_store(module_context: Any) -> None:
  """Marks the program being lowered as one whose first run opens the store (the store and load
  lowering rules call it: nothing is opened here)."""
  keepalives = ji.module_keepalives(module_context)
  if not any(type(k) is _UsesStore for k in keepalives):
    keepalives.append(_UsesStore(lifetimes.current_stores()))


def _uses_store(keepalive: Any) -> _UsesStore | None:
  for k in keepalive or ():
    if type(k) is _UsesStore:
      return k
  return None


def install_dispatch_hook() -> None:
  """Wraps ``ExecuteReplicated.__call__`` (JAX internal, named in jax_internals) once: the first
  run of a marked program opens the store (:func:`ensure_configured`) before its arguments are
  touched; a failure (a bad configuration, :class:`StoreShutDownError`) raises there and the
  next run tries again."""
  cls = ji.EXECUTE_REPLICATED
  original = cls.__call__
  if getattr(original, "_ssdtrain_hook", False):
    return

  @functools.wraps(original)
  def __call__(self, *args):
    mark = _uses_store(self.keepalive)
    if mark is not None and not mark.ran:
      _open_for_program(mark, self)
      mark.ran = True
    return original(self, *args)

  __call__._ssdtrain_hook = True
  cls.__call__ = __call__


def _open_for_program(mark: _UsesStore, execute: Any) -> None:
  """The first run of a marked program: opens the store (as :func:`ensure_configured`) with the
  arena its stores need under ``staging_bytes="auto"``, or grows an open store's arena to it."""
  with _lock:
    if _state.config is None:
      if _state.shut_down:
        raise StoreShutDownError(SHUT_DOWN_MESSAGE)
      cfg = defaults()
      _apply(cfg, staging=_auto_staging(cfg, mark, execute))
      _warn_if_not_read_ahead(cfg, mark, execute)
      return
    cfg = _state.config
    _warn_if_not_read_ahead(cfg, mark, execute)
    want = _auto_staging(cfg, mark, execute)
    if want is None or want <= _state.staging_bytes:
      return
    # Between programs: this one is not dispatched yet, and the engine waits for the old
    # arena's users (the programs dispatched before) before it frees it.
    try:
      native.grow_staging(want)
    except OSError as e:
      if not _state.warned_staging_fixed:
        _state.warned_staging_fixed = True
        warnings.warn(
          f"jax_ssdtrain: staging_bytes='auto': program {_program_name(execute)!r} needs a "
          f"{_options.human_size(want)} staging arena, but the store's "
          f"{_options.human_size(_state.staging_bytes)} arena could not grow ({e}); the bytes "
          "it cannot hold go over the link on the compute stream. Pass "
          f"configure(staging_bytes={_options.human_size(want)!r}) before the first program.",
          RuntimeWarning,
          stacklevel=3,
        )
      return
    _state.staging_bytes = want


def _auto_staging(cfg: StoreConfig, mark: _UsesStore, execute: Any) -> int | None:
  """The arena ``mark``'s program needs under ``staging_bytes="auto"`` (at least the one
  chosen before: the arena only grows); None where ``staging_bytes`` is explicit."""
  if cfg.staging_bytes is not None:
    return None
  device = _device_budget(execute)
  budget = cfg.staging_max_bytes if device is None else min(cfg.staging_max_bytes, device)
  layers = _staging.layers_of(mark.stores)
  want = _staging.arena_bytes(layers, budget=budget, floor=_staging.FLOOR_BYTES)
  chosen = max(want, _state.staging_auto or 0)
  if chosen != _state.staging_auto:
    _state.staging_auto = chosen
    largest = max((max(layer) for layer in layers if layer), default=0)
    layer = max((sum(layer) for layer in layers), default=0)
    _log.info(
      "jax_ssdtrain: staging_bytes=auto: a %s staging arena per GPU for program %r (its "
      "largest layer stores %s, its largest tensor %s; budget %s: staging_max_bytes %s, "
      "half the device memory the program leaves %s)",
      _options.human_size(chosen),
      _program_name(execute),
      _options.human_size(layer),
      _options.human_size(largest),
      _options.human_size(budget),
      _options.human_size(cfg.staging_max_bytes),
      "unknown" if device is None else _options.human_size(device),
    )
    if largest > chosen and not _state.warned_staging_small:
      _state.warned_staging_small = True
      warnings.warn(
        f"jax_ssdtrain: staging_bytes='auto': the device budget ({_options.human_size(budget)}"
        f") leaves a {_options.human_size(chosen)} staging arena, smaller than the largest "
        f"tensor program {_program_name(execute)!r} stores ({_options.human_size(largest)}): "
        "the bytes it cannot hold go over the link on the compute stream and cost the step "
        "their link time (raise staging_max_bytes or free device memory)",
        RuntimeWarning,
        stacklevel=4,
      )
  return chosen


# The store locations whose tensors the files hold (all, or what the host tier cannot).
_FILE_TIERS = (attributes.TIER_NVME, attributes.TIER_HOST_THEN_NVME)


def too_large_to_read_ahead(stores: Sequence[tuple], cfg: StoreConfig) -> int:
  """The largest tensor of ``stores`` (a program's ``(name, bytes, tier)``) bound for the files
  that the engine can never read ahead (0: none): read-ahead takes a file's tensor whole into
  the host cache, within the ``prefetch_bytes`` budget (both in 4 KiB pages), so one larger than
  either waits on the disk at its load. 0 with ``prefetch_bytes=0`` (read-ahead off)."""
  if not cfg.prefetch_bytes:
    return 0
  room = min(int(cfg.host_cache_bytes), int(cfg.prefetch_bytes))
  pages = [-(-int(n) // 4096) * 4096 for _, n, tier, *_ in stores if tier in _FILE_TIERS]
  largest = max(pages, default=0)
  return largest if largest > room else 0


def _warn_if_not_read_ahead(cfg: StoreConfig, mark: _UsesStore, execute: Any) -> None:
  largest = too_large_to_read_ahead(mark.stores, cfg)
  if not largest or _state.warned_read_ahead:
    return
  _state.warned_read_ahead = True
  twice = 2 * largest
  unit = next(u for u in (_options.GiB, _options.MiB, 1024) if twice >= u)
  want = _size(-(-twice // unit) * unit)  # twice the tensor, rounded up
  warnings.warn(
    f"jax_ssdtrain: program {_program_name(execute)!r} stores a tensor of {_size(largest)} to "
    f"the files, more than host_cache_bytes ({_size(cfg.host_cache_bytes)}) or prefetch_bytes "
    f"({_size(cfg.prefetch_bytes)}) hold: read-ahead takes a tensor whole, so "
    "its loads wait on the disk. Pass configure(host_cache_bytes="
    f"{want!r}, prefetch_bytes={want!r}) (at least twice the tensor) to read it ahead.",
    RuntimeWarning,
    stacklevel=3,
  )


def _size(n: int) -> str:
  """``n`` bytes as a size string :func:`parse_size` reads back, with a unit where 1 KiB or
  more divides it."""
  text = _options.human_size(int(n))
  return f"{int(n) // 1024}KiB" if text.isdigit() and n >= 1024 and n % 1024 == 0 else text


def _device_budget(execute: Any) -> int | None:
  """The arena's budget on the program's devices (``options/device_free.py``); None on the CPU."""
  return device_free.program_budget(getattr(execute, "xla_executable", None))


def _program_name(execute: Any) -> str:
  return str(getattr(execute, "name", "?"))


# ---------------------------------------------------------------------------------------------
# Implementation

_log = logging.getLogger("jax_ssdtrain")


class _State:
  config: StoreConfig | None = None
  shut_down = False  # by shutdown(): nothing opens a store by itself until configure()
  temp_dir: str | None = None
  temp_lock: int | None = None  # the flock held on temp_dir's lock file
  targets_registered = False
  warned_kept = False
  warned_o_direct: set = set()
  # staging_bytes="auto": the largest arena the programs run so far needed (None: none ran);
  # the arena the open engine was given; the warnings given.
  staging_auto: int | None = None
  staging_bytes = 0
  warned_staging_fixed = False
  warned_staging_small = False
  warned_read_ahead = False  # once per configuration: a file tensor too large to read ahead


_state = _State()
_lock = threading.RLock()


def _wait_for_dispatched() -> None:
  """Before the store is replaced or closed: waits for every live ``jax.Array`` (the programs
  that made them), so that no program dispatched before still runs its stores and loads while
  the engine changes (they would fail for want of a store, or store into the new one). The
  store's own reads and writes are waited for by the engine as it drops the old store."""
  if _state.config is not None:
    lifetimes.ready_live_arrays()


def _apply(cfg: StoreConfig, staging: int | None = None) -> None:
  """Opens the engine with ``cfg``; ``staging``: the arena under ``staging_bytes="auto"``
  (default: the largest the programs run so far needed, else the floor)."""
  if not _state.targets_registered:
    native.register_targets()
    _state.targets_registered = True
  directories = cfg.directories
  if not directories:
    if _state.temp_dir is None:
      _state.temp_dir = _make_temp_dir()
    directories = (_state.temp_dir,)
  if cfg.directories:
    for d in cfg.directories:
      _check_directory(d)
  if staging is None:
    staging = _state.staging_auto or _staging.FLOOR_BYTES
  settings = _options.engine_options(cfg, directories, staging_bytes=staging)
  try:
    native.configure(settings)
  except BaseException:
    # The engine dropped the previous store before it failed to open this one.
    _state.config = None
    lifetimes.sweeper.stop()
    raise
  _state.config = cfg
  _state.staging_bytes = int(settings["staging_bytes"])
  _state.shut_down = False
  lifetimes.sweeper.start()
  _state.warned_kept = _state.warned_read_ahead = False
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
  if _state.temp_lock is not None:
    os.close(_state.temp_lock)
    _state.temp_lock = None


# The private store directory (no directory configured): TEMP_PREFIX + "<pid>-<random>" in the
# temp dir (``tempfile.gettempdir()``: $TMPDIR, else /tmp), mode 0700. Its store files are
# unlinked as soon as they are open, so a process killed with SIGKILL leaves the directory and
# its lock file only: the process holds an exclusive flock on TEMP_LOCK for the directory's
# life, and the next process that makes one removes every such directory whose lock nobody
# holds (the kernel drops a dead process's locks; the pid in the name is for people).
TEMP_PREFIX = "jax_ssdtrain-"
TEMP_LOCK = ".owner.lock"
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"\d+-[A-Za-z0-9_]+")


def _make_temp_dir() -> str:
  remove_stale_temp_dirs()
  path = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")  # mode 0700
  # Locked before it gets its name: a lock file without a holder is stale, never a new one.
  fd = os.open(os.path.join(path, TEMP_LOCK + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(os.path.join(path, TEMP_LOCK + ".new"), os.path.join(path, TEMP_LOCK))
  except OSError:
    os.close(fd)
    raise
  os.set_inheritable(fd, False)
  _state.temp_lock = fd
  return path


def remove_stale_temp_dirs(parent: str | None = None) -> list[str]:
  """Removes the private store directories of dead processes (killed before they could remove
  theirs) from ``parent`` (the temp dir); returns them. Only this user's directories whose lock
  file no live process holds are touched."""
  parent = parent or tempfile.gettempdir()
  removed = []
  try:
    names = os.listdir(parent)
  except OSError:
    return removed
  for name in names:
    if not _TEMP_NAME.fullmatch(name):
      continue
    path = os.path.join(parent, name)
    try:
      if os.lstat(path).st_uid != os.getuid():
        continue
      fd = os.open(os.path.join(path, TEMP_LOCK), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
      continue  # not ours, not a directory, or made by a release before the lock file
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      continue  # its process is alive
    try:
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
    finally:
      os.close(fd)
  return removed


atexit.register(reset_to_unconfigured)
