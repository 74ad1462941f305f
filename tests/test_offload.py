"""The core offload path: policies, the partial-eval split, transformations, stats, files."""

import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config
from jax._src.interpreters import partial_eval as pe
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd

cp = jax.checkpoint_policies
NAMES = ("h", "g")


@pytest.fixture
def store(tmp_path):
  # forwarding off: every stored tensor goes to the file and comes back from it.
  with ssd.configured(
    directory=tmp_path / "store",
    capacity_bytes=1 << 30,
    host_cache_bytes=64 << 20,
    forwarding=False,
  ) as cfg:
    ssd.reset_stats()
    yield cfg


def layer(w, x):
  h = checkpoint_name(jnp.sin(x @ w["a"]), "h")
  g = checkpoint_name(h @ w["b"], "g")
  return x + jnp.tanh(g) * h


def make_loss(policy, n_layers=3, scan=True):
  f = jax.checkpoint(layer, policy=policy) if policy is not None else layer

  def loss(w, x):
    if scan:
      y, _ = jax.lax.scan(lambda c, wi: (f(wi, c), None), x, w)
    else:
      y = x
      for i in range(n_layers):
        y = f(jax.tree.map(lambda a: a[i], w), y)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  return loss


def params(key, n_layers=3, d=32, dtype=jnp.float32):
  ka, kb = jax.random.split(key)
  return {
    "a": (jax.random.normal(ka, (n_layers, d, d)) / np.sqrt(d)).astype(dtype),
    "b": (jax.random.normal(kb, (n_layers, d, d)) / np.sqrt(d)).astype(dtype),
  }


OURS = ssd.offload_policy(NAMES, min_bytes=0)
ON_DEVICE = cp.save_only_these_names(*NAMES)


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol
    )


# ---------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_grad_bit_exact_with_saving_on_device(store, scan):
  w, x = params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (8, 32))
  ours = jax.jit(jax.grad(make_loss(OURS, scan=scan)))(w, x)
  device = jax.jit(jax.grad(make_loss(ON_DEVICE, scan=scan)))(w, x)
  plain = jax.jit(jax.grad(make_loss(None, scan=scan)))(w, x)
  assert_trees_equal(ours, device)
  assert_trees_close(ours, plain)
  assert ssd.stats()["tensors_written"] == 2 * 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_bit_exact(store, dtype):
  w = params(jax.random.key(2), dtype=dtype)
  x = jax.random.normal(jax.random.key(3), (8, 32)).astype(dtype)
  vg = lambda pol: jax.jit(jax.value_and_grad(make_loss(pol)))(w, x)
  assert_trees_equal(vg(OURS), vg(ON_DEVICE))


def test_int32_residual(store):
  # The gather's backward needs the tagged integer indices.
  def f(table, x):
    idx = checkpoint_name((jnp.abs(x) * 7).astype(jnp.int32) % table.shape[0], "idx")
    return jnp.sum(jnp.sin(table[idx]) ** 2)

  table = jax.random.normal(jax.random.key(4), (50, 3))
  x = jax.random.normal(jax.random.key(5), (1000,))
  grad = lambda pol: jax.jit(jax.grad(jax.checkpoint(f, policy=pol)))(table, x)
  assert_trees_equal(
    grad(ssd.offload_policy(["idx"], min_bytes=0)), grad(cp.save_only_these_names("idx"))
  )
  s = ssd.stats()
  assert s["tensors_written"] == 1 and s["bytes_written"] == 1000 * 4


@pytest.mark.parametrize("n", [1, 3, 1023, 4097, 3 * 4096 + 5])
def test_sizes_not_multiple_of_4k(store, n):
  def f(w, x):
    h = checkpoint_name(jnp.sin(x * w), "h")
    return jnp.sum(h * h * w)

  w, x = jnp.float32(1.3), jax.random.normal(jax.random.key(n), (n,))
  grad = lambda pol: jax.jit(jax.grad(jax.checkpoint(f, policy=pol), argnums=(0, 1)))(w, x)
  assert_trees_equal(
    grad(ssd.offload_policy(["h"], min_bytes=0)), grad(cp.save_only_these_names("h"))
  )
  assert ssd.stats()["bytes_written"] == 4 * n


