"""The store's options: one table, :data:`OPTIONS`, and everything derived from it.

Each row names an option once: its :class:`StoreConfig` field and ``configure()`` keyword, its
``SSDTRAIN_*`` environment variable, how a value is read and checked, its default (a value, or
:class:`Computed` when the store opens), one line of documentation and how it is sent to the
engine. From the table come :class:`StoreConfig`, the keywords ``configure()`` accepts
(:func:`read_changes`), the environment reading (:func:`from_environment`), the ``key=value``
lines the engine parses (:func:`engine_options`: the engine has no defaults of its own and
refuses a missing or unknown key) and the table of the docs' options page
(``python -m jax_ssdtrain._src.options --write docs/options.md``).

Adding an option: one row here, plus the field it sets in ``xla_ffi`` (``Config`` in
``xla_ffi/src/config.h`` and its line in ``config.cc``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno as _errno
import math
import os
import re
import shutil
import string
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jax_ssdtrain._src import jax_internals
from jax_ssdtrain._src.options import staging as _staging

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------------------------
# Sizes and rates (public: ``jax_ssdtrain.parse_size``)

# Unit (lower case) -> bytes. K, Ki, KiB: powers of 1024; KB: powers of 1000 (likewise M, G, T).
_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
  _UNITS[_prefix] = _UNITS[_prefix + "i"] = _UNITS[_prefix + "ib"] = 1024**_power
  _UNITS[_prefix + "b"] = 1000**_power

SIZE_FORMS = (
  "an integer number of bytes (1048576), or a number with a unit: B; K, KiB (1024), KB (1000); "
  "M, MiB, MB; G, GiB, GB; T, TiB, TB (any case; e.g. 512MiB, 4G, 1.5GB)"
)


def parse_size(value: int | float | str, *, what: str = "size") -> int:
  """``"512MiB"``, ``"4G"``, ``"1.5GB"``, ``1048576`` -> bytes.

  K, M, G, T alone or with ``iB`` are powers of 1024 (``"4G"`` = ``"4GiB"`` = 4 * 2**30);
  with ``B`` only, powers of 1000 (``"4GB"`` = 4e9). ``what`` names the value in errors.
  """
  if isinstance(value, bool):
    raise ValueError(f"{what}: expected a size in bytes, got {value!r}; accepted: {SIZE_FORMS}")
  if isinstance(value, int):
    return value
  if isinstance(value, float) and math.isfinite(value):
    return int(value)
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value), re.IGNORECASE)
  unit = _UNITS.get(m.group(2).lower()) if m else None
  if unit is None or not math.isfinite(float(m.group(1))):
    raise ValueError(f"{what}: cannot read {value!r} as a size; accepted: {SIZE_FORMS}")
  return int(float(m.group(1)) * unit)


def parse_bandwidth(value: int | float | str | None, *, what: str = "bandwidth") -> int | None:
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


def human_bytes(n: int) -> str:
  """``1073741824`` -> ``"1 GiB"`` (exact binary units where they divide, else bytes)."""
  for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
    if n and n % size == 0:
      return f"{n // size} {unit}"
  return f"{n} B"


# ---------------------------------------------------------------------------------------------
# Kinds of value: how a value given to configure() or read from the environment becomes the
# field's value, how it is checked, shown in the docs and encoded for the engine.


def _same(value, what):
  return value


@dataclasses.dataclass(frozen=True)
class Kind:
  annotation: str  # the StoreConfig field's type
  values: str  # the docs' "values" column
  check: Callable[[Any, str], Any]  # a field's value -> the same, normalised; ValueError if bad
  show: Callable[[Any], str]  # a default as the docs show it
  encode: Callable[[Any], int | str]  # a value as the engine receives it
  parse: Callable[[Any, str], Any] = _same  # a configure() keyword's value -> the field's
  from_text: Callable[[str, str], Any] = _same  # an environment variable's text -> a keyword's

  def read(self, value: Any, what: str) -> Any:
    """A value given to configure() -> the field's value; ValueError naming ``what``."""
    return self.check(self.parse(value, what), what)

  def read_text(self, text: str, what: str) -> Any:
    """An environment variable's text -> the field's value; ValueError naming ``what``."""
    return self.read(self.from_text(text, what), what)


