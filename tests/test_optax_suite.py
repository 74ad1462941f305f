"""optax's own lists of optimizers and wrappers through offload_optimizer.

The lists are imported from the installed optax's test modules, as optax's own tests run them
(alias_test, contrib/_common_test; the builders of transforms/_conditionality_test,
_masking_test, _accumulation_test and lookahead_test; inject_hyperparams over the alias list as
alias_test does), never copied: an optax release that adds an optimizer adds a case here.

Each case runs 3 jitted steps of optax's parabola and Rosenbrock targets tiled into leaves of
thousands of rows ((2000, 3) and (1000, 2) float32: chunk_bytes=4096 cuts them into chunks of
341 and 512 rows with a short last one; some cases add a leaf smaller than a chunk and a scalar)
with plain optax, location="device" (the oracle) and location="host" ("nvme" and "host,nvme":
a representative subset by default, every case under ``-m slow``). The stored locations must
equal the device's bit for bit (parameters at every step, the final state); the device's must
be within a few ulps of plain optax.

What each case must do is ONE table, REFUSED below: a case in it must raise
OptimizerOffloadError matching its regex, every other case must stream exactly. A case that
starts streaming (or stops) fails here until the table says so.

A property test (hypothesis, derandomized) draws leaf shapes and chunk sizes for adam, lamb,
adafactor, lion and prodigy (a two-pass stream): host equals device bit for bit.
"""

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optax._src import alias_test, lookahead, lookahead_test
from optax.contrib import _common_test as contrib_test
from optax.schedules import _inject
from optax.transforms import (
  _accumulation,
  _accumulation_test,
  _clipping,
  _conditionality,
  _conditionality_test,
  _masking,
  _masking_test,
)

import jax_ssdtrain as ssd
from jax_ssdtrain._src.optimizer import OptimizerOffloadError, optimizer_state

MiB = 1 << 20
CHUNK = 4096

# ---------------------------------------------------------------------------------------------
# The expected outcome of every case: the cases here are refused (OptimizerOffloadError whose
# message matches the regex); every other case streams, bit for bit with location="device".
# When the optimizer learns to stream one of these, the test fails until its line is removed.
# A refusal names the innermost transformation whose operation reads the state of several
# parameters together (its update function), the offload_optimizer's tx, and the cause
# (tests/test_optimizer.py checks the messages on transformations made to be refused).
REFUSED = {
  # contrib/_common_test._ALL_OPTIMIZERS_UNDER_TEST: a number built from the whole state (a dot
  # product or a sum over every parameter's state) feeds every parameter's update. Those whose
  # numbers are full reductions of single parameters' state stream in two passes (prodigy,
  # dadapt_adamw, dog, dowg, momo, mechanize): none is refused today.
}

# Crashes of the optimizer (bugs): each case here must still fail with this exception (strict
# xfail: when it is fixed the test fails until its line moves). None today.
BUGS: dict[str, tuple[type, str]] = {}
# ---------------------------------------------------------------------------------------------


# The targets: optax's parabola (3 parameters) and Rosenbrock (2) tiled into many rows, each row
# shifted a little so that no two rows are the same problem.
_P0, _, _PARABOLA = alias_test._setup_parabola(jnp.float32)
_R0, _, _ROSENBROCK = alias_test._setup_rosenbrock(jnp.float32)


def _tiled(x0, rows):
  return jnp.tile(x0, (rows, 1)) + 1e-3 * jnp.arange(rows, dtype=jnp.float32)[:, None]


def _tree(target: str) -> dict:
  # "tiled": chunk_bytes=4096 cuts "p" (24000 bytes) into 6 chunks, the last of 295 rows, and
  # "r" (8000 bytes) into 2, the last of 488. "mixed" adds "s", 40 rows of Rosenbrock (320
  # bytes: less than a chunk) and "z", a scalar parameter.
  tree = {"p": _tiled(_P0, 2000), "r": _tiled(_R0, 1000)}
  if target == "mixed":
    tree |= {"s": _tiled(_R0, 40) - 0.5, "z": jnp.float32(3.0)}
  return tree