TRANSFORMS = {
  "value_and_grad": lambda loss: jax.jit(jax.value_and_grad(loss)),
  "grad_no_jit": lambda loss: jax.grad(loss),
  "vmap_grad": lambda loss: jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0))),
  "grad_vmap": lambda loss: jax.jit(
    jax.grad(lambda w, xs: jnp.sum(jax.vmap(loss, in_axes=(None, 0))(w, xs)))
  ),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transformations(store, transform):
  w = params(jax.random.key(6))
  x = jax.random.normal(jax.random.key(7), (8, 32))
  if transform in ("vmap_grad", "grad_vmap"):
    x = jnp.stack([x, 2 * x, -x])
  run = lambda pol: TRANSFORMS[transform](make_loss(pol))(w, x)
  ours = run(OURS)
  assert_trees_equal(ours, run(ON_DEVICE))
  assert_trees_close(ours, run(None))
  assert ssd.stats()["tensors_written"] > 0


def test_scan_inside_remat(store):
  w = params(jax.random.key(8))
  x = jax.random.normal(jax.random.key(9), (8, 32))

  def body(w, x):
    y, _ = jax.lax.scan(lambda c, wi: (layer(wi, c), None), x, w)
    return y

  def loss(pol):
    return lambda w, x: jnp.sum(jax.checkpoint(body, policy=pol)(w, x) ** 2)

  ours = jax.jit(jax.grad(loss(OURS)))(w, x)
  assert_trees_equal(ours, jax.jit(jax.grad(loss(ON_DEVICE)))(w, x))
  assert ssd.stats()["tensors_written"] == 2 * 3


def test_jit_inside_checkpoint(store):
  inner = jax.jit(layer)

  def loss(pol):
    f = jax.checkpoint(inner, policy=pol)
    return lambda w, x: jnp.sum(f(jax.tree.map(lambda a: a[0], w), x) ** 2)

  w = params(jax.random.key(10))
  x = jax.random.normal(jax.random.key(11), (8, 32))
  assert_trees_equal(jax.jit(jax.grad(loss(OURS)))(w, x), jax.jit(jax.grad(loss(ON_DEVICE)))(w, x))
  assert ssd.stats()["tensors_written"] == 2


def test_remat3(store):
  w = params(jax.random.key(12))
  x = jax.random.normal(jax.random.key(13), (8, 32))
  with jax_config.remat3(True):
    ours = jax.block_until_ready(jax.jit(jax.grad(make_loss(OURS)))(w, x))
    assert ssd.stats()["tensors_written"] == 2 * 3
  device = jax.jit(jax.grad(make_loss(ON_DEVICE)))(w, x)
  assert_trees_close(ours, device, rtol=0, atol=0)


def test_forward_only_writes_nothing(store):
  w = params(jax.random.key(14))
  x = jax.random.normal(jax.random.key(15), (8, 32))
  loss = make_loss(OURS)
  jax.block_until_ready(jax.jit(loss)(w, x))
  jax.block_until_ready(jax.jit(lambda w, x: jax.vjp(loss, w, x)[0])(w, x))
  assert ssd.stats()["tensors_written"] == 0


def test_vjp_applied_twice(store):
  w = params(jax.random.key(16))
  x = jax.random.normal(jax.random.key(17), (8, 32))
  _, f_vjp = jax.vjp(make_loss(OURS), w, x)
  _, f_ref = jax.vjp(make_loss(ON_DEVICE), w, x)
  first, second = f_vjp(jnp.float32(1.0)), f_vjp(jnp.float32(2.0))
  assert_trees_equal(first, f_ref(jnp.float32(1.0)))
  assert_trees_equal(second, f_ref(jnp.float32(2.0)))
  assert ssd.stats()["tensors_read"] == 2 * 6


def test_two_grads_in_one_jit(store):
  w = params(jax.random.key(18))
  x = jax.random.normal(jax.random.key(19), (8, 32))

  def both(pol):
    loss = make_loss(pol)
    return jax.jit(lambda w, x: (jax.grad(loss)(w, x), jax.grad(loss)(w, 2 * x)))(w, x)

  assert_trees_equal(both(OURS), both(ON_DEVICE))


