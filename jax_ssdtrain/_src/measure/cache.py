"""The measurements' on-disk cache: ``$XDG_CACHE_HOME/jax_ssdtrain/probe.json`` (default
``~/.cache``), one JSON object of entries by key (``disk`` keys them by filesystem and request,
``link`` by host, GPU, size and host memory). A cache that cannot be read is empty; one that
cannot be written only costs a new measurement."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path


def path() -> Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jax_ssdtrain" / "probe.json"


def load() -> dict:
  try:
    doc = json.loads(path().read_text())
  except (OSError, ValueError):
    return {}
  return doc if isinstance(doc, dict) else {}


def write(key: str, entry: dict) -> None:
  """Sets entry ``key`` (the file replaced atomically; a failure is reported on stderr)."""
  where = path()
  doc = load()
  doc[key] = entry
  try:
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, where)
  except OSError as e:  # a cache that cannot be written only costs a new measurement
    print(f"jax_ssdtrain.probe: cannot write the cache {where}: {e}", file=sys.stderr)


def entry(key: str, kind: type):
  """The measurement cached at ``key``, a ``kind`` (a dataclass with a ``cached`` field) marked
  ``cached=True``; None where there is none, or one written by another version (other fields)."""
  found = load().get(key)
  if not isinstance(found, dict):
    return None
  try:
    return dataclasses.replace(kind(**found), cached=True)
  except TypeError:  # written by another version
    return None


def remember(key: str, result) -> None:
  """Caches the measurement ``result`` (a dataclass with a ``cached`` field) at ``key``."""
  write(key, dataclasses.asdict(result) | {"cached": False})
