"""The device memory a program leaves for the staging arena (``staging_bytes="auto"``).

The arena is allocated with ``cudaMalloc`` outside XLA's allocator, so what it can take is the
device's free memory as CUDA sees it (``cudaMemGetInfo``: after XLA's pool, which JAX
preallocates by default), less what XLA's allocator must still take from CUDA for the program
(its temporaries and outputs beyond the pool it holds). :func:`program_budget` reads both for
an executable's devices; :func:`cuda_free_bytes` asks the CUDA runtime already loaded in this
process (JAX's), or returns None where there is none (the CPU).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from jax_ssdtrain._src.options import staging

_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_cudart: Any = None  # the runtime, False where none loads


def _runtime():
  global _cudart
  if _cudart is None:
    _cudart = False
    for name in _RUNTIMES:
      try:
        _cudart = ctypes.CDLL(name)
        break
      except OSError:
        continue
  return _cudart or None


def cuda_free_bytes(local_ids: Sequence[int]) -> dict[int, int] | None:
  """``{local CUDA ordinal: free bytes}`` (``cudaMemGetInfo`` on each, the calling thread's
  device restored); None without a CUDA runtime or where a call fails."""
  lib = _runtime()
  if lib is None:
    return None
  current = ctypes.c_int(-1)
  if lib.cudaGetDevice(ctypes.byref(current)) != 0:
    return None
  out = {}
  try:
    for ordinal in local_ids:
      free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
      if lib.cudaSetDevice(int(ordinal)) != 0:
        return None
      if lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
        return None
      out[int(ordinal)] = int(free.value)
  finally:
    lib.cudaSetDevice(current.value)
  return out


def program_budget(executable: Any) -> int | None:
  """The arena's budget on the devices of a compiled program (``xla_executable`` of JAX's
  dispatch: ``get_compiled_memory_stats()``, ``local_devices()``): the least over them of
  :func:`staging.device_budget`; None where the devices report no memory (the CPU) or no CUDA
  runtime answers."""
  try:
    analysis = executable.get_compiled_memory_stats()
    devices = list(executable.local_devices())
    reports = [d.memory_stats() for d in devices]
  except Exception:  # noqa: BLE001 - a backend without memory statistics
    return None
  if not devices or any(not r or "bytes_in_use" not in r for r in reports):
    return None
  free = cuda_free_bytes([getattr(d, "local_hardware_id", d.id) for d in devices])
  if free is None:
    return None
  budgets = []
  for device, report in zip(devices, reports):
    need = report["bytes_in_use"] + analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    pool = report.get("pool_bytes", report.get("bytes_reserved", 0))
    budgets.append(
      staging.device_budget(
        free[getattr(device, "local_hardware_id", device.id)], xla_more_bytes=need - pool
      )
    )
  return min(budgets)
