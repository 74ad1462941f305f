"""What a new user runs into first: each trap ends in a clear error naming the cause and the fix.

The store replaced under a stack that was still being made (``configure()`` waits for the
work already dispatched, the same outcome in every fresh process), a streamed stack given to
``offload_optimizer``, a float size, a policy factory passed uncalled, and
``offload_optimizer`` nested in itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd

optax = pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB, host_tier_bytes=32 * MiB):
    yield


# ---------------------------------------------------------------------------------------------
# configure() while a stack is still being stored

# Each trial makes a stack (its program still running when configure() is called: 32 layers,
# large enough that the stores are not done by then), replaces the store, then reads the stack
# back. The one right outcome: refused, naming the replaced store. Were configure() not to
# wait, a trial could end three other ways: "no store is configured" (the init's stores fall
# between the old store and the new one), the stack read back (they fall in the new store),
# or a handle error that does not say why.
_RACE = """
import jax
import jax_ssdtrain as ssd

def init_layer(key):
  return {"w": jax.random.normal(key, (256, 256)), "b": jax.random.normal(key, (256,))}

for trial in range(TRIALS):
  stack = ssd.init_streamed(init_layer, jax.random.key(trial), 32)
  if SHUTDOWN:
    ssd.shutdown()
  ssd.configure(capacity_bytes="64MiB")
  try:
    jax.block_until_ready(ssd.stack_to_tree(stack))
    print("OUTCOME read back")
  except Exception as e:
    text = " ".join(str(e).split())
    if "belongs to a store that was replaced" in text and "configure" in text:
      print("OUTCOME refused: replaced")
    else:
      print("OUTCOME other:", type(e).__name__, text[:160])