def _objective(tree):
  loss = jax.vmap(_PARABOLA)(tree["p"]).sum() + jax.vmap(_ROSENBROCK)(tree["r"]).sum()
  if "s" in tree:
    loss += jax.vmap(_ROSENBROCK)(tree["s"]).sum() + _PARABOLA(jnp.stack([tree["z"], -1.0, 1.0]))
  return loss


@dataclasses.dataclass(frozen=True)
class Case:
  make: Callable  # () -> the optax transformation
  value: bool = False  # update(..., value=loss), as optax's tests pass it
  obj_fn: bool = False  # update(..., obj_fn=objective) (sophia)
  target: str = "tiled"
  lookahead: bool = False  # the parameters are lookahead.LookaheadParams (fast, slow)


def _fmt(v):
  return jnp.dtype(v).name if isinstance(v, type) else str(v)


def _labels(entries):
  """Readable, unique ids: the name (+wrapper), and where several entries share it, the kwargs
  that tell them apart ("rmsprop" and "rmsprop[momentum=0.9]")."""
  groups = {}
  for e in entries:
    groups.setdefault(e["base"], []).append(e["kwargs"])
  labels = []
  for e in entries:
    siblings = groups[e["base"]]
    keys = sorted({k for kw in siblings for k in kw})
    differ = [k for k in keys if len({repr(kw.get(k)) for kw in siblings}) > 1]
    shown = [f"{k}={_fmt(e['kwargs'][k])}" for k in differ if k in e["kwargs"]]
    labels.append(e["base"] + (f"[{','.join(shown)}]" if shown else ""))
  return labels


def _needs_value(name, wrapper=None):
  # What optax's own tests pass: alias_test `value` for polyak_sgd; contrib/_common_test `value`
  # for momo, momo_adam and the reduce_on_plateau wrapper, `obj_fn` for sophia.
  return name in ("momo", "momo_adam", "polyak_sgd") or wrapper == "reduce_on_plateau"


def _alias_factory(name):
  factory = getattr(optax, name)

  @functools.wraps(factory)
  def make(*args, **kwargs):  # optimistic_adam is deprecated (alias_test expects the warning)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return factory(*args, **kwargs)

  return make


_INJECTED_ALIAS = set()  # inject_hyperparams around alias_test's list


