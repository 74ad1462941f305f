"""What a new user meets in the first hour: the scripts' errors, flush after a step, silent
no-op policies, the probe CLI."""

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import config
from jax_ssdtrain._src.measure import disk

ROOT = Path(__file__).resolve().parents[1]


def _train_cli(*args, **env):
  return subprocess.run(
    [sys.executable, "-m", "scripts.train", *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
  )


@pytest.mark.parametrize(
  "env,message",
  [
    ({"SSDTRAIN_DIR": "/proc"}, "store directory /proc cannot hold the store's files"),
    ({"SSDTRAIN_HOST_CACHE": "lots"}, "SSDTRAIN_HOST_CACHE: cannot read 'lots' as a size"),
    ({"SSDTRAIN_FORWARDING": "maybe"}, "SSDTRAIN_FORWARDING"),
  ],
)
def test_store_settings_fail_early_in_one_line(env, message):
  proc = _train_cli("--steps", "1", **env)
  assert proc.returncode == 2
  assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
  assert "params" not in proc.stdout  # before any model set-up


def test_tags_a_model_does_not_have_are_refused():
  proc = _train_cli("--model", "gpt", "--locations", "cross_q=nvme,qkv=nvme", "--steps", "1")
  assert proc.returncode == 2
  assert "model 'gpt' has no tag 'cross_q'" in proc.stderr and "layer_in" in proc.stderr


def test_help_shows_defaults_and_sizes_accept_suffixes():
  from scripts import train

  text = train.build_parser().format_help()
  assert "(default: 30)" in text and "(default: gpt)" in text and "1MiB" in text
  assert train.build_parser().parse_args(["--min-bytes", "64KiB"]).min_bytes == 64 << 10


def test_train_config_is_its_parser():
  # scripts/train.py's options are the fields of its frozen Config, defaults included: one
  # place says each of them, and the run's RunConfig takes the fields of the same name.
  import dataclasses

  from scripts import train

  fields = {f.name: f.default for f in dataclasses.fields(train.Config)}
  assert vars(train.build_parser().parse_args([])) == fields
  assert train.parse_config([]) == train.Config()
  cfg = train.parse_config(["--preset", "small", "--batch", "4", "--accum", "2", "--layers", "3"])
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.batch = 8
  run = cfg.run_config()
  assert (run.preset, run.batch, run.accum, run.min_bytes) == ("small", 4, 2, 1 << 20)
  assert run.model_overrides == {"attention": "auto", "num_layers": 3}
  assert train.parse_config([]).run_config().min_bytes == 0  # tiny


def test_auto_plan_without_a_configured_store(monkeypatch):
  # --policy auto with --bandwidth and no --store-dir read the store's sizes from a store that
  # was never configured (AttributeError); the profile now gets the defaults'.
  from scripts import train, training

  seen = {}

  class Reached(Exception):
    pass

  def profile_run(run, **kw):
    seen.update(kw)
    raise Reached

  monkeypatch.setattr(training, "profile_run", profile_run)
  config.reset_to_unconfigured()  # as in a fresh process
  cfg = train.parse_config(["--policy", "auto", "--bandwidth", "0.9,0.77"])
  with pytest.raises(Reached):
    train.auto_plan(training.RunConfig(preset="tiny", batch=2), cfg)
  assert seen["host_cache_bytes"] == ssd.default_config().host_cache_bytes
  assert seen["bandwidth"] == (0.9, 0.77) and seen["directory"] is None


@pytest.mark.slow
def test_auto_policy_without_store_dir(tmp_path, capsys):
  from scripts import train

  config.reset_to_unconfigured()  # nothing configured yet, as in a fresh process
  out = train.main(
    [
      "--steps",
      "1",
      "--batch",
      "2",
      "--policy",
      "auto",
      "--bandwidth",
      "0.9,0.77",
      "--workdir",
      str(tmp_path / "run"),
    ]
  )
  text = capsys.readouterr()
  assert out["steps"] == 1
  assert "activation store:" in text.out and "(private, removed at exit)" in text.out
  assert f"metrics: {tmp_path / 'run' / 'metrics.csv'}" in text.out
  assert "profiling" in text.err and "compiling" in text.err


def test_flush_waits_for_the_dispatched_step(tmp_path):
  with ssd.configured(str(tmp_path / "s"), capacity_bytes=1 << 28):
    ssd.reset_stats()
    w = jnp.ones((512, 512)) / 512
    f = jax.checkpoint(
      lambda x: jnp.sin(checkpoint_name(x @ w, "h")), policy=ssd.offload_policy(["h"], min_bytes=0)
    )
    step = jax.jit(jax.grad(lambda x: jnp.sum(f(f(f(x))))))
    grads = step(jnp.ones((512, 512)))  # kept, not waited for (as a training loop does)
    ssd.flush()
    assert grads.is_ready()
    s = ssd.stats()
    assert s["tensors_written"] == 3 and s["tensors_read"] == 3


def test_policy_that_offloads_nothing_says_so():
  f = jax.checkpoint(
    lambda x: jnp.sin(checkpoint_name(jnp.cos(x), "tiny_tag")),
    policy=ssd.offload_policy(["tiny_tag"]),
  )  # 1 MiB floor, 64-byte tag
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(16))
  text = " ".join(str(w.message) for w in caught)
  assert "offloads nothing" in text and "'tiny_tag' (64 bytes)" in text and "min_bytes" in text


