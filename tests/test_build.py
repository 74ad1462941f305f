"""The build matches the runtime: pip's isolated build of this checkout, installed into a fresh
virtual environment whose jaxlib is older than the newest on the index, stores and loads.

Slow (downloads jax/jaxlib into a fresh venv and compiles the library): run by `.ci/run` with
`-m slow`. The mismatch itself (handlers of a newer FFI API than the runtime's) is checked fast
below without a second jaxlib, and so is the C ABI: native.py binds exactly the functions of
xla_ffi/include/ssdtrain/c_api.h, with their types.
"""

import ctypes
import os
import re
import subprocess
import sys
import textwrap

import pytest

from jax_ssdtrain._src import native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Older than the newest jaxlib on the index for this Python (3.12+: 0.12.x is the newest);
# on 3.11 the newest available is the oldest supported, 0.10.2.
OLDER_JAX = "0.11.2" if sys.version_info >= (3, 12) else "0.10.2"

STORE_LOAD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_ssdtrain as ssd
    from jax.ad_checkpoint import checkpoint_name
    from jax_ssdtrain._src import native
    def f(w, x):
        return jnp.sum(jnp.tanh(checkpoint_name(jnp.sin(x @ w), "h")) ** 2)
    w = jnp.ones((64, 64)) / 64
    x = jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)
    ours = jax.jit(jax.grad(jax.checkpoint(f, policy=ssd.offload_policy(["h"], min_bytes=0))))(w, x)
    ref = jax.jit(jax.grad(jax.checkpoint(
        f, policy=jax.checkpoint_policies.save_only_these_names("h"))))(w, x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    ssd.flush()
    print("jax", jax.__version__, "ffi_api", native.build_info()["ffi_api"],
          "stored", ssd.stats()["tensors_written"], "from", native.library_path())
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


# ---- the C ABI: xla_ffi/include/ssdtrain/c_api.h and native.py's bindings (_C_API) ----------

C_API_HEADER = os.path.join(ROOT, "xla_ffi", "include", "ssdtrain", "c_api.h")
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
  """How the bindings `table` (native._C_API's shape) differ from the declarations `header`."""
  problems = []
  for name in sorted(set(header) - set(table)):
    problems.append(f"{name}: declared in c_api.h, not bound in native.py")
  for name in sorted(set(table) - set(header)):
    problems.append(f"{name}: bound in native.py, not declared in c_api.h")
  for name in sorted(set(header) & set(table)):
    (ret, params), (restype, argtypes) = header[name], table[name]
    if len(params) != len(argtypes):
      problems.append(f"{name}: {len(params)} parameters in c_api.h, {len(argtypes)} in native.py")
      continue
    want_ret = {"int": ctypes.c_int, "void": None}.get(ret, KeyError)
    if want_ret is KeyError or restype is not want_ret:
      problems.append(f"{name}: returns {ret} in c_api.h, restype {restype} in native.py")
    for i, (c, py) in enumerate(zip(params, argtypes)):
      if C_TYPES.get(c, KeyError) is not py:
        problems.append(f"{name}: parameter {i} is {c} in c_api.h, {py} in native.py")
  return problems


def test_native_binds_exactly_the_c_api():
  with open(C_API_HEADER) as f:
    header = parse_c_api(f.read())
  assert len(header) >= 17, sorted(header)
  assert c_api_mismatches(header, native._C_API) == []
  # Every ssdtrain_* function native.py calls is one it binds.
  with open(native.__file__) as f:
    called = set(re.findall(r"\.(ssdtrain_\w+)\b", f.read()))
  assert called <= set(native._C_API), called - set(native._C_API)


def test_c_api_check_fails_on_a_mismatch():
  with open(C_API_HEADER) as f:
    text = f.read()
  header = parse_c_api(text)
  # One parameter fewer, a parameter of another type, a function only one side has.
  fewer = parse_c_api(text.replace("uint64_t size, char* err", "char* err"))
  assert c_api_mismatches(fewer, native._C_API) == [
    "ssdtrain_debug_truncate: 2 parameters in c_api.h, 3 in native.py"
  ]
  other = parse_c_api(text.replace("int64_t site, int64_t uses", "int64_t site, int uses"))
  assert len(c_api_mismatches(other, native._C_API)) == 1
  more = dict(native._C_API, ssdtrain_extra=(ctypes.c_int, []))
  assert c_api_mismatches(header, more) == [
    "ssdtrain_extra: bound in native.py, not declared in c_api.h"
  ]
  fewer_bound = {k: v for k, v in native._C_API.items() if k != "ssdtrain_flush"}
  assert c_api_mismatches(header, fewer_bound) == [
    "ssdtrain_flush: declared in c_api.h, not bound in native.py"
  ]
  restype = dict(native._C_API, ssdtrain_reset_stats=(ctypes.c_int, []))
  assert len(c_api_mismatches(header, restype)) == 1


def test_the_library_exports_the_c_api_and_the_handlers():
  so = native.lib()
  with open(C_API_HEADER) as f:
    text = f.read()
  for name in parse_c_api(text):
    assert hasattr(so, name), name
  # The handlers the header names: the CPU ones in every build, the CUDA ones in CUDA builds.
  handlers = set(re.findall(r"\bSsdtrain\w+(?:Cpu|Cuda)\b", text))
  assert len(handlers) == 6, handlers
  cuda = native.build_info()["cuda"] == 1
  for name in handlers:
    assert hasattr(so, name) == (cuda or name.endswith("Cpu")), name


def test_the_engine_tiers_are_the_locations_tier_codes():
  # One Location (jax_ssdtrain/_src/location.py) maps the store's locations to the handlers'
  # `tier` attribute; the engine decodes it with enum class Tier (xla_ffi/src/detail/entry.h).
  import re
  from pathlib import Path

  from jax_ssdtrain._src.location import TIER_CODES, Location

  header = (Path(__file__).resolve().parents[1] / "xla_ffi/src/detail/entry.h").read_text()
  body = re.search(r"enum class Tier : int32_t \{(.*?)\};", header, re.S).group(1)
  tiers = {name: int(code) for name, code in re.findall(r"(k\w+) = (\d+)", body)}
  names = {"kNvme": Location.NVME, "kHost": Location.HOST, "kHostThenNvme": Location.HOST_NVME}
  assert {names[n]: c for n, c in tiers.items()} == TIER_CODES
  assert all(Location.from_tier(c) is loc and loc.tier == c for loc, c in TIER_CODES.items())
  assert set(TIER_CODES) == {loc for loc in Location if loc.in_store}


def test_models_locations_are_the_locations():
  # models/ spells its --locations choices without importing jax_ssdtrain (whose import checks
  # the SSDTRAIN_* variables, which scripts/train.py reports in one line after parsing): they
  # are Location's, but "host,nvme", which a comma-separated TAG=LOC list cannot spell.
  import models
  from jax_ssdtrain._src.location import Location

  assert models.LOCATIONS == tuple(loc.value for loc in Location if "," not in loc.value)