def test_gradient_accumulation(store):
  w = params(jax.random.key(20))
  xs = jax.random.normal(jax.random.key(21), (4, 8, 32))

  def accumulated(pol):
    g = jax.grad(make_loss(pol))

    def step(acc, x):
      return jax.tree.map(jnp.add, acc, g(w, x)), None

    total, _ = jax.lax.scan(step, jax.tree.map(jnp.zeros_like, w), xs)
    return total

  ours = jax.jit(accumulated, static_argnums=0)(OURS)
  assert_trees_equal(ours, jax.jit(accumulated, static_argnums=0)(ON_DEVICE))
  assert ssd.stats()["tensors_written"] == 4 * 2 * 3


def test_repeated_steps_reuse_space(store):
  w = params(jax.random.key(22))
  x = jax.random.normal(jax.random.key(23), (8, 32))
  step = jax.jit(jax.grad(make_loss(OURS)))
  ref = jax.jit(jax.grad(make_loss(ON_DEVICE)))(w, x)
  for i in range(5):
    assert_trees_equal(
      step(w, x * (i + 1)), jax.jit(jax.grad(make_loss(ON_DEVICE)))(w, x * (i + 1))
    )
  assert_trees_equal(step(w, x), ref)
  s = ssd.stats()
  assert s["live_entries"] <= 2 * 3  # the last step's, released at the next store


def test_jvp_of_grad_through_scanned_layers_raises_clearly(store):
  # Layers checkpointed inside a scan body: the body is traced apart from the enclosing jvp,
  # so its backward has no recomputed copy to take the tangent from (see test_jax_layer.py).
  w = params(jax.random.key(24))
  x = jax.random.normal(jax.random.key(25), (8, 32))
  g = jax.grad(make_loss(OURS))
  with pytest.raises(ssd.HigherOrderOffloadError, match="forward-mode"):
    jax.jvp(lambda w: g(w, x), (w,), (w,))


# ---------------------------------------------------------------------------------------------
# What leaves the program, and how much


def test_saved_residuals_show_handle(store):
  d = 256  # 8 x 256 f32 = 8 KiB per tag
  w = params(jax.random.key(26), d=d)
  x = jax.random.normal(jax.random.key(27), (8, d))
  loss = make_loss(OURS, scan=False)
  jaxpr = jax.make_jaxpr(jax.grad(loss))(w, x)
  text = str(jaxpr)
  assert "ssd_store" in text and "ssd_load" in text
  from jax._src.ad_checkpoint import saved_residuals

  kinds = lambda f: [(a.shape, np.dtype(a.dtype)) for a, _ in saved_residuals(f, w, x)]
  ours, device = kinds(loss), kinds(make_loss(ON_DEVICE, scan=False))
  handle, tagged = ((2,), np.dtype(np.uint32)), ((8, d), np.dtype(np.float32))
  # the tagged tensors are no longer residuals: a handle stands where each was
  assert ours.count(handle) == 2 * 3 and device.count(handle) == 0
  assert ours.count(tagged) == device.count(tagged) - 2 * 3


def test_stats_exact_per_step(store):
  d = 64
  w = params(jax.random.key(28), d=d)
  x = jax.random.normal(jax.random.key(29), (16, d))
  step = jax.jit(jax.grad(make_loss(OURS)))
  tagged = 3 * 2 * 16 * d * 4
  for _ in range(3):
    ssd.reset_stats()
    jax.block_until_ready(step(w, x))
    ssd.flush()
    s = ssd.stats()
    assert s["bytes_written"] == tagged and s["bytes_read"] == tagged
    assert s["tensors_written"] == 6 and s["tensors_read"] == 6
    assert s["disk_bytes_written"] + s["write_skipped_bytes"] == tagged
    assert s["disk_bytes_read"] == tagged and s["forwarded_bytes"] == 0  # forwarding is off


def test_min_bytes_keeps_small_tensors_on_device(store):
  w = params(jax.random.key(30))
  x = jax.random.normal(jax.random.key(31), (8, 32))  # 1 KiB tags
  pol = ssd.offload_policy(NAMES, min_bytes=4096)
  assert_trees_equal(
    jax.jit(jax.grad(make_loss(pol)))(w, x), jax.jit(jax.grad(make_loss(ON_DEVICE)))(w, x)
  )
  assert ssd.stats()["tensors_written"] == 0