def _build_cases() -> dict[str, Case]:
  cases = {}

  def add(label, case):
    assert label not in cases, f"two cases named {label}"
    cases[label] = case

  alias = [
    {"base": c["opt_name"], "kwargs": c["opt_kwargs"], "name": c["opt_name"]}
    for c in alias_test._OPTIMIZERS_UNDER_TEST
  ]
  for e, label in zip(alias, _labels(alias)):
    make = functools.partial(_alias_factory(e["name"]), **e["kwargs"])
    add(label, Case(make, value=_needs_value(e["name"])))

  contribs = [
    {
      "base": c["opt_name"] + (f"+{c['wrapper_name']}" if c["wrapper_name"] else ""),
      "kwargs": c["opt_kwargs"],
      **c,
    }
    for c in contrib_test._ALL_OPTIMIZERS_UNDER_TEST
  ]
  for c, label in zip(contribs, _labels(contribs)):

    def make(c=c):
      opt = contrib_test._get_opt_factory(c["opt_name"])(**c["opt_kwargs"])
      if c["wrapper_name"]:
        opt = contrib_test._wrap_opt(opt, c["wrapper_name"], c["wrapper_kwargs"])
      return opt

    add(
      label,
      Case(
        make,
        value=_needs_value(c["opt_name"], c["wrapper_name"]),
        obj_fn=c["opt_name"] == "sophia",
      ),
    )

  # inject_hyperparams around every optimizer of alias_test's list, as its
  # test_optimizers_can_be_wrapped_in_inject_hyperparams does (adafactor needs a static arg).
  for e, label in zip(alias, _labels(alias)):
    static = ("min_dim_size_to_factor",) if e["name"] == "adafactor" else ()

    def make(e=e, static=static):
      return _inject.inject_hyperparams(_alias_factory(e["name"]), static_args=static)(
        **e["kwargs"]
      )

    add(f"inject_hyperparams({label})", Case(make, value=_needs_value(e["name"])))
    _INJECTED_ALIAS.add(f"inject_hyperparams({label})")

  # State in bfloat16 (alias_test.test_explicit_dtype's optimizers), on the mixed target.
  bf16 = jnp.bfloat16
  add(
    "sgd[momentum=0.9,accumulator_dtype=bfloat16]",
    Case(lambda: optax.sgd(0.1, momentum=0.9, accumulator_dtype=bf16), target="mixed"),
  )
  add("adam[mu_dtype=bfloat16]", Case(lambda: optax.adam(0.1, mu_dtype=bf16), target="mixed"))
  add("adamw[mu_dtype=bfloat16]", Case(lambda: optax.adamw(0.1, mu_dtype=bf16), target="mixed"))
  # A few of alias_test's optimizers on the mixed target (a leaf smaller than a chunk, a scalar).
  for name in ("adam", "adafactor", "lamb", "lion", "rmsprop"):
    (entry,) = [c for c in alias if c["name"] == name][-1:]
    make = functools.partial(_alias_factory(name), **entry["kwargs"])
    add(f"{name}@mixed", Case(make, target="mixed"))

  # transforms/_conditionality_test's builders under apply_if_finite (its max steps: 2), and
  # conditionally_transform / conditionally_mask (inner updates for the first 2 steps only).
  builders = {
    "sgd": _conditionality_test._build_sgd,
    "stateful_sgd": _conditionality_test._build_stateful_sgd,
    "sgd_extra_args": _conditionality_test._build_sgd_extra_args,
  }
  for name, build in builders.items():
    add(
      f"apply_if_finite({name})",
      Case(lambda build=build: _conditionality.apply_if_finite(build(), 2), target="mixed"),
    )
  add(
    "conditionally_transform(stateful_sgd)",
    Case(
      lambda: _conditionality.conditionally_transform(
        _conditionality_test._build_stateful_sgd(), lambda step: step < 2
      )
    ),
  )
  add(
    "conditionally_mask(stateful_sgd)",
    Case(
      lambda: _conditionality.conditionally_mask(
        _conditionality_test._build_stateful_sgd(), lambda step: step < 2
      )
    ),
  )
  # transforms/_masking_test's builders under masked (a mask tree and a mask function).
  mask = {"p": True, "r": False, "s": True, "z": False}
  for name in ("sgd", "stateful_sgd"):
    build = getattr(_masking_test, f"_build_{name}")
    add(
      f"masked({name})",
      Case(lambda build=build: _masking.masked(build(), mask), target="mixed"),
    )
    add(
      f"masked({name},mask_fn)",
      Case(
        lambda build=build: _masking.masked(
          build(), lambda tree: jax.tree.map(lambda x: x.ndim > 1, tree)
        ),
        target="mixed",
      ),
    )
  # transforms/_clipping_test's clippers in front of a stateful optimizer.
  clippers = {
    "clip": lambda: _clipping.clip(1.0),
    "clip_by_block_rms": lambda: _clipping.clip_by_block_rms(1.0),
    "clip_by_global_norm": lambda: _clipping.clip_by_global_norm(1.0),
    "adaptive_grad_clip": lambda: _clipping.adaptive_grad_clip(0.1),
  }
  for name, clipper in clippers.items():
    add(
      f"chain({name},adam)",
      Case(lambda clipper=clipper: optax.chain(clipper(), optax.adam(1e-1)), target="mixed"),
    )
  # transforms/_accumulation_test: its OPTIMIZERS_TO_TEST inside MultiSteps (k=2).
  ms = [
    {"base": c["opt_name"], "kwargs": c["opt_kwargs"], "name": c["opt_name"]}
    for c in _accumulation_test.OPTIMIZERS_TO_TEST
  ]
  for e, label in zip(ms, _labels(ms)):

    def make(e=e):
      return _accumulation.MultiSteps(_alias_factory(e["name"])(**e["kwargs"]), 2)

    add(f"MultiSteps({label})", Case(make))
  # lookahead_test's fast optimizers under lookahead (a sync at step 2 of 3).
  for name, build in {
    "sgd": lookahead_test._build_sgd,
    "test_optimizer": lambda: lookahead_test._test_optimizer(-0.5),
  }.items():
    add(
      f"lookahead({name})",
      Case(
        lambda build=build: lookahead.lookahead(build(), sync_period=2, slow_step_size=0.5),
        lookahead=True,
      ),
    )
  # schedules/_inject_test's injected transformations (a schedule and constant hyperparams).
  add(
    "inject_hyperparams(trace)",
    Case(
      lambda: optax.chain(
        _inject.inject_hyperparams(optax.trace)(
          decay=optax.piecewise_constant_schedule(0.8, {1: 0.5}), nesterov=True
        ),
        optax.scale(-1e-2),
      )
    ),
  )
  add(
    "inject_hyperparams(scale_by_adam)",
    Case(
      lambda: optax.chain(
        _inject.inject_hyperparams(optax.scale_by_adam)(b1=0.0, b2=0.0), optax.scale(-1e-2)
      )
    ),
  )
  return cases


