"""The build matches the runtime: pip's isolated build of this checkout, installed into a fresh
virtual environment whose jaxlib is older than the newest on the index, stores and loads.

Slow (downloads jax/jaxlib into a fresh venv and compiles the library): run by `.ci/run` with
`-m slow`. The mismatch itself (handlers of a newer FFI API than the runtime's) is checked fast
below without a second jaxlib, and so is the C ABI: native.py binds exactly the functions of
xla_ffi/include/ssdtrain/c_api.h and testing.h, with their types; and so are the FFI handlers'
attribute codes: written once, in xla_ffi/include/ssdtrain/attributes.h, from which the engine
decodes them and the package reads them.
"""

import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jax_ssdtrain._src import attributes, native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Older than the newest jaxlib on the index for this Python (3.12+: 0.12.x is the newest);
# on 3.11 the newest available is the oldest supported, 0.10.2.
OLDER_JAX = "0.11.2" if sys.version_info >= (3, 12) else "0.10.2"

STORE_LOAD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_ssdtrain as ssd
    from jax.ad_checkpoint import checkpoint_name
    from jax_ssdtrain._src import attributes, native
    def f(w, x):
        return jnp.sum(jnp.tanh(checkpoint_name(jnp.sin(x @ w), "h")) ** 2)
    w = jnp.ones((64, 64)) / 64
    x = jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)
    ours = jax.jit(jax.grad(jax.checkpoint(f, policy=ssd.offload_policy(["h"], min_bytes=0))))(w, x)
    ref = jax.jit(jax.grad(jax.checkpoint(
        f, policy=jax.checkpoint_policies.save_only_these_names("h"))))(w, x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    ssd.flush()
    from jax_ssdtrain._src import attributes
    print("jax", jax.__version__, "ffi_api", native.build_info()["ffi_api"],
          "stored", ssd.stats()["tensors_written"], "from", native.library_path())
    print("codes from", attributes.HEADER)
    """)


@pytest.mark.slow
def test_isolated_build_runs_on_an_older_jaxlib(tmp_path):
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  py = str(venv / "bin" / "python")
  env = dict(os.environ, SSDTRAIN_CUDA="OFF", PIP_DISABLE_PIP_VERSION_CHECK="1")
  env.pop("SSDTRAIN_LIB", None)
  env.pop("PYTHONPATH", None)
  pip = [py, "-m", "pip", "install", "-q"]
  installed = subprocess.run(
    pip + [f"jax=={OLDER_JAX}", f"jaxlib=={OLDER_JAX}"], capture_output=True, text=True, env=env
  )
  if installed.returncode != 0:
    pytest.skip(f"cannot install jax {OLDER_JAX} from the index: {installed.stderr[-500:]}")
  # A plain `pip install <checkout>`: isolated build, whatever jaxlib pip puts in the build env.
  built = subprocess.run(pip + [ROOT], capture_output=True, text=True, env=env)
  assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
  run = subprocess.run(
    [py, "-c", STORE_LOAD],
    capture_output=True,
    text=True,
    cwd=str(tmp_path),
    env=dict(env, JAX_PLATFORMS="cpu"),
  )
  assert run.returncode == 0, run.stderr[-4000:]
  assert f"jax {OLDER_JAX} ffi_api 0.3 stored 1" in run.stdout, run.stdout
  assert str(venv) in run.stdout  # the installed copy, not the checkout
  # The wheel ships the attribute header, and the installed package reads its codes from it.
  header = str(venv / "lib")
  assert re.search(rf"codes from {re.escape(header)}\S*/jax_ssdtrain/include/ssdtrain/", run.stdout)


def test_newer_ffi_api_than_runtime_refused_with_the_fix(monkeypatch):
  built = tuple(int(p) for p in native.build_info()["ffi_api"].split("."))
  monkeypatch.setattr(native, "runtime_ffi_api", lambda: (built[0], built[1] - 1))
  with pytest.raises(ImportError, match=r"built against XLA FFI API .* Rebuild them .*pip install"):
    native.check_ffi_api()
  monkeypatch.setattr(native, "runtime_ffi_api", lambda: (built[0], built[1] + 2))
  native.check_ffi_api()  # an older handler API is accepted by a newer runtime


def test_runtime_ffi_api_read_from_the_running_jaxlib():
  major, minor = native.runtime_ffi_api()
  assert major == 0 and minor >= 3


# ---- the C ABI: xla_ffi/include/ssdtrain/{c_api,testing}.h and native.py's bindings (_C_API) --

INCLUDE = os.path.join(ROOT, "xla_ffi", "include", "ssdtrain")
C_API_HEADER = os.path.join(INCLUDE, "c_api.h")
TESTING_HEADER = os.path.join(INCLUDE, "testing.h")  # the test hooks, exported beside the C ABI
ATTRIBUTES_HEADER = os.path.join(INCLUDE, "attributes.h")
# The ctypes type that mirrors each C type the header uses (return types: int, void).
C_TYPES = {
  "int": ctypes.c_int,
  "size_t": ctypes.c_size_t,
  "int64_t": ctypes.c_int64,
  "uint64_t": ctypes.c_uint64,
  "char*": ctypes.c_char_p,
  "const char*": ctypes.c_char_p,
  "void*": ctypes.c_void_p,
  "const void*": ctypes.c_void_p,
  "uint32_t*": ctypes.POINTER(ctypes.c_uint32),
  "const uint32_t*": ctypes.POINTER(ctypes.c_uint32),
  "uint64_t*": ctypes.POINTER(ctypes.c_uint64),
  "double*": ctypes.POINTER(ctypes.c_double),
  "ssdtrain_ready_fn": native._READY_FN,
}


def parse_c_api(text):
  """{name: (return type, [parameter types])} of the header's SSDTRAIN_API declarations, the
  types as C spells them ("const char*"); a declaration it cannot read raises."""
  text = re.sub(r"/\*.*?\*/|//[^\n]*|^\s*#[^\n]*", " ", text, flags=re.DOTALL | re.MULTILINE)
  decls = re.findall(r"SSDTRAIN_API\s+([^;(]*?)\s*\(([^;]*?)\)\s*;", text)
  assert len(decls) == text.count("SSDTRAIN_API"), "a declaration the test cannot parse"
  out = {}
  for head, params in decls:
    ret, name = re.fullmatch(r"(.+?)\s*\b(ssdtrain_\w+)", " ".join(head.split())).groups()
    types = []
    for p in params.split(","):
      p = " ".join(p.replace("*", "* ").split())
      if p == "void":
        continue
      # drop the parameter's name, keep its type ("const char* kv" -> "const char*")
      m = re.fullmatch(r"(.+?)\s*\b\w+", p)
      assert m, f"{name}: unnamed parameter {p!r}"
      types.append(m.group(1).replace(" *", "*"))
    assert name not in out, f"{name} declared twice"
    out[name] = (ret, types)
  return out


def c_api_mismatches(header, table):
  """How the bindings `table` (native._C_API's shape) differ from the declarations `header`
  (those of c_api.h and testing.h)."""
  problems = []
  for name in sorted(set(header) - set(table)):
    problems.append(f"{name}: declared in the headers, not bound in native.py")
  for name in sorted(set(table) - set(header)):
    problems.append(f"{name}: bound in native.py, not declared in the headers")
  for name in sorted(set(header) & set(table)):
    (ret, params), (restype, argtypes) = header[name], table[name]
    if len(params) != len(argtypes):
      problems.append(
        f"{name}: {len(params)} parameters in its header, {len(argtypes)} in native.py"
      )
      continue
    want_ret = {"int": ctypes.c_int, "void": None}.get(ret, KeyError)
    if want_ret is KeyError or restype is not want_ret:
      problems.append(f"{name}: returns {ret} in its header, restype {restype} in native.py")
    for i, (c, py) in enumerate(zip(params, argtypes)):
      if C_TYPES.get(c, KeyError) is not py:
        problems.append(f"{name}: parameter {i} is {c} in its header, {py} in native.py")
  return problems


def read_c_api(c_api_text=None, testing_text=None):
  """The declarations of c_api.h and testing.h together (each function in one of them)."""
  c_api = parse_c_api(c_api_text if c_api_text is not None else Path(C_API_HEADER).read_text())
  testing = parse_c_api(
    testing_text if testing_text is not None else Path(TESTING_HEADER).read_text()
  )
  assert not set(c_api) & set(testing), set(c_api) & set(testing)
  return c_api | testing


def test_native_binds_exactly_the_c_api():
  header = read_c_api()
  assert len(header) >= 17, sorted(header)
  assert c_api_mismatches(header, native._C_API) == []
  # Every ssdtrain_* function native.py calls is one it binds.
  with open(native.__file__) as f:
    called = set(re.findall(r"\.(ssdtrain_\w+)\b", f.read()))
  assert called <= set(native._C_API), called - set(native._C_API)


def test_the_test_hooks_are_in_the_testing_header_alone():
  # c_api.h is what a program calls; the hooks that damage the store are testing.h's.
  c_api, testing = (parse_c_api(Path(h).read_text()) for h in (C_API_HEADER, TESTING_HEADER))
  assert set(testing) == {"ssdtrain_debug_truncate", "ssdtrain_debug_corrupt"}, sorted(testing)
  assert not [name for name in c_api if "debug" in name], sorted(c_api)


def test_c_api_check_fails_on_a_mismatch():
  c_api, testing = Path(C_API_HEADER).read_text(), Path(TESTING_HEADER).read_text()
  header = read_c_api()
  # One parameter fewer, a parameter of another type, a function only one side has.
  fewer = read_c_api(testing_text=testing.replace("uint64_t size, char* err", "char* err"))
  assert c_api_mismatches(fewer, native._C_API) == [
    "ssdtrain_debug_truncate: 2 parameters in its header, 3 in native.py"
  ]
  other = read_c_api(c_api.replace("int64_t site, int64_t uses", "int64_t site, int uses"))
  assert len(c_api_mismatches(other, native._C_API)) == 1
  more = dict(native._C_API, ssdtrain_extra=(ctypes.c_int, []))
  assert c_api_mismatches(header, more) == [
    "ssdtrain_extra: bound in native.py, not declared in the headers"
  ]
  fewer_bound = {k: v for k, v in native._C_API.items() if k != "ssdtrain_flush"}
  assert c_api_mismatches(header, fewer_bound) == [
    "ssdtrain_flush: declared in the headers, not bound in native.py"
  ]
  restype = dict(native._C_API, ssdtrain_reset_stats=(ctypes.c_int, []))
  assert len(c_api_mismatches(header, restype)) == 1


def test_the_library_exports_the_c_api_and_the_handlers():
  so = native.lib()
  with open(C_API_HEADER) as f:
    text = f.read()
  for name in read_c_api():  # the test hooks too
    assert hasattr(so, name), name
  # The handlers the header names: the CPU ones in every build, the CUDA ones in CUDA builds.
  handlers = set(re.findall(r"\bSsdtrain\w+(?:Cpu|Cuda)\b", text))
  assert len(handlers) == 6, handlers
  cuda = native.build_info()["cuda"] == 1
  for name in handlers:
    assert hasattr(so, name) == (cuda or name.endswith("Cpu")), name


# ---- the FFI attribute codes: xla_ffi/include/ssdtrain/attributes.h, read by attributes.py ----


def test_every_attribute_code_is_the_public_headers():
  # The package's codes are the header's, each under its name (SSDTRAIN_ dropped), and the
  # header has no code the package does not read.
  from jax_ssdtrain._src import lifetimes, primitives
  from jax_ssdtrain._src.location import TIER_CODES, Location

  assert attributes.HEADER == Path(ATTRIBUTES_HEADER)  # a checkout reads its own header
  enums = attributes.parse(Path(ATTRIBUTES_HEADER).read_text())
  assert set(enums) == {
    "ssdtrain_tier",
    "ssdtrain_uses",
    "ssdtrain_load_order",
    "ssdtrain_stream_dir",
  }, sorted(enums)
  header = {name.removeprefix("SSDTRAIN_"): v for e in enums.values() for name, v in e.items()}
  python = {k: v for k, v in vars(attributes).items() if re.fullmatch(r"[A-Z]+_[A-Z_]+", k)}
  assert python == header
  # Where the package uses them: each is the header's code of its name.
  tiers = enums["ssdtrain_tier"]
  assert TIER_CODES == {
    Location.NVME: tiers["SSDTRAIN_TIER_NVME"],
    Location.HOST: tiers["SSDTRAIN_TIER_HOST"],
    Location.HOST_NVME: tiers["SSDTRAIN_TIER_HOST_THEN_NVME"],
  }
  assert all(Location.from_tier(c) is loc and loc.tier == c for loc, c in TIER_CODES.items())
  assert set(TIER_CODES) == {loc for loc in Location if loc.in_store}
  uses = enums["ssdtrain_uses"]
  assert lifetimes.UNCOUNTED == uses["SSDTRAIN_USES_UNCOUNTED"]
  assert lifetimes.LATER_IN_ORDER == uses["SSDTRAIN_USES_LATER_IN_ORDER"]
  assert native.MANUAL == uses["SSDTRAIN_USES_MANUAL"]
  assert sorted(primitives._LOAD_ORDERS.values()) == sorted(enums["ssdtrain_load_order"].values())


def test_the_engine_decodes_the_codes_by_their_header_names():
  # The engine's enums and constants of these attributes are the header's names, not numbers.
  src = Path(ROOT, "xla_ffi", "src")
  entry = (src / "detail" / "entry.h").read_text()
  for enum in ("Tier", "LoadOrder"):
    body = re.search(rf"enum class {enum} : int32_t \{{(.*?)\}};", entry, re.S).group(1)
    values = re.findall(r"\bk\w+ = (\w+)", body)
    assert values and all(v.startswith("SSDTRAIN_") for v in values), (enum, values)
  uses = re.search(r"static constexpr int64_t (kUncounted.*?);", entry, re.S).group(1)
  assert re.findall(r"= (-?\w+)", uses) == [
    "SSDTRAIN_USES_UNCOUNTED",
    "SSDTRAIN_USES_MANUAL",
    "SSDTRAIN_USES_LATER_IN_ORDER",
  ]
  assert '#include "ssdtrain/attributes.h"' in entry


def test_the_package_reads_its_codes_from_the_header_it_ships(tmp_path):
  # The package as a wheel lays it out (no checkout beside it: the header at
  # jax_ssdtrain/include/ssdtrain/attributes.h, no native library), with every code moved:
  # the package imports, and each code it uses is the moved one. A code copied into a Python
  # file would keep its old value.
  shutil.copytree(
    Path(ROOT, "jax_ssdtrain"),
    tmp_path / "jax_ssdtrain",
    ignore=shutil.ignore_patterns("__pycache__", "*.so", "include"),
  )

  def away(m):  # each code 100 further from zero
    v = int(m.group(2))
    return f"{m.group(1)}{v + 100 if v >= 0 else v - 100}"

  moved = re.sub(r"(SSDTRAIN_\w+ = )(-?\d+)", away, Path(ATTRIBUTES_HEADER).read_text())
  (tmp_path / "jax_ssdtrain" / "include" / "ssdtrain").mkdir(parents=True)
  (tmp_path / "jax_ssdtrain" / "include" / "ssdtrain" / "attributes.h").write_text(moved)
  script = textwrap.dedent("""
    import json
    import jax_ssdtrain
    from jax_ssdtrain._src import attributes, lifetimes, location, native, primitives
    print(json.dumps(dict(
      header=str(attributes.HEADER),
      tiers=sorted(location.TIER_CODES.values()),
      uses=[lifetimes.UNCOUNTED, native.MANUAL, lifetimes.LATER_IN_ORDER],
      orders=sorted(primitives._LOAD_ORDERS.values()),
      dirs=sorted(primitives._STREAM_DIRS),
      available=native.available(),
    )))
    """)
  env = dict(
    os.environ,
    PYTHONPATH=str(tmp_path),
    SSDTRAIN_LIB="/nonexistent/libssdtrain.so",
    JAX_PLATFORMS="cpu",
  )
  run = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env
  )
  assert run.returncode == 0, run.stderr[-3000:]
  import json

  got = json.loads(run.stdout.strip().splitlines()[-1])
  assert got["header"] == str(tmp_path / "jax_ssdtrain" / "include" / "ssdtrain" / "attributes.h")
  assert got["tiers"] == [100, 101, 102]
  assert got["uses"] == [-101, -102, -103]
  assert got["orders"] == [100, 101, 102, 103]
  assert got["dirs"] == [-101, 100, 101]
  assert got["available"] is False


def test_the_header_parser_refuses_what_it_cannot_read():
  assert attributes.parse("enum ssdtrain_x { SSDTRAIN_A = -1, /* c */ SSDTRAIN_B = 2, };") == {
    "ssdtrain_x": {"SSDTRAIN_A": -1, "SSDTRAIN_B": 2}
  }
  with pytest.raises(ValueError, match="cannot read 'SSDTRAIN_B'"):
    attributes.parse("enum ssdtrain_x { SSDTRAIN_A = 0, SSDTRAIN_B };")  # a value implied
  with pytest.raises(ValueError, match="SSDTRAIN_A is defined twice"):
    attributes.parse("enum ssdtrain_x { SSDTRAIN_A = 0 }; enum ssdtrain_y { SSDTRAIN_A = 1 };")
  with pytest.raises(ImportError, match="defines no SSDTRAIN_TIER_TAPE in enum ssdtrain_tier"):
    attributes.code("tier", "SSDTRAIN_TIER_TAPE")


def test_models_locations_are_the_locations():
  # models/ spells its --locations choices without importing jax_ssdtrain (whose import checks
  # the SSDTRAIN_* variables, which scripts/train.py reports in one line after parsing): they
  # are Location's, but "host,nvme", which a comma-separated TAG=LOC list cannot spell.
  import models
  from jax_ssdtrain._src.location import Location

  assert models.LOCATIONS == tuple(loc.value for loc in Location if "," not in loc.value)