def test_host_location(store):
  w = params(jax.random.key(32))
  x = jax.random.normal(jax.random.key(33), (8, 32))
  pol = ssd.location_policy({"h": "host", "g": "nvme"}, min_bytes=0)
  assert_trees_equal(
    jax.jit(jax.grad(make_loss(pol)))(w, x), jax.jit(jax.grad(make_loss(ON_DEVICE)))(w, x)
  )
  ssd.flush()
  s = ssd.stats()
  assert s["tensors_written"] == 6
  assert s["disk_bytes_written"] + s["write_skipped_bytes"] == 3 * 8 * 32 * 4


def test_flax_scan_remat(store):
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = checkpoint_name(nn.Dense(32)(x), "h")
      g = checkpoint_name(nn.Dense(32)(jnp.tanh(h)), "g")
      return x + g * h, None

  def model(policy):
    return nn.scan(
      nn.remat(Block, policy=policy, prevent_cse=False),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=3,
    )()

  x = jax.random.normal(jax.random.key(34), (4, 32))
  variables = model(ON_DEVICE).init(jax.random.key(35), x, None)

  def grad(policy):
    loss = lambda v: jnp.sum(model(policy).apply(v, x, None)[0] ** 2)
    return jax.jit(jax.grad(loss))(variables)

  assert_trees_equal(grad(OURS), grad(ON_DEVICE))
  assert ssd.stats()["tensors_written"] == 6


# ---------------------------------------------------------------------------------------------
# JAX's own policies are untouched by the hook


@pytest.mark.parametrize(
  "policy",
  [
    cp.nothing_saveable,
    cp.everything_saveable,
    cp.dots_saveable,
    cp.save_only_these_names("h"),
    cp.save_any_names_but_these("g"),
    cp.save_and_offload_only_these_names(
      names_which_can_be_saved=["g"],
      names_which_can_be_offloaded=["h"],
      offload_src="device",
      offload_dst="pinned_host",
    ),
  ],
  ids=["nothing", "everything", "dots", "save_names", "save_but", "host_offload"],
)
def test_standard_policies_identical_with_and_without_hook(policy):
  w = params(jax.random.key(36))
  x = jax.random.normal(jax.random.key(37), (8, 32))
  closed = jax.make_jaxpr(lambda w, x: layer(jax.tree.map(lambda a: a[0], w), x))(w, x)
  hooked = pe._partial_eval_jaxpr_custom_cached
  original = hooked._ssdtrain_original
  n_in = len(closed.jaxpr.invars)
  args = (closed.jaxpr, (False,) * (n_in - 1) + (True,), (True,) * n_in, (False,), (False,), policy)
  a, b = hooked(*args), original(*args)
  assert str(a[0]) == str(b[0]) and str(a[1]) == str(b[1]) and a[2:] == b[2:]


# ---------------------------------------------------------------------------------------------
# Policies and configuration


def test_policy_validation():
  with pytest.raises(ValueError, match="both"):
    ssd.offload_policy(["a", "b"], names_to_save=["b"])
  with pytest.raises(ValueError, match="unknown location 'disk'"):
    ssd.location_policy({"a": "disk"})
  with pytest.raises(TypeError, match="string"):
    ssd.offload_policy("qkv")
  with pytest.raises(ValueError, match="min_bytes"):
    ssd.offload_policy(["a"], min_bytes=-1)
  assert hash(ssd.offload_policy(["a"])) == hash(ssd.offload_policy(["a"]))


def test_configure_validation(tmp_path):
  with pytest.raises(TypeError, match="unknown option"):
    ssd.configure(tmp_path, bogus=1)
  with pytest.raises(ValueError, match="capacity_bytes"):
    ssd.configure(tmp_path, capacity_bytes=0)
  with pytest.raises(ValueError, match="io_threads"):
    ssd.configure(tmp_path, io_threads=0)
  assert ssd.parse_size("512MiB", what="x") == 512 << 20
  assert ssd.parse_size("4G", what="x") == 4 << 30
  assert ssd.parse_size("1.5GB", what="x") == 1_500_000_000
  with pytest.raises(ValueError, match="SIZE|size"):
    ssd.parse_size("lots", what="size")