CASES = _build_cases()
_FILES_SUBSET = [
  "adam",
  "adafactor[learning_rate=0.005]",
  "adam[mu_dtype=bfloat16]",
  "masked(stateful_sgd)",
  "chain(clip_by_global_norm,adam)",
  "novograd",
]


def _marks(case_id):
  if case_id not in BUGS:
    return ()
  exc, pattern = BUGS[case_id]
  return (pytest.mark.xfail(raises=exc, strict=True, reason=f"bug: {exc.__name__}: {pattern}"),)


def _params_for(ids):
  return [pytest.param(c, id=c, marks=_marks(c)) for c in ids]


# The README's test command (under 10 minutes on 2 cores) runs one case of each mechanism the
# stream has; `-m slow` (CI) runs every case.
_DEFAULT_CASES = {
  "adam",  # chunked moments, short last chunks
  "adafactor",  # factored moments: one parameter's leaves of several shapes, whole
  "lamb",  # a per-parameter trust ratio (a norm of one leaf), whole
  "sm3",  # per-axis accumulators
  "novograd",  # a lax.cond on the step count, expanded into selects
  "noisy_sgd",  # a typed PRNG key in the state, kept on the device
  "cocob",  # a leaf read every step and returned unchanged
  "muon",  # a small leaf shared by every parameter, kept on the device
  "galore",  # a projector of one parameter, a cond on the step
  "prodigy",  # two passes: numbers built from the whole state (a reduction pass first)
  "sgd+mechanize[learning_rate=0.1]",  # two passes, through a wrapper, a cond on the step
  "schedule_free_adamw",
  "inject_hyperparams(adam)",
  "adam[mu_dtype=bfloat16]",
  "lamb@mixed",  # a leaf smaller than a chunk and a scalar parameter
  "apply_if_finite(stateful_sgd)",
  "conditionally_mask(stateful_sgd)",
  "masked(stateful_sgd,mask_fn)",
  "chain(clip_by_global_norm,adam)",
  "MultiSteps(adam)",
  "lookahead(sgd)",
}


def _default(case_id):
  return case_id in _DEFAULT_CASES


