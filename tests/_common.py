"""Helpers that the tests of several parts share: the GPUs JAX sees (conftest skips the ``gpu``
tests without one), a repository module run as a command (the benchmark scripts' smoke runs), a
worker script of tests/ run in a process of its own, pytrees compared bit for bit, an optax
transformation that the optimizer's stream cannot run, one layer's parameters of the small
MLP block the layer stream's tests stack, and an attention shaped as cuDNN's flash attention."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _limits import HANG_S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def gpus() -> list:
  """JAX's GPUs (none where it has no GPU backend)."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def skip_without_gpus(n: int) -> None:
  """Skips the test where JAX sees fewer than ``n`` GPUs."""
  if len(gpus()) < n:
    pytest.skip(f"needs {n} GPUs, there are {len(gpus())}")


def run_module(module: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
  """``python -m module args`` in the repository root, its output captured, within the hang
  guard; ``env`` (default: this environment with ``JAX_PLATFORMS=cpu``) is its whole
  environment. It must exit 0: the assertion shows its output."""
  if env is None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-m", module, *map(str, args)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=HANG_S,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc


def run_worker(worker: str, *args, tmp_dir=None, **env) -> dict:
  """The JSON object that ``worker`` (a script in tests/) prints last, run with ``args`` and
  ``env`` over this environment, the repository on its PYTHONPATH, within the hang guard; it
  must exit 0 (the assertion shows the end of its stderr). ``tmp_dir``: its TMPDIR; the result
  then has ``"left_behind"``, what it left there (the store directories it configures and the
  default store's temporary directory)."""
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  full = dict(os.environ, PYTHONPATH=path, **{k: str(v) for k, v in env.items()})
  if tmp_dir is not None:
    full["TMPDIR"] = str(tmp_dir)
  proc = subprocess.run(
    [sys.executable, str(HERE / worker), *map(str, args)],
    capture_output=True,
    text=True,
    env=full,
    timeout=HANG_S,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  if tmp_dir is not None:
    result["left_behind"] = sorted(os.listdir(tmp_dir))
  return result


def assert_bitwise(a, b):
  """Pytrees ``a`` and ``b`` of one structure, each leaf of ``a`` bit for bit ``b``'s (dtype,
  shape and bytes; the message names the leaf and how far apart the values are)."""
  flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
  flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
  assert tree_a == tree_b
  for (path, x), (_, y) in zip(flat_a, flat_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), (
      f"{jax.tree_util.keystr(path)}: differs by {np.max(np.abs(x.astype(float) - y))}"
    )


def nested_norms() -> optax.GradientTransformation:
  """A momentum scaled by the norm of the whole momentum, then by the size of the scaled one:
  the second number needs the first (three passes; no reduction pass before the update resolves
  it). Refusals name it by its function's name, ``nested_norms``."""

  def init(params):
    return {"m": jax.tree.map(jnp.zeros_like, params)}

  def update(updates, state, params=None):
    m = jax.tree.map(lambda m, g: 0.9 * m + g, state["m"], updates)
    first = sum(jnp.sum(x * x) for x in jax.tree.leaves(m))
    scaled = jax.tree.map(lambda x: x / (1.0 + first), m)
    second = sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(scaled))
    return jax.tree.map(lambda x: -1e-3 * x / (1.0 + second), scaled), {"m": scaled}

  return optax.GradientTransformation(init, update)


def init_layer(key, dtype=jnp.float32, width=16):
  """One layer of the layer stream's test block: an MLP (up, down) and a scale."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "mlp": {
      "up": (jax.random.normal(k1, (width, 2 * width)) / np.sqrt(width)).astype(dtype),
      "down": (jax.random.normal(k2, (2 * width, width)) / np.sqrt(2 * width)).astype(dtype),
    },
    "scale": (1.0 + 0.1 * jax.random.normal(k3, (width,))).astype(dtype),
  }


def fake_flash_attention():
  """A causal attention shaped as cuDNN's in JAX: a custom_vjp whose forward binds a primitive
  named as cuDNN's forward (its outputs: the attention output and the softmax statistics),
  whose backward reads them. On the CPU, where cuDNN's own cannot trace."""
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  from jax_ssdtrain._src import jax_internals as ji

  def reference(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), jax.nn.logsumexp(s, -1)

  fwd_p = Primitive(ji.FLASH_ATTENTION_FORWARD)
  fwd_p.multiple_results = True
  fwd_p.def_impl(reference)
  fwd_p.def_abstract_eval(
    lambda q, k, v: tuple(
      jax.core.ShapedArray(o.shape, o.dtype) for o in jax.eval_shape(reference, q, k, v)
    )
  )
  mlir.register_lowering(fwd_p, mlir.lower_fun(reference, multiple_results=True))

  @jax.custom_vjp
  def attention(q, k, v):
    return fwd_p.bind(q, k, v)[0]

  def fwd(q, k, v):
    out, stats = fwd_p.bind(q, k, v)
    return out, (q, k, v, out, stats)

  def bwd(res, g):
    q, k, v, out, stats = res
    del out, stats  # read by cuDNN's backward; here the reference's gradient
    return jax.vjp(lambda *a: reference(*a)[0], q, k, v)[1](g)

  attention.defvjp(fwd, bwd)
  return attention, fwd_p