def test_defaults_from_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("SSDTRAIN_DIR", str(tmp_path / "a") + ":" + str(tmp_path / "b"))
  monkeypatch.setenv("SSDTRAIN_HOST_CACHE", "64MiB")
  monkeypatch.setenv("SSDTRAIN_O_DIRECT", "off")
  cfg = ssd.default_config()
  assert cfg.directories == (str(tmp_path / "a"), str(tmp_path / "b"))
  assert cfg.host_cache_bytes == 64 << 20 and cfg.o_direct is False
  monkeypatch.setenv("SSDTRAIN_O_DIRECT", "maybe")
  with pytest.raises(ValueError, match="SSDTRAIN_O_DIRECT"):
    ssd.default_config()


def test_store_files_are_where_configured_and_private(tmp_path):
  directory = tmp_path / "private-store"
  with ssd.configured(directory=directory, capacity_bytes=1 << 30, forwarding=False):
    w = params(jax.random.key(38))
    x = jax.random.normal(jax.random.key(39), (8, 32))
    jax.block_until_ready(jax.jit(jax.grad(make_loss(OURS)))(w, x))
    assert ssd.stats()["disk_bytes_written"] > 0
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for entry in os.listdir(directory):  # unlinked files leave no entry; named ones are 0600
      assert stat.S_IMODE(os.stat(directory / entry).st_mode) == 0o600
  assert os.listdir(directory) == []


def test_default_store_is_a_private_temp_dir(monkeypatch):
  monkeypatch.delenv("SSDTRAIN_DIR", raising=False)
  ssd.shutdown()
  try:
    ssd.configure()
    (d,) = ssd.store_directories()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    ssd.shutdown()
    assert not os.path.exists(d)
  finally:
    ssd.shutdown()


def test_base_policy_decides_untagged_equations(store):
  w = params(jax.random.key(40))
  x = jax.random.normal(jax.random.key(41), (8, 32))
  ours = ssd.offload_policy(["h"], names_to_save=["g"], min_bytes=0, base=cp.dots_saveable)
  reference = cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("h", "g"))
  grad = lambda pol: jax.jit(jax.grad(make_loss(pol)))(w, x)
  assert_trees_equal(grad(ours), grad(reference))
  assert ssd.stats()["tensors_written"] == 3


# ---------------------------------------------------------------------------------------------
# Store directory placeholders


def test_directory_placeholders(tmp_path):
  import jax

  from jax_ssdtrain._src import options

  expanded = options._directories(str(tmp_path / "p{process}" / "d{device}"))
  assert expanded == tuple(str(tmp_path / "p0" / f"d{i}") for i in range(len(jax.local_devices())))
  assert options._directories(str(tmp_path / "a{{b}}")) == (str(tmp_path / "a{b}"),)
  with pytest.raises(ValueError, match=r"unknown placeholder \{host\}"):
    options._directories(str(tmp_path / "{host}"))
  with pytest.raises(ValueError, match="malformed placeholder"):
    options._directories(str(tmp_path / "{process"))
  with ssd.configured(directory=str(tmp_path / "store-{process}")) as cfg:
    assert cfg.directories == (str(tmp_path / "store-0"),)
    assert os.path.isdir(tmp_path / "store-0")


def test_device_placeholder_sets_device_groups(tmp_path):
  import jax

  n = len(jax.local_devices())
  with ssd.configured(directory=[str(tmp_path / "a{device}"), str(tmp_path / "b{device}")]) as cfg:
    assert cfg.device_groups == n and len(cfg.directories) == 2 * n
  with ssd.configured(directory=str(tmp_path / "plain")) as cfg:  # no {device}: striped
    assert cfg.device_groups == 0
  with pytest.raises(ValueError, match=r"\{device\} must be in every store directory"):
    ssd.configure(directory=[str(tmp_path / "a{device}"), str(tmp_path / "b")])
  with pytest.raises(ValueError, match="device_groups=3 does not divide the 2 store"):
    ssd.configure(directory=[str(tmp_path / "x"), str(tmp_path / "y")], device_groups=3)
  with pytest.raises(ValueError, match="device_groups: expected an integer >= 0, got -1"):
    ssd.configure(directory=str(tmp_path / "x"), device_groups=-1)
