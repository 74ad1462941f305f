"""The build matches the runtime: pip's isolated build of this checkout, installed into a fresh
virtual environment whose jaxlib is older than the newest on the index, stores and loads.

Slow (downloads jax/jaxlib into a fresh venv and compiles the library): run by `.ci/run` with
`-m slow`. The mismatch itself (handlers of a newer FFI API than the runtime's) is checked fast
below without a second jaxlib.
"""

import os
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
