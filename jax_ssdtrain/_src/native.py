"""ctypes loader and thin wrappers around ``libssdtrain.so`` (the native engine).

The library is a plain shared object (not a Python extension). It exports a
small C ABI (``ssdtrain_*``; every call returns 0 or an errno-like code with a
message) and the XLA FFI handlers ``SsdtrainStoreCpu`` / ``SsdtrainLoadCpu``
(and ``SsdtrainStoreCuda`` / ``SsdtrainLoadCuda`` in CUDA builds), registered
with JAX as the custom-call targets ``ssdtrain_store`` / ``ssdtrain_load``.

The library is loaded lazily on first use (``lib()``), so importing this module
never fails; ``lib()`` raises ImportError if the library was not built.
"""

from __future__ import annotations

import atexit
import ctypes
import errno as _errno
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.ffi
import numpy as np

from jax_ssdtrain._src import attributes

__all__ = [
  "STORE_TARGET",
  "LOAD_TARGET",
  "COPY_TARGET",
  "library_path",
  "lib",
  "available",
  "register_targets",
  "build_info",
  "configure",
  "engine_config",
  "stats",
  "reset_stats",
  "flush",
  "release_all",
  "shutdown",
  "file_paths",
  "debug_truncate",
  "debug_corrupt",
  "store_host",
  "load_host",
  "sweep",
  "sweep_requested",
  "timeline",
  "probe_link",
]

# ssdtrain_probe_link's on_ready: ssdtrain_ready_fn, void (*)(void), nullable.
_READY_FN = ctypes.CFUNCTYPE(None)

# The C ABI, function by function as xla_ffi/include/ssdtrain/c_api.h declares it, and the test
# hooks of xla_ffi/include/ssdtrain/testing.h (the headers say what each does): name ->
# (restype, argtypes). lib() binds exactly these; tests/test_build.py checks them against the
# two headers.
_c_char_p, _c_size_t, _c_int = ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
_c_int64, _c_uint64, _c_void_p = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
_P = ctypes.POINTER
_C_API: dict[str, tuple[Any, list[Any]]] = {
  # the store
  "ssdtrain_configure": (_c_int, [_c_char_p, _c_char_p, _c_size_t]),
  "ssdtrain_config": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_shutdown": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_flush": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_release_all": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_grow_staging": (_c_int, [_c_uint64, _c_char_p, _c_size_t]),
  # statistics and introspection
  "ssdtrain_stats": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_reset_stats": (None, []),
  "ssdtrain_timeline": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_file_paths": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_build_info": (_c_int, [_c_char_p, _c_size_t]),
  "ssdtrain_probe_link": (
    _c_int,
    [_c_int, _c_uint64, _c_int, _c_int, _READY_FN, _P(ctypes.c_double), _c_char_p, _c_size_t],
  ),
  # stores and loads of host buffers
  "ssdtrain_store_host": (
    _c_int,
    [_c_void_p, _c_uint64, _c_int64, _c_int64, _P(ctypes.c_uint32), _c_char_p, _c_size_t],
  ),
  "ssdtrain_load_host": (
    _c_int,
    [_P(ctypes.c_uint32), _c_void_p, _c_uint64, _c_int64, _c_char_p, _c_size_t],
  ),
  # lifetimes
  "ssdtrain_sweep": (
    _c_int,
    [_P(ctypes.c_uint32), _c_uint64, _c_uint64, _c_int, _P(_c_uint64), _c_char_p, _c_size_t],
  ),
  "ssdtrain_sweep_requested": (_c_int, []),
  # test hooks (testing.h)
  "ssdtrain_debug_truncate": (_c_int, [_c_uint64, _c_char_p, _c_size_t]),
  "ssdtrain_debug_corrupt": (_c_int, [_c_uint64, _c_char_p, _c_size_t]),
}

STORE_TARGET = "ssdtrain_store"
LOAD_TARGET = "ssdtrain_load"
COPY_TARGET = "ssdtrain_copy"

_ERRLEN = 8192
_OUTLEN = 1 << 16

_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_registered: set[str] = set()
_atexit_registered = False


def library_path() -> Path:
  """Where the native library is: $SSDTRAIN_LIB, else next to this package, else in an
  installed copy of the package on sys.path (a source checkout imported beside a
  ``pip install .`` of it has no library of its own)."""
  env = os.environ.get("SSDTRAIN_LIB")
  if env:
    return Path(env)
  here = Path(__file__).resolve().parents[1] / "libssdtrain.so"
  if here.exists():
    return here
  for entry in sys.path:
    installed = Path(entry or ".") / "jax_ssdtrain" / "libssdtrain.so"
    if installed.exists():
      return installed.resolve()
  return here