def _check_int(value, what, low, high, multiple=1, unit="an integer"):
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{what}: expected {unit}, got {value!r}")
  if value < low:
    raise ValueError(f"{what}: expected {unit} >= {low}, got {value!r}")
  if value > high:
    raise ValueError(f"{what}: expected {unit} <= {high}, got {value!r}")
  if value % multiple:
    raise ValueError(f"{what}: expected {unit} that is a multiple of {multiple}, got {value!r}")
  return value


def _check_size(value, what, low, high, multiple):
  """A size in bytes checked: an int in range (a float or another type is refused, saying
  that an int number of bytes or a size string is wanted)."""
  if isinstance(value, bool) or not isinstance(value, int):
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
      hint = f": pass {int(value)} or {human_size(int(value))!r}"
    elif isinstance(value, float):
      hint = ": a size is a whole number of bytes"
    else:
      hint = ""
    raise ValueError(
      f"{what}: expected a size in bytes, an int number of bytes or a size string such as "
      f"'1.5GiB' or '512MiB', got the {type(value).__name__} {value!r}{hint}"
    )
  return _check_int(value, what, low, high, multiple, "a size in bytes")


def human_size(n: int) -> str:
  """``n`` bytes as the shortest size string that :func:`parse_size` reads back exactly, with a
  unit where one divides it to at most three decimals (``"1.5GiB"``, ``"1.5GB"``), else the
  bytes."""
  forms = [str(n)]
  for unit in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB"):
    unit_bytes = _UNITS[unit.lower()]
    if n >= unit_bytes and (n * 1000) % unit_bytes == 0:
      text = f"{n * 1000 // unit_bytes / 1000:.3f}".rstrip("0").rstrip(".") + unit
      if parse_size(text) == n:
        forms.append(text)
  return min(forms, key=len)


def size(low: int = 0, high: int = INT64_MAX, multiple: int = 1) -> Kind:
  """Bytes: an int, or a string with a unit (:func:`parse_size`)."""
  more = f" >= {human_bytes(low)}" if low > 1 else " > 0" if low == 1 else ""
  return Kind(
    annotation="int",
    values=f"size{more}" + (f", multiple of {human_bytes(multiple)}" if multiple > 1 else ""),
    check=lambda v, what: _check_size(v, what, low, high, multiple),
    show=human_bytes,
    encode=int,
    parse=lambda v, what: parse_size(v, what=what) if isinstance(v, str) else v,
  )


def optional_size(low: int = 1) -> Kind:
  """Bytes, or None (the default is computed when the store opens)."""
  inner = size(low)
  return dataclasses.replace(
    inner,
    annotation="int | None",
    parse=lambda v, what: None if v is None else inner.parse(v, what),
    check=lambda v, what: None if v is None else inner.check(v, what),
  )


def size_or_auto(low: int = 0) -> Kind:
  """Bytes, or ``"auto"`` (None in the field: sized from the programs when they first run)."""
  inner = size(low)

  def parse(v, what):
    if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
      return None
    return inner.parse(v, what)

  return dataclasses.replace(
    inner,
    annotation="int | None",
    values=f"`auto` or a {inner.values}",
    parse=parse,
    check=lambda v, what: None if v is None else inner.check(v, what),
    show=lambda v: "auto" if v is None else human_bytes(v),
  )


def count(low: int, high: int) -> Kind:
  def from_text(text, what):
    try:
      return int(text.strip())
    except ValueError:
      raise ValueError(f"{what}: expected an integer, got {text!r}") from None

  return Kind(
    annotation="int",
    values=f"integer in [{low}, {high}]",
    check=lambda v, what: _check_int(v, what, low, high),
    show=str,
    encode=int,
    from_text=from_text,
  )


_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def switch(auto: bool) -> Kind:
  """True / False, and None for ``auto`` where ``auto``; in text: on/off, true/false, yes/no,
  1/0 (and auto)."""
  choices = "on / off" + (" / auto" if auto else "")

  def from_text(text, what):
    t = text.strip().lower()
    if t in _ON:
      return True
    if t in _OFF:
      return False
    if auto and t == "auto":
      return None
    raise ValueError(f"{what}: expected {choices.replace(' / ', '/')}, got {text!r}")

  def check(v, what):
    if v is None and auto or isinstance(v, bool):
      return v
    raise ValueError(f"{what}: expected True, False{' or None (auto)' if auto else ''}, got {v!r}")

  return Kind(
    annotation="bool | None" if auto else "bool",
    values=choices,
    check=check,
    show=lambda v: "auto" if v is None else "on" if v else "off",
    encode=lambda v: 2 if v is None else int(v),
    from_text=from_text,
  )