def _params(case: Case):
  tree = _tree(case.target)
  return lookahead.LookaheadParams.init_synced(tree) if case.lookahead else tree


def _tx_state(state):
  """``state`` with each OffloadedState in it read out of the store (``optimizer_state``):
  ``offload_optimizer(MultiSteps(tx))`` makes a MultiStepsState holding one."""
  return jax.tree.map(
    lambda x: optimizer_state(x) if isinstance(x, ssd.OffloadedState) else x,
    state,
    is_leaf=lambda x: isinstance(x, ssd.OffloadedState),
  )


def _run(case: Case, tx, steps=3):
  """``steps`` steps of one jitted function: the parameters after each (NumPy) and the state."""

  @jax.jit
  def step(p, s):
    # lookahead: the gradient of the fast parameters (as lookahead_test passes them).
    value, g = jax.value_and_grad(_objective)(p.fast if case.lookahead else p)
    extra = {}
    if case.value:
      extra["value"] = value
    if case.obj_fn:
      extra["obj_fn"] = _objective
    u, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, u), s

  params = _params(case)
  state = tx.init(params)
  history = []
  for _ in range(steps):
    params, state = step(params, state)
    history.append(jax.tree.map(np.asarray, params))
  return history, state


def _offload(case: Case, location):
  return ssd.offload_optimizer(case.make(), location=location, min_bytes=0, chunk_bytes=CHUNK)