def _preload_kvikio() -> None:
  # A kvikio-enabled build links libkvikio.so, which the libkvikio wheel
  # loads into the process; harmless (and skipped) when not installed.
  try:
    import libkvikio  # type: ignore  # an optional dependency (the kvikio extra), imported here

    libkvikio.load_library()
  except Exception:  # noqa: BLE001 - optional dependency
    pass


def lib() -> ctypes.CDLL:
  """The loaded native library (loaded on first call)."""
  global _lib, _atexit_registered
  with _lock:
    if _lib is not None:
      return _lib
    path = library_path()
    if not path.is_file():
      raise ImportError(
        f"jax_ssdtrain native library not found at {path}. Build it with "
        "`pip install -e .` (or `pip install .`) from the jax_ssdtrain checkout, "
        "or point $SSDTRAIN_LIB at a built libssdtrain.so."
      )
    _preload_kvikio()
    try:
      so = ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError as e:
      raise ImportError(f"could not load {path}: {e}") from e
    for name, (restype, argtypes) in _C_API.items():
      f = getattr(so, name)
      f.argtypes = argtypes
      f.restype = restype
    _lib = so
    if not _atexit_registered:
      atexit.register(_atexit_shutdown)
      _atexit_registered = True
    return so


def available() -> bool:
  try:
    lib()
    return True
  except ImportError:
    return False


def _raise(code: int, msg: str) -> None:
  if code == _errno.EINVAL:
    raise ValueError(msg)
  raise OSError(code, msg)


def _call_err(fn, *args) -> None:
  err = ctypes.create_string_buffer(_ERRLEN)
  rc = fn(*args, err, _ERRLEN)
  if rc != 0:
    _raise(rc, err.value.decode("utf-8", "replace") or f"error {rc}")


def _call_out(fn) -> str:
  size = _OUTLEN
  while True:
    out = ctypes.create_string_buffer(size)
    rc = fn(out, size)
    if rc == _errno.ERANGE and size < (1 << 24):
      size *= 4
      continue
    if rc != 0:
      _raise(rc, out.value.decode("utf-8", "replace") or f"error {rc}")
    return out.value.decode("utf-8", "replace")


def _parse_kv(text: str) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for line in text.splitlines():
    if "=" not in line:
      continue
    k, v = line.split("=", 1)
    try:
      out[k] = int(v)
    except ValueError:
      try:
        out[k] = float(v)
      except ValueError:
        out[k] = v
  return out


def build_info() -> dict[str, Any]:
  """``{"cuda": 0|1, "kvikio": 0|1, "ffi_api": "major.minor"}``."""
  info = _parse_kv(_call_out(lib().ssdtrain_build_info))
  info["ffi_api"] = str(info.get("ffi_api", ""))
  return info


def runtime_ffi_api() -> tuple[int, int] | None:
  """The XLA FFI API version of the running jaxlib, read from the headers it ships (None if
  it ships none)."""
  try:
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    text = header.read_text()
  except (OSError, AttributeError):
    return None
  found = dict(re.findall(r"^#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", text, re.MULTILINE))
  if set(found) != {"MAJOR", "MINOR"}:
    return None
  return int(found["MAJOR"]), int(found["MINOR"])


def check_ffi_api() -> None:
  """Raises ImportError when the built handlers speak a newer XLA FFI API than the running
  jaxlib accepts (XLA accepts the same major version and an equal or older minor one)."""
  built = tuple(int(p) for p in build_info()["ffi_api"].split(".") if p.isdigit())
  runtime = runtime_ffi_api()
  if len(built) != 2 or runtime is None:
    return
  if built[0] == runtime[0] and built[1] <= runtime[1]:
    return
  editable = (
    Path(__file__).resolve().parents[1] == library_path().parent
    and (library_path().parents[1] / "pyproject.toml").exists()
  )
  rebuild = (
    "pip install --no-build-isolation --no-deps -e ."
    if editable
    else "pip install --force-reinstall --no-deps --no-cache-dir jax_ssdtrain "
    "(or the source checkout's path instead of the name)"
  )
  raise ImportError(
    f"jax_ssdtrain's XLA FFI handlers ({library_path()}) were built against XLA FFI API "
    f"{built[0]}.{built[1]}, but the running jaxlib {jax.__version__} speaks "
    f"{runtime[0]}.{runtime[1]} and would refuse them ('No FFI handler registered for "
    f"ssdtrain_store'). Rebuild them for this jaxlib: {rebuild}. (pip's isolated build "
    "compiles against jaxlib 0.10.2's headers, which every supported jaxlib accepts.)"
  )