def choice(*names: str) -> Kind:
  """One of ``names`` (any case in text); the engine receives its index."""

  def check(v, what):
    if isinstance(v, str) and v in names:
      return v
    raise ValueError(f"{what}: expected one of {', '.join(map(repr, names))}, got {v!r}")

  return Kind(
    annotation="str",
    values=" / ".join(f"`{n}`" for n in names),
    check=check,
    show=lambda v: f"`{v}`",
    encode=names.index,
    from_text=lambda text, what: text.strip().lower(),
  )


def bandwidth() -> Kind:
  """Bytes/s (``"7GB/s"``, ``7e9``) or None / ``"off"`` (no cap); the engine receives 0 for none."""

  def check(v, what):
    if v is None:
      return v
    return _check_int(v, what, 1, INT64_MAX, unit="a positive integer (bytes/s) or None")

  return Kind(
    annotation="int | None",
    values="bytes/s (`7GB/s`, `512MiB/s`, `7e9`) or `off`",
    check=check,
    show=lambda v: "none" if v is None else f"{v} B/s",
    encode=lambda v: v or 0,
    parse=lambda v, what: parse_bandwidth(v, what=what),
  )


def directories() -> Kind:
  return Kind(
    annotation="tuple[str, ...]",
    values="path or list of paths (`:`-separated in the variable)",
    check=lambda v, what: _checked_paths(v, what),
    show=lambda v: ", ".join(v),
    encode=":".join,
    parse=lambda v, what: _directories(v, what),
    from_text=lambda text, what: [p for p in text.split(":") if p],
  )


# ---------------------------------------------------------------------------------------------
# The table


@dataclasses.dataclass(frozen=True)
class Computed:
  """A default computed when the store opens (the field holds None until then)."""

  compute: Callable[[Opening], Any]
  doc: str


@dataclasses.dataclass(frozen=True)
class Option:
  """One store option. ``name``: the StoreConfig field, configure() keyword and engine key."""

  name: str
  env: str | None  # the SSDTRAIN_* variable defaults() reads (None: none)
  kind: Kind
  default: Any  # a value, or Computed
  doc: str  # one line for the docs
  keyword: str | None = None  # configure()'s keyword when it is not ``name``
  default_doc: str | None = None  # the default as the docs say it, when not kind.show(default)
  # Set from another option's given value when this one is not given: (that option, how).
  follows: tuple[str, Callable[[Any], Any]] | None = None
  # The engine's value from the field's (the default computed): encodes through kind otherwise.
  to_engine: Callable[[Any, Opening], int | str] | None = None
  # False: read on the Python side only (no engine line; the engine would refuse its key).
  engine: bool = True

  @property
  def keywords(self) -> tuple[str, ...]:
    return (self.keyword, self.name) if self.keyword else (self.name,)

  def read(self, value: Any, what: str | None = None) -> Any:
    """A value given to configure() -> the field's (ValueError naming ``what``)."""
    return self.kind.read(value, what or self.keywords[0])

  def read_text(self, text: str, what: str | None = None) -> Any:
    """Text as the environment variable takes it (``"off"``, ``"4GiB"``) -> the field's value."""
    return self.kind.read_text(text, what or self.env or self.keywords[0])

  @property
  def field_default(self) -> Any:
    return None if isinstance(self.default, Computed) else self.default

  def engine_value(self, value: Any, opening: Opening) -> str:
    if value is None and isinstance(self.default, Computed):
      value = self.default.compute(opening)
    out = self.to_engine(value, opening) if self.to_engine else self.kind.encode(value)
    return str(out)


@dataclasses.dataclass(frozen=True)
class Opening:
  """What the engine's values depend on beyond the options: the store's directories (the
  configured ones, or the private temp dir) and their free space."""

  config: Any  # StoreConfig
  directories: tuple[str, ...]
  free_bytes: int
  # The arena under staging_bytes="auto" (config.py sizes it from the program that opens it).
  staging_bytes: int = _staging.FLOOR_BYTES