def _host(tree):
  """A tree's leaves as NumPy arrays (a typed PRNG key as its key data: noisy_sgd's)."""

  def leaf(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  return jax.tree.map(leaf, tree)


def _assert_bits_equal(got, want, what):
  """Equal bit for bit: same structure, dtypes and shapes, and the same bytes (so -0.0 is not
  0.0 and a NaN's payload counts)."""
  got_leaves, got_tree = jax.tree.flatten_with_path(got)
  want_leaves, want_tree = jax.tree.flatten_with_path(want)
  assert got_tree == want_tree, f"{what}: {got_tree} != {want_tree}"
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert (g.dtype, g.shape) == (w.dtype, w.shape), (where, g.dtype, g.shape, w.dtype, w.shape)
    if g.tobytes() != w.tobytes():
      np.testing.assert_array_equal(g, w, err_msg=where)  # the readable report, or:
      pytest.fail(f"{where}: equal values, other bits (a -0.0 or a NaN payload)")


# Plain optax against location="device": the same operations on the same values, but XLA
# rewrites some of them by the program's shape (x / s as x * (1 / s); p + lr * u as a fused
# multiply-add; a sum over a chunk instead of a leaf), so a few ulps apart that 3 steps can grow
# (adam divides by sqrt(nu) ~ |g|: its relative error passes to the update). optax's own
# inject_hyperparams test compares two compilations of one optimizer at rtol=1e-3 (updates) and
# 1e-4 (state); test_optimizer.py's parameters at rtol=1e-5, atol=1e-7 and its state at rtol=1e-4,
# atol=2e-5. Here Rosenbrock's curvature (Hessian eigenvalues up to ~1e3, learning rates up to
# 1e-1) multiplies a step's ulps by up to ~10 at each next step: at rtol=1e-5, atol=1e-6 step 3
# of inject_hyperparams(trace) misses by 5e-6 at one element of 2000 (value 0.063), and
# sgd[momentum=0.9,accumulator_dtype=bfloat16] by 1.2e-4 at 4.04 (one bfloat16 ulp of the
# momentum flipped by the float32 ulps before rounding, times the learning rate). A wrong chunk,
# leaf or step shows as >= 1e-3 over a whole chunk. Parameters here are O(1-10). adafactor
# without a learning rate stays within 0.1 of these over 5 steps, though some of its elements
# end 1e-3 apart relatively (see test_adafactor_without_learning_rate_differs_by_rounding_only).
PARAMS_TOL = dict(rtol=1e-4, atol=1e-5)
STATE_TOL = dict(rtol=1e-4, atol=2e-5)


def _assert_close(got, want, what, tol):
  got_leaves, got_tree = jax.tree.flatten_with_path(got)
  want_leaves, want_tree = jax.tree.flatten_with_path(want)
  assert got_tree == want_tree, f"{what}: {got_tree} != {want_tree}"
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    if g.dtype == jnp.bfloat16:  # two bfloat16 ulps (2 * 2**-8)
      g, w, tol = g.astype(np.float32), w.astype(np.float32), dict(tol, rtol=8e-3)
    np.testing.assert_allclose(g, w, err_msg=f"{what}{jax.tree_util.keystr(path)}", **tol)


@functools.cache
def _reference(case_id):
  """(plain optax's run, location="device"'s run with its final state as NumPy arrays)."""
  case = CASES[case_id]
  plain, plain_state = _run(case, case.make())
  device, device_state = _run(case, _offload(case, "device"))
  return plain, _host(plain_state), device, _host(_tx_state(device_state))


def _as_recorded(case_id, check, *args):
  """``check(case_id, *args)``; for a case of BUGS, the crash must be the one recorded there
  (another one, or a refusal, fails instead of counting as the expected failure)."""
  if case_id not in BUGS:
    return check(case_id, *args)
  exc, pattern = BUGS[case_id]
  try:
    return check(case_id, *args)
  except exc as e:
    if isinstance(e, OptimizerOffloadError) or not re.search(pattern, str(e)):
      pytest.fail(f"{case_id}: BUGS records {exc.__name__}: {pattern}, got {e!r}")
    raise


def _check_stored(case_id, location):
  case = CASES[case_id]
  pattern = REFUSED.get(case_id)
  if pattern is not None:
    with pytest.raises(OptimizerOffloadError, match=pattern):
      _run(case, _offload(case, location))
    return
  plain, plain_state, device, device_state = _reference(case_id)
  got, state = _run(case, _offload(case, location))
  for i, (g, d) in enumerate(zip(got, device)):
    _assert_bits_equal(g, d, f"{location} step {i + 1} params")
  _assert_bits_equal(_host(_tx_state(state)), device_state, f"{location} state")
  # The CPU reads every handle and checks the engine's prediction of the state's loads against
  # it: a wrong one is a step the GPU fails.
  wrong = ssd.stats()["handle_mismatches"]
  assert wrong == 0, f"{location}: {wrong} loads of the state were predicted wrong"
  return plain, plain_state, device, device_state


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    yield


@pytest.fixture
def spilling_store(tmp_path):
  # A host tier smaller than most states (adam's: 2 x 32 KiB a version): "host,nvme" puts
  # part of the state in the host tier and the rest in the files.
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB, host_tier_bytes=48 << 10):
    yield


_DEFAULT_IDS = [c for c in CASES if _default(c)]
_SLOW_IDS = [c for c in CASES if not _default(c)]


def _stream_and_compare(case_id):
  result = _check_stored(case_id, "host")
  if result is None:  # refused, as REFUSED says
    with pytest.raises(OptimizerOffloadError, match=REFUSED[case_id]):
      _run(CASES[case_id], _offload(CASES[case_id], "device"))
    return
  plain, plain_state, device, device_state = result
  for i, (d, p) in enumerate(zip(device, plain)):
    _assert_close(d, p, f"device step {i + 1} params", PARAMS_TOL)
  _assert_close(device_state, plain_state, "device state", STATE_TOL)


@pytest.mark.parametrize("case_id", _params_for(_DEFAULT_IDS))
def test_optax_list_streams_like_the_device(store, case_id):
  _as_recorded(case_id, _stream_and_compare)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", _params_for(_SLOW_IDS))
def test_optax_list_streams_like_the_device_slow(store, case_id):
  _as_recorded(case_id, _stream_and_compare)