def register_targets() -> None:
  """Registers ssdtrain_store, ssdtrain_load and ssdtrain_copy for "cpu" (and "CUDA" when built
  with CUDA)."""
  with _lock:
    so = lib()
    check_ffi_api()
    platforms = [("cpu", "SsdtrainStoreCpu", "SsdtrainLoadCpu", "SsdtrainCopyCpu")]
    if build_info().get("cuda") == 1:
      platforms.append(("CUDA", "SsdtrainStoreCuda", "SsdtrainLoadCuda", "SsdtrainCopyCuda"))
    for platform, store_sym, load_sym, copy_sym in platforms:
      if platform in _registered:
        continue
      jax.ffi.register_ffi_target(
        STORE_TARGET, jax.ffi.pycapsule(getattr(so, store_sym)), platform=platform
      )
      jax.ffi.register_ffi_target(
        LOAD_TARGET, jax.ffi.pycapsule(getattr(so, load_sym)), platform=platform
      )
      jax.ffi.register_ffi_target(
        COPY_TARGET, jax.ffi.pycapsule(getattr(so, copy_sym)), platform=platform
      )
      _registered.add(platform)


def _format_value(key: str, value: object) -> str:
  if isinstance(value, bool):
    return "1" if value else "0"
  if key == "directories" and isinstance(value, (list, tuple)):
    parts = [os.fspath(v) for v in value]
    for p in parts:
      if ":" in p or "\n" in p:
        raise ValueError(f"configure: directory names may not contain ':' or newlines: {p!r}")
    return ":".join(parts)
  if isinstance(value, os.PathLike):
    value = os.fspath(value)
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  s = str(value)
  if "\n" in s:
    raise ValueError(f"configure: value of {key!r} contains a newline")
  return s


def configure(kv: Mapping[str, object] | None = None, **kwargs: object) -> None:
  """(Re)creates the process-wide engine from ``key=value`` settings.

  The engine has no defaults: every key of the option table (``options.engine_options``
  gives them all) is required, and a missing or unknown key or a bad value raises ValueError;
  system errors raise OSError. The test hook $SSDTRAIN_FAULT ("op:n:errno") is read here.
  Reconfiguring drains in-flight I/O and drops every stored activation.
  """
  items = dict(kv or {})
  items.update(kwargs)
  text = "".join(f"{k}={_format_value(k, v)}\n" for k, v in items.items() if v is not None)
  _call_err(lib().ssdtrain_configure, text.encode())


def engine_config() -> dict[str, str]:
  """The settings the engine runs with, as it parsed them (``{}`` when no store is open)."""
  text = _call_out(lib().ssdtrain_config)
  return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def grow_staging(nbytes: int) -> None:
  """Grows the device staging arena to ``nbytes`` (between programs: c_api.h); OSError (EBUSY,
  ENOMEM) naming why where a GPU's arena could not grow."""
  _call_err(lib().ssdtrain_grow_staging, int(nbytes))


def stats() -> dict[str, Any]:
  """Counters and gauges of the engine (see the native docs for the keys)."""
  return _parse_kv(_call_out(lib().ssdtrain_stats))


def reset_stats() -> None:
  lib().ssdtrain_reset_stats()


def flush() -> None:
  """Waits until no write or read is in flight; raises a pending asynchronous I/O error."""
  _call_err(lib().ssdtrain_flush)


def release_all() -> None:
  """Drains in-flight I/O and frees every stored activation."""
  _call_err(lib().ssdtrain_release_all)


def shutdown() -> None:
  """Releases everything and closes (deletes) the store files."""
  _call_err(lib().ssdtrain_shutdown)


def file_paths() -> list[str]:
  """One line per store file: its path or ``<dir>/(unlinked)``."""
  return [p for p in _call_out(lib().ssdtrain_file_paths).splitlines() if p]


def debug_truncate(size: int = 0) -> None:
  """Test hook: cuts every store file to ``size`` bytes (data stored beyond is lost)."""
  _call_err(lib().ssdtrain_debug_truncate, int(size))


def debug_corrupt(offset: int) -> None:
  """Test hook: flips one byte of the store at logical (striped) offset ``offset``."""
  _call_err(lib().ssdtrain_debug_corrupt, int(offset))


# An entry released by release_all() only, never counted, never swept (SSDTRAIN_USES_MANUAL).
MANUAL = attributes.USES_MANUAL


def store_host(address: int, nbytes: int, site: int, uses: int = MANUAL) -> tuple[int, int]:
  """Stores ``nbytes`` at host ``address`` in the NVMe tier, as the CPU store handler does;
  returns the handle. ``uses``: loads after which the entry is released (MANUAL: kept until
  release_all()). The caller keeps the buffer alive for the call only."""
  handle = (ctypes.c_uint32 * 2)()
  _call_err(
    lib().ssdtrain_store_host, ctypes.c_void_p(address), int(nbytes), int(site), int(uses), handle
  )
  return handle[0], handle[1]