"""


def _race_env(tmp_path) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
  if "SSDTRAIN_LIB" in os.environ:
    env["SSDTRAIN_LIB"] = os.environ["SSDTRAIN_LIB"]
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
  return env


@pytest.mark.parametrize("shutdown_first", [False, True], ids=["configure", "shutdown"])
def test_a_stack_made_before_configure_is_refused_the_same_way_in_every_process(
  tmp_path, shutdown_first
):
  processes, trials = (6, 3) if not shutdown_first else (2, 2)
  code = _RACE.replace("TRIALS", str(trials)).replace("SHUTDOWN", str(shutdown_first))
  env = _race_env(tmp_path)
  outcomes = []
  for batch in range(0, processes, 2):  # two at a time (two cores)
    procs = [
      subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
      )
      for _ in range(min(2, processes - batch))
    ]
    for proc in procs:
      out, err = proc.communicate(timeout=120)
      assert proc.returncode == 0, err[-2000:]
      lines = [line for line in out.splitlines() if line.startswith("OUTCOME")]
      assert len(lines) == trials, out + err[-2000:]
      outcomes += lines
  assert set(outcomes) == {"OUTCOME refused: replaced"}, outcomes


def test_configure_waits_for_the_programs_already_dispatched(tmp_path):
  """In this process: the stack's program has finished in the old store before the new one
  opens (its arrays hold no error), and reading it back is refused by its cause."""
  with ssd.configured(tmp_path / "a", capacity_bytes=64 * MiB):
    stack = ssd.init_streamed(
      lambda k: {"w": jax.random.normal(k, (256, 256))}, jax.random.key(0), 32
    )
    ssd.configure(tmp_path / "b", capacity_bytes=64 * MiB)
    for leaf in jax.tree.leaves(stack):
      assert leaf.is_ready()
      leaf.block_until_ready()  # the init ran in the old store: no error
    with pytest.raises(Exception, match="belongs to a store that was replaced") as info:
      jax.block_until_ready(ssd.stack_to_tree(stack))
    assert "configure" in str(info.value) and "init_streamed" in str(info.value)


def test_a_corrupted_handle_is_not_blamed_on_a_replaced_store(store):
  stack = ssd.init_streamed(lambda k: {"w": jax.random.normal(k, (8, 8))}, jax.random.key(0), 2)
  bad = jax.tree.map(lambda h: h ^ jnp.uint32(1 << 7), stack)
  with pytest.raises(Exception, match="invalid or stale ssdtrain handle") as info:
    jax.block_until_ready(ssd.stack_to_tree(bad))
  assert "replaced" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# A streamed stack given to offload_optimizer


def _stack():
  return ssd.init_streamed(lambda k: {"w": jax.random.normal(k, (64, 64))}, jax.random.key(0), 4)


_STACK_REFUSED = r"StreamedStack \(at {at}\).*init_streamed_optimizer\(tx, stack\)"


def test_offload_optimizer_init_refuses_a_streamed_stack(store):
  stack = _stack()
  tx = ssd.offload_optimizer(optax.adam(1e-3))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # not "stores nothing": refused before any layout is made
    with pytest.raises(TypeError, match=_STACK_REFUSED.format(at="<root>")):
      tx.init(stack)
    with pytest.raises(TypeError, match=_STACK_REFUSED.format(at=re.escape("['blocks']"))):
      tx.init({"embed": jnp.ones((1024, 512)), "blocks": stack})
    with pytest.raises(TypeError, match=_STACK_REFUSED.format(at="<root>")):
      jax.eval_shape(tx.init, stack)  # init stays pure: the refusal is a walk of the tree


def test_offload_optimizer_init_is_pure_and_unchanged_without_a_stack(store):
  tx = ssd.offload_optimizer(optax.adam(1e-3))
  params = {"w": jnp.ones((1024, 512))}
  shapes = jax.eval_shape(tx.init, params)
  state = tx.init(params)
  assert jax.tree.structure(shapes) == jax.tree.structure(state)


def test_apply_gradients_refuses_a_streamed_stack_with_an_offloaded_state(store):
  stack = _stack()
  tx = ssd.offload_optimizer(optax.adam(1e-3), min_bytes=0)
  params = {"w": jnp.ones((1024, 512))}
  state = tx.init(params)
  with pytest.raises(TypeError, match=_STACK_REFUSED.format(at="<root>")):
    ssd.apply_gradients(tx, stack, state, stack)
  with pytest.raises(TypeError, match=_STACK_REFUSED.format(at=re.escape("['blocks']"))):
    ssd.apply_gradients(tx, params | {"blocks": stack}, state, params | {"blocks": stack})
  with pytest.raises(TypeError, match=_STACK_REFUSED.format(at="<root>")):
    tx.update(stack, state, stack)


def test_apply_gradients_refuses_a_streamed_stack_with_a_plain_optax_state(store):
  # optax would update the stack's handles as numbers: they would then name no entry.
  stack = _stack()
  tx = optax.adam(1e-3)
  with pytest.raises(TypeError, match=r"params holds a StreamedStack \(at <root>\).*init_streamed"):
    ssd.apply_gradients(tx, stack, tx.init(stack), stack)
  params = {"w": jnp.ones((4, 4))}
  with pytest.raises(TypeError, match=r"grads holds a StreamedStack \(at \['w'\]\)"):
    ssd.apply_gradients(tx, {"w": stack}, tx.init(params), params)


def test_offload_optimizer_nested_in_itself_is_refused():
  tx = ssd.offload_optimizer(optax.adam(1e-3))
  for wrapped in (tx, ssd.accumulate_gradients(tx, 2)):
    with pytest.raises(TypeError, match=r"offload_optimizer once.*offload_optimizer\(tx\)"):
      ssd.offload_optimizer(wrapped)
  with pytest.raises(TypeError, match=r"offload_optimizer once"):
    ssd.offload_optimizer(optax.MultiSteps(tx, 2))


# ---------------------------------------------------------------------------------------------
# A float size, and a policy factory passed uncalled


def test_a_float_size_is_refused_saying_an_int_or_a_size_string_is_wanted(tmp_path):
  with pytest.raises(ValueError) as info:
    ssd.configure(tmp_path / "s", host_tier_bytes=1.5e9)
  text = str(info.value)
  assert "host_tier_bytes" in text and "1500000000.0" in text
  assert "int number of bytes" in text and "size string" in text
  assert "pass 1500000000 or '1.5GB'" in text
  with pytest.raises(ValueError, match=r"whole number of bytes"):
    ssd.configure(tmp_path / "s", capacity_bytes=1.5)
  assert ssd.parse_size("1.5GB") == 1_500_000_000


def _block(x):
  y = checkpoint_name(jnp.sin(x @ x), "a")
  return jnp.sum(y @ y)


@pytest.mark.parametrize("factory", ["offload_policy", "location_policy"])
def test_a_policy_factory_passed_uncalled_says_to_call_it(factory):
  fn = jax.checkpoint(_block, policy=getattr(ssd, factory))
  x = jnp.ones((64, 64))
  message = (
    rf"policy: got the function jax_ssdtrain\.{factory} itself.*policy=jax_ssdtrain\.{factory}\("
  )
  with pytest.raises(TypeError, match=message):
    jax.grad(fn)(x)
  with pytest.raises(TypeError, match=message):
    jax.jit(jax.grad(fn))(x)
  both = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.nothing_saveable, getattr(ssd, factory)
  )
  with pytest.raises(TypeError, match=message):
    jax.grad(jax.checkpoint(_block, policy=both))(x)


def test_a_called_policy_still_works(store):
  x = jnp.ones((64, 64))
  want = jax.grad(_block)(x)
  got = jax.jit(jax.grad(jax.checkpoint(_block, policy=ssd.offload_policy(["a"], min_bytes=0))))(x)
  assert jnp.array_equal(got, want)