def _ssd_warnings(fn, *args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.block_until_ready(fn(*args))
  return [str(w.message) for w in caught if "jax_ssdtrain" in str(w.message)]


def test_policy_tags_the_program_does_not_have_warn_once():
  # A typo ('fh_upp' for 'fh_up') offloaded nothing and said nothing. The warning names the tag
  # the program lacks, not the one it has, once per policy, whatever is traced again.
  def block(x):
    return jnp.sin(checkpoint_name(jnp.cos(x), "fh_up"))

  policy = ssd.offload_policy(["fh_up", "fh_upp"], min_bytes=0)
  step = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(block, policy=policy)(x))))
  with ssd.configured(tempfile.mkdtemp(), capacity_bytes=64 << 20):
    (text,) = _ssd_warnings(step, jnp.ones(16))
    assert "'fh_upp'" in text and "in no checkpoint" in text, text
    assert "'fh_up'" not in text.split("(")[0] and "its checkpoints' tags: 'fh_up'" in text
    assert _ssd_warnings(step, jnp.ones(8)) == []  # traced again: said once
    # Eagerly a checkpoint is all that is seen: a policy none of whose tags it has warns.
    lost = ssd.offload_policy(["fh_upp"], min_bytes=0)
    eager = jax.grad(lambda x: jnp.sum(jax.checkpoint(block, policy=lost)(x)))
    (text,) = _ssd_warnings(eager, jnp.ones(4))
    assert "'fh_upp'" in text and "in no checkpoint" in text, text


def test_policy_tags_spread_over_checkpoints_do_not_warn():
  # One policy over two checkpoints (an attention and an MLP block): each has one of its tags,
  # the program has both: nothing to say. Inside a scan and eagerly too.
  policy = ssd.offload_policy(["fh_attn", "fh_mlp"], min_bytes=0)

  def blocks(x):
    a = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(x * 2, "fh_attn")), policy=policy)
    m = jax.checkpoint(lambda x: jnp.cos(checkpoint_name(x * 3, "fh_mlp")), policy=policy)
    return m(a(x))

  def scanned(x):
    return jnp.sum(jax.lax.scan(lambda c, _: (blocks(c), None), x, None, length=2)[0])

  with ssd.configured(tempfile.mkdtemp(), capacity_bytes=64 << 20):
    assert _ssd_warnings(jax.jit(jax.grad(lambda x: jnp.sum(blocks(x)))), jnp.ones(16)) == []
    assert _ssd_warnings(jax.jit(jax.grad(scanned)), jnp.ones(16)) == []
    assert _ssd_warnings(jax.grad(lambda x: jnp.sum(blocks(x))), jnp.ones(16)) == []


def test_policy_that_offloads_part_of_its_tags_names_the_small_ones():
  policy = ssd.offload_policy(["fh_big", "fh_small"], min_bytes=1024)

  def loss(x, y):
    big = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(x * 2, "fh_big")), policy=policy)
    small = jax.checkpoint(lambda y: jnp.sin(checkpoint_name(y * 2, "fh_small")), policy=policy)
    return jnp.sum(big(x)) + jnp.sum(small(y))

  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  with ssd.configured(tempfile.mkdtemp(), capacity_bytes=64 << 20):
    (text,) = _ssd_warnings(step, jnp.ones(1024), jnp.ones(16))
  assert "offloads only part" in text and "'fh_small' (64 bytes)" in text, text
  assert "min_bytes=1024" in text and "offloaded: tags 'fh_big'" in text


def test_jax_policies_record_and_warn_nothing():
  from jax_ssdtrain._src import remat

  cp = jax.checkpoint_policies
  for policy in (cp.save_only_these_names("fh_none"), cp.nothing_saveable, cp.dots_saveable):
    f = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(jnp.cos(x), "fh_jax")), policy=policy)
    assert _ssd_warnings(jax.jit(jax.grad(lambda x: jnp.sum(f(x)))), jnp.ones(16)) == []
    assert _ssd_warnings(jax.grad(lambda x: jnp.sum(f(x))), jnp.ones(16)) == []
  assert len(remat._programs) == 0


def test_probe_creates_its_directory_and_help_is_plain(tmp_path):
  target = tmp_path / "a" / "b"
  key = disk.Request.make(target, "8MiB", 2, "4MiB", None)
  assert target.is_dir() and oct(target.stat().st_mode & 0o777) == "0o700"
  assert key.directory == str(target)
  proc = subprocess.run(
    [sys.executable, "-m", "jax_ssdtrain.probe", "--help"],
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0 and "``" not in proc.stdout and ":func:" not in proc.stdout


def test_probe_cache_key_is_the_filesystem_not_the_temp_dir():
  # The default store is a new private temp dir each run: its measurement must be found again.
  a, b = tempfile.mkdtemp(prefix="jax_ssdtrain-"), tempfile.mkdtemp(prefix="jax_ssdtrain-")
  ka = disk.Request.make(a, "8MiB", 2, "4MiB", None)
  kb = disk.Request.make(b, "8MiB", 2, "4MiB", None)
  assert ka.cache_key() == kb.cache_key()
  assert ka.cache_key() != disk.Request.make(a, "16MiB", 2, "4MiB", None).cache_key()
  os.rmdir(a)
  os.rmdir(b)