def _capacity_to_engine(capacity: int, opening: Opening) -> int:
  if capacity > opening.free_bytes:
    free = opening.free_bytes
    raise ValueError(
      f"capacity_bytes={capacity} ({capacity / GiB:.2f} GiB) is beyond the free "
      f"space of the store directories {list(opening.directories)}: {free} bytes "
      f"({free / GiB:.2f} GiB)"
    )
  return capacity


OPTIONS: tuple[Option, ...] = (
  Option(
    "directories",
    "SSDTRAIN_DIR",
    directories(),
    (),
    "Store directories, one per drive: tensors are striped across them. `{process}` is "
    "replaced by the process index (`jax.process_index()`); `{device}` expands to one directory "
    "per local device, which then holds only that device's tensors (see `device_groups`).",
    keyword="directory",
    default_doc="a private temporary directory, removed at exit",
    to_engine=lambda value, opening: ":".join(opening.directories),
  ),
  Option(
    "capacity_bytes",
    "SSDTRAIN_CAPACITY",
    optional_size(low=4 * KiB),
    Computed(
      lambda opening: int(0.9 * opening.free_bytes),
      "90% of the free space of the store directories",
    ),
    "File space of the store, all directories together (taken as used); at most their free space.",
    to_engine=_capacity_to_engine,
  ),
  Option(
    "host_cache_bytes",
    "SSDTRAIN_HOST_CACHE",
    size(low=1),
    1 * GiB,
    "Pinned host buffers of the `nvme` location: write-behind, forwarding and read-ahead "
    "(a tensor of the files larger than it is never read ahead; the store warns).",
  ),
  Option(
    "host_tier_bytes",
    "SSDTRAIN_HOST_TIER",
    size(),
    8 * GiB,
    "Capacity of the `host` location (pinned host memory, taken as used).",
  ),
  Option(
    "staging_bytes",
    "SSDTRAIN_STAGING",
    size_or_auto(),
    None,
    "Device staging arena of each GPU: stores copy into it on the compute stream and loads "
    "copy out of it; it holds what the link to the host cannot carry at once (what it cannot "
    "hold goes over the link directly, on the compute stream). `auto`: the bytes the largest "
    "layer of the programs run so far stores (at least 1 GiB, at most `staging_max_bytes` and "
    "half of the device memory the program leaves free), chosen when each program that stores "
    "first runs (the arena grows, never shrinks); `stats()['staging_bytes']` reports it.",
    default_doc="auto",
    to_engine=lambda value, opening: opening.staging_bytes if value is None else value,
  ),
  Option(
    "staging_max_bytes",
    "SSDTRAIN_STAGING_MAX",
    size(),
    16 * GiB,
    'The most `staging_bytes="auto"` takes (it takes at most half of the device memory the '
    "program leaves free too); no effect on an explicit `staging_bytes`.",
    engine=False,
  ),
  Option(
    "io_threads",
    "SSDTRAIN_IO_THREADS",
    count(1, 256),
    8,
    "Threads reading and writing the store files.",
  ),
  Option(
    "chunk_bytes",
    "SSDTRAIN_CHUNK",
    size(low=4 * KiB, high=4 * GiB, multiple=4 * KiB),
    8 * MiB,
    "Largest single read or write of a store file.",
  ),
  Option(
    "prefetch_bytes",
    "SSDTRAIN_PREFETCH",
    size(),
    1 * GiB,
    "Read-ahead budget: bytes read from the files ahead of the loads that need them (a "
    "tensor larger than it is never read ahead; the store warns).",
  ),
  Option(
    "o_direct",
    "SSDTRAIN_O_DIRECT",
    switch(auto=True),
    None,
    "Open the store files with O_DIRECT; `auto` falls back to buffered I/O with a warning "
    "where the filesystem refuses it (tmpfs), `on` makes that an error.",
  ),
  Option(
    "gds",
    "SSDTRAIN_GDS",
    switch(auto=True),
    None,
    "GPUDirect Storage through kvikio where usable (builds with kvikio only).",
  ),
  Option(
    "forwarding",
    "SSDTRAIN_FORWARDING",
    switch(auto=False),
    True,
    "Serve loads from copies still in host or staging memory, and skip the writes of tensors "
    "loaded before their write started.",
  ),
  Option(
    "on_full",
    "SSDTRAIN_ON_FULL",
    choice("error", "keep"),
    "error",
    "When the file space is full: `error` raises (naming `capacity_bytes`); `keep` keeps the "
    "tensor in the host tier instead (warned once; `full_kept_*` statistics).",
  ),
  Option(
    "verify",
    "SSDTRAIN_VERIFY",
    switch(auto=False),
    False,
    "crc32c of every tensor written to a file, checked after every read of it "
    "(`checksum_failures` statistic).",
  ),
  Option(
    "exact_loads",
    "SSDTRAIN_EXACT_LOADS",
    switch(auto=False),
    False,
    "GPU loads read their handle from the device first (a stream sync per load) instead of "
    "predicting it.",
  ),
  Option(
    "bandwidth_cap",
    "SSDTRAIN_BANDWIDTH_CAP",
    bandwidth(),
    None,
    "Caps each direction of the file I/O at this rate, all threads together; over a RAM-backed "
    "directory (`/dev/shm`) it emulates a drive of that speed.",
  ),
  Option(
    "device_groups",
    None,
    count(0, 4096),
    0,
    "Set by `{device}` directories (or given with an ordered list of directories): directory "
    "i holds only the tensors of local device i % `device_groups`, capacity split evenly. "
    "0: every tensor is striped over all directories.",
    follows=("directories", lambda value: _device_groups(value)),
    to_engine=lambda value, opening: value if opening.config.directories else 0,
  ),
)

