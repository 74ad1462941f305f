"""The JAX-facing layer: internals, version guard, exact rounding of offloaded values,
composition with JAX's policy combinators, and how saved residuals are described."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import jax_internals as ji

cp = jax.checkpoint_policies


@pytest.fixture
def store(tmp_path):
  with ssd.configured(
    str(tmp_path / "store"),
    capacity_bytes=1 << 30,
    host_cache_bytes=64 << 20,
    host_tier_bytes=64 << 20,
  ):
    ssd.reset_stats()
    yield


def assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------
# JAX internals and the version guard


INTERNALS = [
  "PARTIAL_EVAL_CUSTOM_CACHED",
  "partial_eval_jaxpr_custom_rules",
  "dce_rules",
  "weakref_lru_cache",
  "SAVE_FROM_BOTH_CODE",
  "CHECKPOINT_NAME_CLASSES",
  "SAVED_RESIDUALS_FN",
  "apply_primitive",
  "prim_requires_devices_during_lowering",
  "SPMDAxisContext",
  "ShardingContext",
  "GSPMDSharding",
  "LOWER_JAXPR_TO_MODULE",
  "EXECUTE_REPLICATED",
  "SaveableType",
  "RecomputeType",
  "Offloadable",
  "name_p",
  "DynamicJaxprTrace",
  "Zero",
  "DIFFERENTIATING_TRACES",
  "REMAT_TRANSFORM_MODULES",
  "summarize_source_info",
  "OUTPUT_BODY_PARAMS",
  "JaxprStackFrame",
  "REMAT_PRIMITIVE_NAMES",
  "FLASH_ATTENTION_FORWARD",
]


@pytest.mark.parametrize("name", INTERNALS)
def test_internal_is_where_we_expect_it(name):
  value = getattr(ji, name)
  assert value is not None and value != (), f"{name} moved in jax {jax.__version__}"


def test_flash_attention_forward_is_named_as_cudnns_primitive():
  # the name flash_attention_saveable matches: the primitive cuDNN's attention's forward rule
  # binds (importable without a GPU; its use needs cuDNN)
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

  assert cudnn_attention._dot_product_attention_fwd_p_wrapper.name == ji.FLASH_ATTENTION_FORWARD


def test_hooks_installed_where_jax_calls_them():
  hook = getattr(ji.PE_MODULE, ji.PARTIAL_EVAL_CUSTOM_CACHED)
  assert getattr(hook, "_ssdtrain_hook", False)
  assert getattr(ji.SAVED_RESIDUALS_MODULE, ji.SAVED_RESIDUALS_FN)._ssdtrain_hook
  for cls in ji.CHECKPOINT_NAME_CLASSES:
    assert getattr(cls.remat, "_ssdtrain_hook", False), cls
  assert ji.JaxprStackFrame.to_jaxpr._ssdtrain_hook  # where a traced program's policies are checked
  assert getattr(ji.MLIR_MODULE, ji.LOWER_JAXPR_TO_MODULE)._ssdtrain_hook  # the load counts
  assert (
    ji.EXECUTE_REPLICATED.__call__._ssdtrain_hook
  )  # where a program's first run opens the store
  ji.check_partial_eval_call_site()  # raises MissingInternal when JAX changed the call


def test_output_body_finds_the_bodies_of_scan_and_jit():
  # print_saved_residuals names handles made inside a scan or jit by following each output
  # into the equation's body (ji.output_body): the body must line up with the outputs.
  inner = jax.jit(lambda v: jnp.sin(v))
  scanned = lambda xs: jax.lax.scan(lambda c, x: (c + inner(x), c * x), 0.0, xs)  # noqa: E731
  (scan_eqn,) = jax.make_jaxpr(scanned)(jnp.ones(3)).jaxpr.eqns
  body = ji.output_body(scan_eqn)
  assert body is not None, f"scan's body param moved in jax {jax.__version__}"
  assert len(body.outvars) == len(scan_eqn.outvars) == 2
  (jit_eqn,) = [e for e in body.eqns if ji.output_body(e) is not None]
  assert [e.primitive.name for e in ji.output_body(jit_eqn).eqns] == ["sin"]
  assert ji.output_body(body.eqns[-1]) is None  # not a call
  assert "test_jax_layer.py" in ji.summarize_source_info(scan_eqn.source_info)


def test_save_from_both_closure_is_recognised():
  a, b = cp.dots_saveable, cp.save_only_these_names("h")
  assert ji.save_from_both_parts(cp.save_from_both_policies(a, b)) == (a, b)
  assert ji.save_from_both_parts(cp.nothing_saveable) is None


def _import_with_version(version: str, allow: bool):
  code = textwrap.dedent(f"""
      import warnings, jax
      jax.__version__ = {version!r}
      with warnings.catch_warnings(record=True) as w:
          warnings.simplefilter("always")
          try:
              import jax_ssdtrain
              print("imported", any("tested with" in str(x.message) for x in w))
          except ImportError as e:
              print("refused:", e)
      """)
  env = {
    "JAX_PLATFORMS": "cpu",
    "PATH": "/usr/bin:/bin",
    "PYTHONPATH": ":".join(p for p in sys.path if p),
  }
  import os

  for k in ("SSDTRAIN_LIB", "HOME"):
    if k in os.environ:
      env[k] = os.environ[k]
  if allow:
    env["SSDTRAIN_ALLOW_UNTESTED_JAX"] = "1"
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
  ).stdout


def test_untested_jax_is_refused_with_the_range():
  out = _import_with_version("0.13.0", allow=False)
  assert "refused:" in out and "jax>=0.10.2,<0.13" in out and "SSDTRAIN_ALLOW_UNTESTED_JAX" in out
  assert "imported True" in _import_with_version("0.13.0", allow=True)
  assert "imported False" in _import_with_version(jax.__version__, allow=False)


def test_version_parsing():
  assert ji.jax_version() >= (0, 10, 2)
  assert ji.TESTED_JAX[0] <= ji.jax_version() < ji.TESTED_JAX[1]


# ---------------------------------------------------------------------------------------------
# Offloaded values are bit-identical to the same values saved on the device (excess precision)


def _excess_precision_fn(dtype):
  def f(w, x):
    h = checkpoint_name(jnp.dot(x, w), "h")  # low precision
    e = checkpoint_name(jnp.exp(h.astype(jnp.float32)), "e")  # consumes h in the forward
    return jnp.sum(e * h.astype(jnp.float32))

  return f


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("location", ["nvme", "host"])
def test_offloaded_tag_bit_identical_to_device_saving(store, dtype, location):
  x = jax.random.normal(jax.random.key(0), (64, 64)).astype(dtype)
  w = (0.1 * jax.random.normal(jax.random.key(1), (64, 64))).astype(dtype)
  f = _excess_precision_fn(dtype)
  run = lambda pol: jax.jit(jax.value_and_grad(jax.checkpoint(f, policy=pol), argnums=(0, 1)))(w, x)
  ours = run(ssd.offload_policy(["h"], names_to_save=["e"], min_bytes=0, location=location))
  device = run(cp.save_only_these_names("h", "e"))
  assert_bitwise(ours, device)
  assert ssd.stats()["tensors_written"] == 1


def test_excess_precision_in_a_scan_of_layers(store):
  # Several bf16 tags per layer, each consumed by later f32 math in the forward pass, inside
  # a scan and under vmap: every tag offloaded must give the device-saving result bit for bit.
  def layer(x, w):
    a = checkpoint_name(jnp.tanh(x @ w), "a")
    b = checkpoint_name((a * 1.7).astype(jnp.bfloat16) @ w.T, "b")
    c = jnp.sin(b.astype(jnp.float32)) + a.astype(jnp.float32)
    return c.astype(jnp.bfloat16), None

  def loss(pol, ws, x):
    y, _ = jax.lax.scan(jax.checkpoint(layer, policy=pol), x, ws)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  ws = (0.2 * jax.random.normal(jax.random.key(2), (3, 32, 32))).astype(jnp.bfloat16)
  xs = jax.random.normal(jax.random.key(3), (4, 8, 32)).astype(jnp.bfloat16)
  grad = lambda pol: jax.jit(jax.vmap(jax.grad(lambda ws, x: loss(pol, ws, x)), (None, 0)))(ws, xs)
  assert_bitwise(
    grad(ssd.offload_policy(["a", "b"], min_bytes=0)), grad(cp.save_only_these_names("a", "b"))
  )


# ---------------------------------------------------------------------------------------------
# Composition with jax.checkpoint_policies.save_from_both_policies


def _two_tag_fn(w, x):
  h = checkpoint_name(jnp.sin(x @ w), "h")
  e = checkpoint_name(jnp.cos(h @ w), "e")
  return jnp.sum(jnp.tanh(e @ w))


def _grads(policy):
  w = 0.1 * jax.random.normal(jax.random.key(4), (32, 32))
  x = jax.random.normal(jax.random.key(5), (16, 32))
  return jax.block_until_ready(
    jax.jit(jax.grad(jax.checkpoint(_two_tag_fn, policy=policy), argnums=(0, 1)))(w, x)
  )


def test_save_from_both_with_our_policy_equals_the_single_policy(store):
  both = cp.save_from_both_policies(
    ssd.offload_policy(["h"], min_bytes=0), cp.save_only_these_names("e")
  )
  single = ssd.offload_policy(["h"], names_to_save=["e"], min_bytes=0)
  assert_bitwise(_grads(both), _grads(single))
  assert_bitwise(_grads(both), _grads(cp.save_only_these_names("h", "e")))
  assert ssd.stats()["tensors_written"] == 3  # one per run through the store


def test_save_from_both_nested_and_either_side(store):
  inner = cp.save_from_both_policies(
    cp.dots_with_no_batch_dims_saveable, ssd.location_policy({"e": "host"}, min_bytes=0)
  )
  both = cp.save_from_both_policies(cp.save_only_these_names("h"), inner)
  assert_bitwise(_grads(both), _grads(cp.save_only_these_names("h", "e")))
  s = ssd.stats()
  assert s["tensors_written"] == 1 and s["host_tier_bytes_peak"] > 0


@pytest.mark.parametrize(
  "other,written",
  [
    (cp.save_only_these_names("h"), 0),  # saving on the device wins over the store
    (cp.save_only_these_names("x"), 1),  # the store wins over recomputing
    (
      cp.save_and_offload_only_these_names(  # and over JAX's own host offload
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["h"],
        offload_src="device",
        offload_dst="pinned_host",
      ),
      1,
    ),
  ],
  ids=["device-wins", "store-over-remat", "store-over-jax-offload"],
)
def test_composition_precedence(store, other, written):
  both = cp.save_from_both_policies(ssd.offload_policy(["h"], min_bytes=0), other)
  _grads(both)
  assert ssd.stats()["tensors_written"] == written
  from jax_ssdtrain._src.policies import Location, StoreDecision, decision_rank

  store_rank = decision_rank(StoreDecision(Location.NVME))
  assert decision_rank(True) > store_rank > decision_rank(ji.Offloadable("device", "pinned_host"))
  assert decision_rank(False) == 0


def test_jax_only_combination_untouched():
  both = cp.save_from_both_policies(cp.save_only_these_names("h"), cp.save_only_these_names("e"))
  from jax_ssdtrain._src.policies import as_offloading

  assert as_offloading(both) is None
  with pytest.raises(ValueError, match="boolean"):  # JAX's own answer for non-bool policies
    cp.save_from_both_policies(cp.save_only_these_names("h"), lambda *a, **k: "x")(
      ji.name_p, jax.core.ShapedArray((2,), jnp.float32), name="h"
    )


# ---------------------------------------------------------------------------------------------
# saved_residuals / print_saved_residuals name the tag and where it went


def test_saved_residuals_name_tag_and_location(store, capsys):
  w = jax.random.normal(jax.random.key(6), (32, 32))
  x = jax.random.normal(jax.random.key(7), (16, 32))
  pol = ssd.location_policy({"h": "nvme", "e": "host"}, min_bytes=0)
  from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' data

  described = [text for _, text in saved_residuals(jax.checkpoint(_two_tag_fn, policy=pol), w, x)]
  assert any(
    t.startswith("named 'h' -> nvme from ") and "test_jax_layer.py" in t for t in described
  ), described
  assert any(t.startswith("named 'e' -> host from ") for t in described), described
  assert not any("ssd_store" in t for t in described)
  jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(_two_tag_fn, policy=pol), w, x)
  assert "named 'h' -> nvme" in capsys.readouterr().out


@pytest.mark.parametrize("remat3", [False, True])
def test_saved_residuals_name_tags_inside_a_scan(store, remat3, capsys):
  # A scan returns its layers' handles stacked (u32[L, 2]): JAX calls them "output of scan";
  # they are named after the tag and tier, with where the tag is inside the layer.
  ws = jax.random.normal(jax.random.key(6), (3, 32, 32)) / 8
  x = jax.random.normal(jax.random.key(7), (16, 32))
  pol = ssd.location_policy({"h": "nvme", "e": "host"}, min_bytes=0)
  from jax._src.ad_checkpoint import saved_residuals

  with ji.remat3(remat3):
    body = jax.checkpoint(lambda w, v: v + jnp.tanh(_two_tag_fn(w, v)), policy=pol)
    stack = lambda ws, v: jax.lax.scan(lambda c, w: (body(w, c), None), v, ws)[0].sum()  # noqa: E731
    described = {text for _, text in saved_residuals(stack, ws, x)}
    jax.ad_checkpoint.print_saved_residuals(stack, ws, x)
  handles = [t for t in described if "' -> " in t]
  assert len(handles) == 2, described  # "h" and "e", one handle per layer each
  for name, tier in (("h", "nvme"), ("e", "host")):
    (text,) = [t for t in handles if t.startswith(f"named {name!r} -> {tier} from ")]
    tag_site, scan_site = text.split(", output of scan from ")
    assert "test_jax_layer.py" in tag_site and "_two_tag_fn" in tag_site, text
    assert "test_jax_layer.py" in scan_site, text
  printed = capsys.readouterr().out
  assert "u32[3,2] named 'h' -> nvme from " in printed, printed


# ---------------------------------------------------------------------------------------------
# Higher-order derivatives: under an enclosing differentiation the backward reloads with the
# tangent of a recomputed copy (reload_p), with and without jax_remat3 (found by JAX's
# RematTest / Remat3Test test_remat_custom_policy_save_sin: check_grads(order=2))


def _sin_tags(x):
  s = lambda v: checkpoint_name(jnp.sin(v), "s")
  return jnp.sum(s(s(x) * s(x)))


@pytest.mark.parametrize("remat3", [False, True])
@pytest.mark.parametrize("location", ["nvme", "host"])
def test_second_order_through_offloaded_tag(store, location, remat3):
  x = jnp.linspace(0.1, 2.0, 64)
  with ji.remat3(remat3):  # jax 0.10 picks the remat implementation when checkpoint is applied
    f = jax.checkpoint(_sin_tags, policy=ssd.offload_policy(["s"], min_bytes=0, location=location))
    hvp = lambda fn: jax.jvp(jax.grad(fn), (x,), (jnp.ones_like(x),))[1]
    want = hvp(_sin_tags)
    np.testing.assert_allclose(hvp(f), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda: hvp(f))(), want, rtol=1e-6)
    gg = lambda fn: jax.grad(lambda x: jnp.sum(jax.grad(fn)(x)))(x)
    np.testing.assert_allclose(gg(f), gg(_sin_tags), rtol=1e-6)
    gjg = lambda fn: jax.grad(lambda x: jnp.sum(jax.jit(jax.grad(fn))(x)))(x)
    np.testing.assert_allclose(gjg(f), gg(_sin_tags), rtol=1e-6)
    if not (remat3 and ji.jax_version() < (0, 11)):  # jax 0.10's CheckpointName has no vmap
      np.testing.assert_allclose(
        jax.hessian(f)(x[:8]), jax.hessian(_sin_tags)(x[:8]), rtol=1e-6, atol=1e-7
      )
  assert ssd.stats()["tensors_written"] > 0
  ssd.flush()
  assert ssd.stats()["live_entries"] == 0


@pytest.mark.parametrize("remat3", [False, True])
def test_first_order_backward_recomputes_no_more_than_saving(store, remat3):
  # Without an enclosing differentiation nothing extra is recomputed: the backward's jaxpr
  # computes no more than with the tag saved on the device.
  x = jnp.linspace(0.1, 2.0, 8)

  def body(x):
    return jnp.sum(jnp.sin(checkpoint_name(jnp.cos(x), "c")))

  def backward_text(policy):
    _, vjp = jax.vjp(jax.checkpoint(body, policy=policy), x)
    return str(jax.make_jaxpr(vjp)(jnp.float32(1.0)))

  with ji.remat3(remat3):
    ours = backward_text(ssd.offload_policy(["c"], min_bytes=0))
    saved = backward_text(cp.save_only_these_names("c"))
  assert "ssd_load" in ours and "ssd_reload" not in ours
  assert ours.count(" cos ") == saved.count(" cos "), (ours, saved)


def test_second_order_through_a_scanned_checkpoint_refused_clearly(store):
  # A scan body is traced apart from the enclosing differentiation: its backward cannot take
  # the tangent from a recomputation, and forward-mode through its store is refused (not wrong).
  f = jax.checkpoint(
    lambda c: jnp.sin(checkpoint_name(jnp.sin(c), "s")),
    policy=ssd.offload_policy(["s"], min_bytes=0),
  )
  loss = lambda x: jnp.sum(jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0])
  with pytest.raises(ssd.HigherOrderOffloadError, match="'s'"):
    jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(jnp.ones(4))
