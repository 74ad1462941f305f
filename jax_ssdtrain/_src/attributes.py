"""The engine's FFI attribute codes, read from its public header ``ssdtrain/attributes.h``.

The header (``xla_ffi/include/ssdtrain/attributes.h``) is the contract between the engine and
the programs that call its handlers, and the one place the codes are written: the engine
decodes them from its enums, and this module parses those enums when the package is imported,
so that no code is spelled twice. Every other module takes its codes from here (the tiers:
``location.py``; ``uses``: ``lifetimes.py`` and ``native.py``; a load's ``exact`` and a pass's
``stream_dir``: ``primitives.py``).

Where the header is: in an installed package, ``jax_ssdtrain/include/ssdtrain/attributes.h``
(the wheel ships it, CMake's install rule); in a source checkout, under ``xla_ffi/include``.
Reading it needs no native library (the package imports without one, e.g. to build the docs).
"""

from __future__ import annotations

import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
# A source checkout's header first (the truth there), then the installed package's copy.
CANDIDATES = (
  _PACKAGE.parent / "xla_ffi" / "include" / "ssdtrain" / "attributes.h",
  _PACKAGE / "include" / "ssdtrain" / "attributes.h",
)


def header_path() -> Path:
  """The header this package reads its codes from."""
  for path in CANDIDATES:
    if path.is_file():
      return path
  raise ImportError(
    "jax_ssdtrain: the engine's attribute header ssdtrain/attributes.h is in none of "
    f"{[str(p) for p in CANDIDATES]}: the package is incomplete. Reinstall it (`pip install "
    "jax_ssdtrain`, or `pip install .` in a checkout) or import it from a full source checkout."
  )


def parse(text: str) -> dict[str, dict[str, int]]:
  """``{enum name: {enumerator: value}}`` of the C header ``text``'s ``enum ssdtrain_*``
  definitions. Every enumerator must have its value written out (a decimal integer); a
  definition this cannot read raises ValueError naming it."""
  text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.DOTALL)
  enums: dict[str, dict[str, int]] = {}
  for name, body in re.findall(r"\benum\s+(\w+)\s*\{(.*?)\}\s*;", text, flags=re.DOTALL):
    if name in enums:
      raise ValueError(f"ssdtrain/attributes.h: enum {name} is defined twice")
    values: dict[str, int] = {}
    for item in (part.strip() for part in body.split(",")):
      if not item:
        continue
      m = re.fullmatch(r"(SSDTRAIN_\w+)\s*=\s*(-?\d+)", item)
      if m is None:
        raise ValueError(
          f"ssdtrain/attributes.h: enum {name}: cannot read {item!r}; every enumerator is "
          "written SSDTRAIN_NAME = <decimal integer>"
        )
      if m.group(1) in values or any(m.group(1) in e for e in enums.values()):
        raise ValueError(f"ssdtrain/attributes.h: {m.group(1)} is defined twice")
      values[m.group(1)] = int(m.group(2))
    enums[name] = values
  if text.count("enum ") != len(enums):
    raise ValueError("ssdtrain/attributes.h: an enum definition that cannot be read")
  return enums


HEADER = header_path()
CODES = parse(HEADER.read_text())


def code(enum: str, name: str) -> int:
  """The value of enumerator ``name`` of ``enum ssdtrain_<enum>`` in the header."""
  try:
    return CODES[f"ssdtrain_{enum}"][name]
  except KeyError:
    raise ImportError(
      f"jax_ssdtrain: {HEADER} defines no {name} in enum ssdtrain_{enum}: the package and its "
      "header disagree; reinstall the package (or rebuild the checkout's library) from one tree"
    ) from None


# The store's and the load's `tier`.
TIER_NVME = code("tier", "SSDTRAIN_TIER_NVME")
TIER_HOST = code("tier", "SSDTRAIN_TIER_HOST")
TIER_HOST_THEN_NVME = code("tier", "SSDTRAIN_TIER_HOST_THEN_NVME")
# The store's `uses` below zero.
USES_UNCOUNTED = code("uses", "SSDTRAIN_USES_UNCOUNTED")
USES_MANUAL = code("uses", "SSDTRAIN_USES_MANUAL")
USES_LATER_IN_ORDER = code("uses", "SSDTRAIN_USES_LATER_IN_ORDER")
# The load's `exact`.
LOAD_ACTIVATION = code("load_order", "SSDTRAIN_LOAD_ACTIVATION")
LOAD_READ = code("load_order", "SSDTRAIN_LOAD_READ")
LOAD_STORE_ORDER = code("load_order", "SSDTRAIN_LOAD_STORE_ORDER")
LOAD_STREAM = code("load_order", "SSDTRAIN_LOAD_STREAM")
# A pass's `stream_dir`.
STREAM_DOWN = code("stream_dir", "SSDTRAIN_STREAM_DOWN")
STREAM_NONE = code("stream_dir", "SSDTRAIN_STREAM_NONE")
STREAM_UP = code("stream_dir", "SSDTRAIN_STREAM_UP")