# The other SSDTRAIN_* variables something in this repository reads (not store options): an
# SSDTRAIN_* variable that is neither one of these nor an option's is warned about at import
# (check_environment), naming the closest option's. tests/test_options.py checks this list
# against the variables the code reads.
OTHER_VARIABLES: dict[str, str] = {
  "SSDTRAIN_LIB": "the native library to load (jax_ssdtrain/_src/native.py)",
  "SSDTRAIN_ALLOW_UNTESTED_JAX": "import with an untested JAX release (jax_ssdtrain/__init__.py)",
  "SSDTRAIN_FAULT": "test hook: fail the n-th read or write (xla_ffi/src/config.cc)",
  "SSDTRAIN_CRC_SOFTWARE": "test hook: crc32c without SSE4.2 (xla_ffi/src/crc32c.cc)",
  "SSDTRAIN_CUDA": "build: CUDA handlers AUTO/ON/OFF (xla_ffi/CMakeLists.txt)",
  "SSDTRAIN_KVIKIO": "build: kvikio AUTO/ON/OFF (xla_ffi/CMakeLists.txt)",
  "SSDTRAIN_CUDA_ARCHITECTURES": "build: CUDA architectures (xla_ffi/CMakeLists.txt)",
  "SSDTRAIN_TEST_PLATFORM": "tests: the backend of tests/test_reliability.py",
}

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
BY_KEYWORD: dict[str, Option] = {k: o for o in OPTIONS for k in o.keywords}


def default(name: str) -> Any:
  """The default of option ``name`` (None where it is computed when the store opens)."""
  return BY_NAME[name].field_default


def _store_config_doc() -> str:
  lines = [
    "The store's settings, one field per option (``jax_ssdtrain._src.options.OPTIONS``; the docs'",
    "Store options page lists them). Built by :func:`jax_ssdtrain.configure` and",
    ":func:`jax_ssdtrain.default_config`, which read and check every value.",
    "",
  ]
  for o in OPTIONS:
    shown = o.default_doc or (
      o.default.doc if isinstance(o.default, Computed) else o.kind.show(o.default)
    )
    lines.append(f"- ``{o.name}`` (default: {shown}): {o.doc}")
  return "\n".join(lines)


StoreConfig = dataclasses.make_dataclass(
  "StoreConfig",
  [(o.name, o.kind.annotation, dataclasses.field(default=o.field_default)) for o in OPTIONS],
  frozen=True,
)
StoreConfig.__module__ = "jax_ssdtrain"
StoreConfig.__doc__ = _store_config_doc()


class UnknownOptionError(TypeError, ValueError):
  """``configure()`` got an option it does not know (both a TypeError and a ValueError)."""


# ---------------------------------------------------------------------------------------------
# Derived: configure()'s keywords, the environment, the engine's lines