def sweep(pairs, seq_limit: int, *, retire: bool = False) -> int:
  """Releases entries older than ``seq_limit`` whose handle is not a row of ``pairs`` (an
  (n, 2) C-contiguous uint32 array); returns how many were released. ``retire``: retires them
  instead (a load still finds a retired entry; its room goes to the next store that needs it)."""
  pairs = np.ascontiguousarray(pairs, dtype=np.uint32).reshape(-1, 2)
  released = ctypes.c_uint64(0)
  _call_err(
    lib().ssdtrain_sweep,
    pairs.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
    pairs.shape[0],
    int(seq_limit),
    int(retire),
    ctypes.byref(released),
  )
  return int(released.value)


def sweep_requested() -> bool:
  """True when the engine has stored enough uncounted entries that a sweep is due."""
  return bool(lib().ssdtrain_sweep_requested())


def load_host(handle: tuple[int, int], address: int, nbytes: int, site: int) -> None:
  """Loads a tensor stored by :func:`store_host` into ``nbytes`` at host ``address``."""
  h = (ctypes.c_uint32 * 2)(*handle)
  _call_err(lib().ssdtrain_load_host, h, ctypes.c_void_p(address), int(nbytes), int(site))


TIMELINE_FIELDS = ("op", "device", "bytes", "start", "end", "name")


def timeline() -> list[dict[str, Any]]:
  """The device copies of the latest steps, oldest first, and clears them: dicts with ``op``
  (stage_in, d2h, read_ahead, load_staged, load_host, compute_wait), ``device``, ``bytes``,
  ``start`` / ``end`` (seconds of the host's monotonic clock, from CUDA events) and ``name``
  (the tag). Empty where no CUDA handler ran."""
  out = []
  for line in _call_out(lib().ssdtrain_timeline).splitlines():
    op, device, nbytes, start, end, name = line.split(" ", 5)
    out.append(
      {
        "op": op,
        "device": int(device),
        "bytes": int(nbytes),
        "start": float(start),
        "end": float(end),
        "name": "" if name == "-" else name,
      }
    )
  return out


LINK_HOST_KINDS = {"alloc": 0, "registered": 1, "registered_hugepages": 2}


class LinkRates(NamedTuple):
  """What :func:`probe_link` measured: GB/s medians and the copies' wall time."""

  d2h: float  # device-to-host alone
  h2d: float  # host-to-device alone
  duplex_d2h: float  # device-to-host while host-to-device runs
  duplex_h2d: float  # host-to-device while device-to-host runs
  copy_seconds: float  # from the return of on_ready (or the buffers' setup) to the last copy


def probe_link(
  device: int = 0,
  nbytes: int = 1 << 30,
  repeats: int = 5,
  host: str = "alloc",
  on_ready: Callable[[], None] | None = None,
) -> LinkRates:
  """Pinned host <-> GPU ``device`` copies of ``nbytes``, each direction alone and both at
  once, medians of ``repeats``. ``host``: the host buffers are ``"alloc"`` (cudaHostAlloc),
  ``"registered"`` (mmap + cudaHostRegister, as the engine's host tier and cache) or
  ``"registered_hugepages"`` (the same with MADV_HUGEPAGE). ``on_ready``: called once the
  buffers are ready, before the first copy (start other GPU work there to measure the copies
  next to it: allocating the buffers may wait for work already running); an exception it
  raises is raised here after the copies. OSError(ENOSYS) in a build without CUDA handlers."""
  if host not in LINK_HOST_KINDS:
    raise ValueError(f"host: expected one of {sorted(LINK_HOST_KINDS)}, got {host!r}")
  if on_ready is not None and not callable(on_ready):
    raise TypeError(f"on_ready: expected a callable or None, got {on_ready!r}")
  raised: list[BaseException] = []

  def ready() -> None:
    try:
      on_ready()
    except BaseException as e:  # noqa: BLE001 - re-raised below, not across the C frame
      raised.append(e)

  callback = _READY_FN(ready) if on_ready is not None else _READY_FN()
  out = (ctypes.c_double * 5)()
  _call_err(
    lib().ssdtrain_probe_link,
    int(device),
    int(nbytes),
    int(repeats),
    LINK_HOST_KINDS[host],
    callback,
    out,
  )
  if raised:
    raise raised[0]
  return LinkRates(*(float(v) for v in out))


def _atexit_shutdown() -> None:
  try:
    if _lib is not None:
      shutdown()
  except Exception:  # noqa: BLE001 - interpreter is exiting
    pass