@pytest.mark.parametrize("location", ["nvme", "host,nvme"])
@pytest.mark.parametrize("case_id", _params_for(_FILES_SUBSET))
def test_files_stream_like_the_device(spilling_store, case_id, location):
  _as_recorded(case_id, _check_stored, location)


@pytest.mark.slow
@pytest.mark.parametrize("location", ["nvme", "host,nvme"])
@pytest.mark.parametrize("case_id", _params_for([c for c in CASES if c not in _FILES_SUBSET]))
def test_files_stream_like_the_device_slow(spilling_store, case_id, location):
  _as_recorded(case_id, _check_stored, location)


def test_the_table_names_cases():
  # A line of REFUSED naming no case (a renamed optimizer, a typo) would never be checked.
  assert not set(REFUSED) - set(CASES), sorted(set(REFUSED) - set(CASES))
  assert not set(BUGS) - set(CASES) and not set(BUGS) & set(REFUSED)
  for pattern in REFUSED.values():
    re.compile(pattern)
  assert set(_FILES_SUBSET) | _DEFAULT_CASES <= set(CASES)


# ---------------------------------------------------------------------------------------------
# adafactor: optax's own arithmetic. Without a learning rate (alias_test's second configuration)
# its parameters end thousands of ulps (relative 1e-3) from plain optax at some elements over 5
# steps, within PARAMS_TOL all the same (at most 0.1 of it): its step is the parameter's RMS
# times a sign-like g / sqrt(v), so p + u nearly cancels (6.39 - 6.14 = 0.246) and a difference
# of an ulp or two of the operands is 88 ulps of the result. The streamed program computes what
# optax does: with tx.update compiled on its own (the gradient and apply_updates in jits of their
# own, as the streamed program has them across its custom calls) plain optax and
# location="device" agree bit for bit at every step, whether the chunks cut the leaves or not.
# In one jit XLA fuses the gradient's arithmetic into optax's first operations and optax's last
# multiplication into apply_updates' addition (one fused multiply-add, one rounding fewer): that
# is the whole difference (docs/optimizer.md, "Exactness").

ADAFACTOR_CASES = ["adafactor", "adafactor[learning_rate=0.005]", "adafactor@mixed"]


def _run_apart(tx, params, objective, steps=5):
  """``steps`` steps with the gradient, ``tx.update`` and ``optax.apply_updates`` each jitted on
  its own: the parameters after each (NumPy) and the final state."""
  grad, update, apply = (
    jax.jit(jax.grad(objective)),
    jax.jit(tx.update),
    jax.jit(optax.apply_updates),
  )
  p, s = params, tx.init(params)
  history = []
  for _ in range(steps):
    u, s = update(grad(p), s, p)
    p = apply(p, u)
    history.append(_host(p))
  return history, _host(_tx_state(s))


def _factored_tree():
  # Leaves with two axes of at least 128 (min_dim_size_to_factor): factored row and column
  # statistics, which need the whole leaf (the group runs whole), and one that is not factored.
  shapes = {"w": (300, 200), "t": (3, 260, 140), "b": (700, 3)}
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return {n: jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys)}


def _sin_loss(tree):
  return sum(jnp.sum(jnp.sin(3 * x + i) ** 2) for i, x in enumerate(jax.tree.leaves(tree)))


@pytest.mark.parametrize("chunk_bytes", [CHUNK, 1 << 22], ids=["cut", "whole"])
@pytest.mark.parametrize("case_id", ADAFACTOR_CASES + ["adafactor(factored)"])
def test_adafactor_is_optax_arithmetic_bit_for_bit(case_id, chunk_bytes):
  if case_id == "adafactor(factored)":
    make, params, objective = optax.adafactor, _factored_tree(), _sin_loss
  else:
    case = CASES[case_id]
    make, params, objective = case.make, _params(case), _objective
  plain, plain_state = _run_apart(make(), params, objective)
  tx = ssd.offload_optimizer(make(), location="device", min_bytes=0, chunk_bytes=chunk_bytes)
  device, device_state = _run_apart(tx, params, objective)
  for i, (d, p) in enumerate(zip(device, plain)):
    _assert_bits_equal(d, p, f"{case_id} chunk_bytes={chunk_bytes} step {i + 1} params")
  _assert_bits_equal(device_state, plain_state, f"{case_id} chunk_bytes={chunk_bytes} state")