def read_changes(given: Mapping[str, Any]) -> dict[str, Any]:
  """configure()'s keywords (``directory`` or ``directories``, the other field names) -> the
  fields they set, read and checked; options that follow a given one (``device_groups``) are
  derived from it unless given too."""
  unknown = sorted(set(given) - set(BY_KEYWORD))
  if unknown:
    raise UnknownOptionError(
      f"configure: unknown option(s) {unknown}; known: {[o.keywords[0] for o in OPTIONS]}"
    )
  changes: dict[str, Any] = {}
  raw: dict[str, Any] = {}
  for keyword, value in given.items():
    option = BY_KEYWORD[keyword]
    if option.name in changes:
      raise TypeError(f"configure: {' and '.join(option.keywords)} given together")
    changes[option.name] = option.read(value, keyword)
    raw[option.name] = value
  return _with_followers(changes, raw)


def from_environment(environ: Mapping[str, str] | None = None) -> Any:
  """The configuration the ``SSDTRAIN_*`` variables give over the table's defaults (the
  defaults computed when the store opens stay None)."""
  environ = os.environ if environ is None else environ
  changes: dict[str, Any] = {}
  raw: dict[str, Any] = {}
  for option in OPTIONS:
    text = environ.get(option.env) if option.env else None
    if text is None or not text.strip():
      continue
    raw[option.name] = option.kind.from_text(text.strip(), option.env)  # follows read it
    changes[option.name] = option.read(raw[option.name], option.env)
  return check(StoreConfig(**_with_followers(changes, raw)))


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
  """Checks the ``SSDTRAIN_*`` variables when ``jax_ssdtrain`` is imported, before any program
  is traced: a bad value of an option's variable raises a ValueError naming the variable, its
  value and the accepted forms; the same checks as :func:`from_environment` except those that
  need the devices or the distributed runtime (``{device}`` and ``{process}`` are expanded when
  the store opens). Returns a warning for each variable that is not an option's (nor one of
  :data:`OTHER_VARIABLES`), naming the closest option's; the caller warns."""
  environ = os.environ if environ is None else environ
  changes: dict[str, Any] = {}
  for option in OPTIONS:
    text = environ.get(option.env) if option.env else None
    if text is None or not text.strip():
      continue
    if option.name == "directories":
      paths = option.kind.from_text(text.strip(), option.env)
      for path in paths:
        _check_template(path, option.env)
      _checked_paths(paths, option.env)
      _device_groups_syntax(paths, option.env)
    else:
      changes[option.name] = option.read_text(text.strip())
  check(StoreConfig(**changes), variables=True)
  return [unknown_variable_warning(name) for name in sorted(environ) if _unknown_variable(name)]


def _unknown_variable(name: str) -> bool:
  return (
    name.startswith("SSDTRAIN_")
    and name not in OTHER_VARIABLES
    and all(name != o.env for o in OPTIONS)
  )


def unknown_variable_warning(name: str) -> str:
  """The warning for an ``SSDTRAIN_*`` variable nothing reads."""
  known = [o.env for o in OPTIONS if o.env]
  prefix = len("SSDTRAIN_")  # compared without it: every name shares it
  close = difflib.get_close_matches(
    name[prefix:], [k[prefix:] for k in known + list(OTHER_VARIABLES)], n=1, cutoff=0.6
  )
  if close:
    hint = f"did you mean SSDTRAIN_{close[0]}?"
  else:
    hint = f"the options' variables are {', '.join(known)}"
  return (
    f"jax_ssdtrain: the environment variable {name} is not an option of jax_ssdtrain and is "
    f"ignored; {hint} (docs/options.md lists them)"
  )


