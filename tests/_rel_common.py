"""Shared by tests/test_reliability.py and the subprocesses it starts (imported by path)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from _ffi_common import raw_load, raw_store
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd

NAMES = ("h", "g")

# f32 matmuls at full precision on GPU: the default (TF32) rounds differently in each fusion,
# which would need a tolerance loose enough to hide a real mismatch. (CPU is exact already.)
if jax.default_backend() != "cpu":
  jax.config.update("jax_default_matmul_precision", "highest")


def layer(w, x, names=NAMES):
  h = checkpoint_name(jnp.sin(x @ w["a"]), names[0])
  g = checkpoint_name(h @ w["b"], names[1])
  return x + jnp.tanh(g) * h


def make_loss(policy, names=NAMES):
  f = jax.checkpoint(lambda w, x: layer(w, x, names), policy=policy)

  def loss(w, x):
    y, _ = jax.lax.scan(lambda c, wi: (f(wi, c), None), x, w)
    return jnp.sum(y**2)

  return loss


def params(seed=0, n_layers=3, d=64, batch=64):
  ka, kb, kx = jax.random.split(jax.random.key(seed), 3)
  w = {
    "a": jax.random.normal(ka, (n_layers, d, d)) / np.sqrt(d),
    "b": jax.random.normal(kb, (n_layers, d, d)) / np.sqrt(d),
  }
  return w, jax.random.normal(kx, (batch, d))


def steps(names=NAMES):
  ours = jax.jit(jax.grad(make_loss(ssd.offload_policy(names, min_bytes=0), names)))
  ref = jax.jit(jax.grad(make_loss(jax.checkpoint_policies.save_only_these_names(*names), names)))
  return ours, ref


def assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_close(a, b):
  """Equal on CPU; within float rounding where the backend fuses differently (GPU).

  The bound scales with each array's magnitude: the matmuls run at full f32 precision (see
  the top of this module), so a wrong or stale tensor is far outside it.
  """
  if jax.default_backend() == "cpu":
    return assert_equal(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(y))))


def store(x, site=1, name="t"):
  return raw_store(x, site=site, name=name)


def load(h, like, site=1, name="t"):
  return raw_load(h, like, site=site, name=name)


def store_fds(directory):
  """Open descriptors of this process on files in `directory` (unlinked store files)."""
  out = []
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
    if target.startswith(str(directory) + "/"):
      out.append(target)
  return out