def test_adafactor_without_learning_rate_differs_by_rounding_only():
  # The suite's arrangement (one jit per step): the difference from plain optax is one rounding
  # at step 1 and does not grow: over 5 steps at most a few ulps of the leaf's largest starting
  # value (1.4 for "p", 5 for "r", flat up to step 8; a statistic of other rows, or of a chunk,
  # is off by 1e-3 of the values), however many ulps of the elements that p + u cancels.
  case = CASES["adafactor"]
  start = _host(_params(case))
  plain, _ = _run(case, case.make(), steps=5)
  device, _ = _run(case, _offload(case, "device"), steps=5)
  for key, p0 in start.items():
    d, p = device[0][key], plain[0][key]
    # step 1: the updates are equal; plain optax adds its update to the parameter in one fused
    # multiply-add, the streamed one (returned across a custom call) rounded first
    rounding = np.max(np.abs(d - p) / np.spacing(np.abs(p0) + np.abs(d - p0)))
    assert rounding <= 1, f"step 1 {key}: {rounding:.1f} ulps of the addition's operands"
    scale = np.spacing(np.max(np.abs(p0)))
    for i, (d, p) in enumerate(zip(device, plain)):
      worst = np.max(np.abs(d[key] - p[key])) / scale
      assert worst <= 8, f"step {i + 1} {key}: {worst:.1f} ulps of the leaf's largest value"


# ---------------------------------------------------------------------------------------------
# Property test: random leaf shapes and chunk sizes, host against device bit for bit.

PROPERTY_OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "lamb": lambda: optax.lamb(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2),
  "lion": lambda: optax.lion(1e-3),
  "prodigy": lambda: optax.contrib.prodigy(1.0),  # two passes: sums and dot products
}

_shapes = st.lists(
  st.tuples(
    st.integers(1, 700),  # the first axis, cut into chunks: 1-row leaves and sub-chunk ones
    st.lists(st.integers(1, 5), min_size=0, max_size=2),  # 1 to 3 dimensions
  ).map(lambda t: (t[0], *t[1])),
  min_size=1,
  max_size=4,
)


@settings(
  max_examples=8,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
  name=st.sampled_from(sorted(PROPERTY_OPTIMIZERS)),
  shapes=_shapes,
  chunk_bytes=st.sampled_from([4096, 8192, 12288, 20480]),
)
def test_random_shapes_and_chunks_host_equals_device(store, name, shapes, chunk_bytes):
  keys = jax.random.split(jax.random.key(len(shapes) * 1000 + chunk_bytes), len(shapes))
  params = {f"w{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}

  def loss(p):
    return sum(jnp.sum(jnp.sin(3 * x + i) ** 2) for i, x in enumerate(jax.tree.leaves(p)))

  def run(location):
    tx = ssd.offload_optimizer(
      PROPERTY_OPTIMIZERS[name](), location=location, min_bytes=0, chunk_bytes=chunk_bytes
    )

    @jax.jit
    def step(p, s):
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    history = []
    for _ in range(2):
      p, s = step(p, s)
      history.append(_host(p))
    return history, _host(_tx_state(s))

  device, device_state = run("device")
  host, host_state = run("host")
  for i, (h, d) in enumerate(zip(host, device)):
    _assert_bits_equal(h, d, f"{name} {shapes} chunk_bytes={chunk_bytes} step {i + 1}")
  _assert_bits_equal(host_state, device_state, f"{name} {shapes} state")