def _with_followers(changes: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
  for option in OPTIONS:
    if option.follows and option.name not in changes and option.follows[0] in raw:
      changes[option.name] = option.follows[1](raw[option.follows[0]])
  return changes


def check(cfg: Any, *, variables: bool = False) -> Any:
  """Checks every field of a StoreConfig and the options together; returns it normalised.
  ``variables``: the values come from the environment (errors name the variables too)."""
  fields = {o.name: o.kind.check(getattr(cfg, o.name), o.name) for o in OPTIONS}
  cfg = dataclasses.replace(cfg, **fields)
  groups = cfg.device_groups
  if groups and len(cfg.directories) % groups:
    raise ValueError(
      f"device_groups={groups} does not divide the {len(cfg.directories)} store "
      f"directories {list(cfg.directories)}"
    )
  ram = _physical_ram()
  if ram:

    def named(key):
      return BY_NAME[key].env if variables else key

    for key in ("host_tier_bytes", "host_cache_bytes"):
      if getattr(cfg, key) > ram:
        raise ValueError(
          f"{named(key)}={getattr(cfg, key)} ({getattr(cfg, key) / GiB:.2f} GiB) is "
          f"beyond the physical memory of this machine ({ram / GiB:.2f} GiB)"
        )
    both = cfg.host_tier_bytes + cfg.host_cache_bytes
    if both > ram:
      raise ValueError(
        f"{named('host_tier_bytes')} + {named('host_cache_bytes')} = {both} "
        f"({both / GiB:.2f} GiB) is beyond the physical memory of this machine "
        f"({ram / GiB:.2f} GiB)"
      )
  return cfg


def engine_options(
  cfg: Any, directories: Sequence[str], staging_bytes: int = _staging.FLOOR_BYTES
) -> dict[str, str]:
  """The engine's ``key=value`` settings for ``cfg`` with its files in ``directories`` (the
  configured ones, or the private temp dir): one per option the engine reads, defaults
  computed; ``staging_bytes``: the arena where ``cfg.staging_bytes`` is ``"auto"``."""
  directories = tuple(directories)
  free = free_bytes_total(directories)
  if free < 1 << 20:
    raise OSError(
      _errno.ENOSPC,
      f"store directory {', '.join(directories)} cannot hold the "
      f"store's files: its filesystem has {free} bytes free (set SSDTRAIN_DIR or "
      "configure(directory=...) to a directory on a local disk)",
    )
  opening = Opening(cfg, directories, free, staging_bytes)
  return {o.name: o.engine_value(getattr(cfg, o.name), opening) for o in OPTIONS if o.engine}


def engine_text(settings: Mapping[str, str]) -> str:
  """The lines the engine parses (``Config::Parse``): ``key=value``, one per option."""
  return "".join(f"{k}={v}\n" for k, v in settings.items())


# ---------------------------------------------------------------------------------------------
# Store directories


def _as_list(value) -> list:
  """``directory=``: one path or a list of paths."""
  return [value] if isinstance(value, (str, os.PathLike)) else list(value)


def _device_groups(value) -> int:
  """The number of local devices when every directory has ``{device}``; 0 when none has."""
  _device_groups_syntax(value)
  if not any("{device}" in os.fspath(item) for item in _as_list(value)):
    return 0
  return len(_local_devices())


def _directories(value, what: str = "directory") -> tuple[str, ...]:
  if value is None or isinstance(value, (bytes, int, float)):
    raise ValueError(f"{what}: expected a path or a list of paths, got {value!r}")
  try:
    items = _as_list(value)
  except TypeError:
    raise ValueError(f"{what}: expected a path or a list of paths, got {value!r}") from None
  out = []
  for item in items:
    if not isinstance(item, (str, os.PathLike)) or not os.fspath(item):
      raise ValueError(f"{what}: expected a path or a list of paths, got {item!r}")
    out.extend(_expand_template(os.fspath(item), what))
  return _checked_paths(out, what)


# Placeholders of a store directory -> their values (one directory per value).
_PLACEHOLDERS = {
  "process": lambda: [str(_process_index())],
  "device": lambda: [str(i) for i in range(len(_local_devices()))],  # local index
}


def _device_groups_syntax(value, what: str = "directory") -> None:
  """``{device}`` in every directory or in none (without counting the devices)."""
  items = [os.fspath(i) for i in _as_list(value)]
  per_device = ["{device}" in item for item in items]
  if any(per_device) and not all(per_device):
    raise ValueError(f"{what}: {{device}} must be in every store directory or in none, got {items}")


def _check_template(path: str, what: str = "directory") -> list[str]:
  """The placeholders of a directory; ValueError for a malformed or unknown one."""
  if "{" not in path and "}" not in path:
    return []
  try:
    parsed = [
      (f, spec, conv) for _, f, spec, conv in string.Formatter().parse(path) if f is not None
    ]
  except ValueError as e:
    raise ValueError(
      f"{what}: malformed placeholder in {path!r} ({e}); use {{process}} or "
      f"{{device}}, and {{{{ }}}} for literal braces"
    ) from None
  for field, spec, conv in parsed:
    if field not in _PLACEHOLDERS or spec or conv:
      raise ValueError(
        f"{what}: unknown placeholder {{{field}}} in {path!r}; known: "
        f"{', '.join('{' + k + '}' for k in _PLACEHOLDERS)}"
      )
  return sorted({f for f, _, _ in parsed})


def _expand_template(path: str, what: str = "directory") -> list[str]:
  """``{process}`` / ``{device}`` in a directory -> the directories they stand for."""
  if "{" not in path and "}" not in path:
    return [path]
  values = {name: _PLACEHOLDERS[name]() for name in _check_template(path, what)}
  out = [path]
  for name, choices in values.items():
    out = [p.replace("{" + name + "}", v) for p in out for v in choices]
  return [p.replace("{{", "{").replace("}}", "}") for p in out]


def _process_index() -> int:
  # The distributed client's id: set by jax.distributed.initialize(), without starting backends.
  return jax_internals.process_index_without_backends()


def _local_devices():
  return jax.local_devices()


def _checked_paths(paths, what: str = "directory") -> tuple[str, ...]:
  if isinstance(paths, (str, os.PathLike)):
    raise ValueError(f"{what}: expected a tuple of paths, got {paths!r}")
  out = []
  for raw in paths:
    if not isinstance(raw, (str, os.PathLike)) or not os.fspath(raw):
      raise ValueError(f"{what}: expected a path or a list of paths, got {raw!r}")
    path = os.path.abspath(os.fspath(raw))
    if ":" in path or "\n" in path:
      raise ValueError(f"{what}: a path may not contain ':' or a newline, got {path!r}")
    out.append(path)
  if len(set(out)) != len(out):
    raise ValueError(f"{what}: the same directory is listed twice: {out}")
  return tuple(out)


def free_bytes_total(directories: Sequence[str]) -> int:
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


# ---------------------------------------------------------------------------------------------
# The docs' table

DOCS_START = "<!-- options-table:start (generated by python -m jax_ssdtrain._src.options) -->"
DOCS_END = "<!-- options-table:end -->"


def docs_table() -> str:
  """The options as a Markdown table (the generated part of docs/options.md)."""

  def cell(text: str) -> str:
    return text.replace("|", "\\|")

  rows = [
    "| Option | Environment variable | Default | Values | Description |",
    "|---|---|---|---|---|",
  ]
  for o in OPTIONS:
    name = " / ".join(f"`{k}`" for k in o.keywords)
    env = f"`{o.env}`" if o.env else f"(follows `{o.follows[0]}`)" if o.follows else "–"
    if o.default_doc:
      shown = o.default_doc
    elif isinstance(o.default, Computed):
      shown = o.default.doc
    else:
      shown = o.kind.show(o.default)
    rows.append(f"| {name} | {env} | {cell(shown)} | {cell(o.kind.values)} | {cell(o.doc)} |")
  return "\n".join(rows) + "\n"


def docs_section() -> str:
  """The text between (and including) the markers of docs/options.md."""
  return f"{DOCS_START}\n\n{docs_table()}\n{DOCS_END}"


def render_docs(page: str) -> str:
  """``page`` with the text between its markers replaced by the current table."""
  start, end = page.find(DOCS_START[: DOCS_START.index(" (")]), page.find(DOCS_END)
  if start < 0 or end < start:
    raise ValueError(
      f"the page has no generated section: put {DOCS_START!r} and {DOCS_END!r} lines where the "
      "table goes"
    )
  return page[:start] + docs_section() + page[end + len(DOCS_END) :]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m jax_ssdtrain._src.options",
    description="Prints the store options' table, or rewrites it in a docs page.",
  )
  parser.add_argument("--write", metavar="PAGE", help="rewrite the table of PAGE in place")
  parser.add_argument(
    "--check", metavar="PAGE", help="exit 1 when the table of PAGE differs from the options"
  )
  args = parser.parse_args(argv)
  if not args.write and not args.check:
    sys.stdout.write(docs_table())
    return 0
  path = args.write or args.check
  with open(path, encoding="utf-8") as f:
    page = f.read()
  fresh = render_docs(page)
  if args.check:
    if fresh != page:
      print(f"{path}: the options table is out of date; run {parser.prog} --write {path}")
      return 1
    return 0
  if fresh != page:
    with open(path, "w", encoding="utf-8") as f:
      f.write(fresh)
  return 0
