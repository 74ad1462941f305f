"""Offload planner: profile, timing model, plan, memory-budget mode, split-scan models, CLI."""

import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain import Location
from jax_ssdtrain._src import planner
from jax_ssdtrain._src.planner import simulate

T = ssd.TagProfile
GB = 10**9


def one_tag(read_gbps, write_gbps=1.0, cache=GB, layers=4):
  """A layer of 1 s forward, 1 s backward and one 1 GB tag."""
  return ssd.Profile(
    num_layers=layers,
    forward_s=1.0,
    backward_s=1.0,
    tags=(T("a", GB),),
    write_gbps=write_gbps,
    read_gbps=read_gbps,
    host_cache_bytes=cache,
  )


# --------------------------------------------------------------------------- profile


def _layer(p, x):  # x (B,S,H)
  x = checkpoint_name(x, "layer_in")
  h = checkpoint_name(x @ p["w1"], "up")  # (B,S,F)
  y = checkpoint_name(jnp.tanh(h) @ p["w2"], "down")  # (B,S,H)
  z = checkpoint_name(y * 2.0, "down2")
  return x + z + checkpoint_name(y[..., :3], "down2").sum()  # a name used twice: bytes add


def test_profile_bytes_are_the_tags_avals():
  B, S, H, F = 2, 8, 16, 64
  k = jax.random.split(jax.random.key(0), 3)
  p = {
    "w1": jax.random.normal(k[0], (H, F), jnp.float32),
    "w2": jax.random.normal(k[1], (F, H), jnp.bfloat16).astype(jnp.float32),
  }
  x = jax.random.normal(k[2], (B, S, H), jnp.float32)
  prof = ssd.profile(_layer, p, x, num_layers=3, bandwidth=(2.0, 1.5), repeats=2, warmup=1, batch=B)
  got = {t.name: t.bytes for t in prof.tags}
  assert got == {
    "layer_in": B * S * H * 4,
    "up": B * S * F * 4,
    "down": B * S * H * 4,
    "down2": B * S * H * 4 + B * S * 3 * 4,
  }
  assert [t.name for t in prof.tags] == ["layer_in", "up", "down", "down2"]  # program order
  assert prof.input_bytes == B * S * H * 4 and prof.num_layers == 3 and prof.batch == B
  assert prof.param_bytes == H * F * 4 * 2
  assert (prof.write_gbps, prof.read_gbps) == (2.0, 1.5)
  assert prof.forward_s > 0 and prof.backward_s > 0
  assert prof.input_tag == "layer_in"
  rec = {t.name: t.recompute_s for t in prof.tags}
  # the measured recompute cost (0 where it is below the timing noise) split by FLOP share:
  # "up" and "down" are matmuls of the same FLOPs, the others none
  assert rec["layer_in"] == rec["down2"] == 0 and rec["up"] == pytest.approx(rec["down"])
  assert 0 <= sum(rec.values()) <= prof.forward_s
  half = prof.scaled(1)
  assert {t.name: t.bytes for t in half.tags}["up"] == B * S * F * 4 // 2


def _deep(p, x):  # x (B,S,H): four matmuls on an rms-normed input (no tag on x itself)
  h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
  h = checkpoint_name(h, "normed")
  for i, w in enumerate(p):
    h = checkpoint_name(jnp.tanh(h @ w), f"h{i}")
  return x + h


@pytest.mark.slow
def test_profile_measures_recompute():
  B, S, H = 4, 128, 256
  ks = jax.random.split(jax.random.key(0), 5)
  params = [jax.random.normal(k, (H, H), jnp.float32) / 16 for k in ks[:4]]
  x = jax.random.normal(ks[4], (B, S, H), jnp.float32)
  prof = ssd.profile(_deep, params, x, num_layers=2, bandwidth=(1.0, 1.0), repeats=5, warmup=1)
  assert prof.input_tag is None  # "normed" has the input's shape but is not the input
  rec = {t.name: t.recompute_s for t in prof.tags}
  # what the backward adds with nothing saved (it also skips storing residuals, so on a busy
  # CPU this is anywhere from 0 to a forward), shared by FLOPs: 4 equal matmuls, none before
  # "normed"
  assert rec["normed"] == 0 and 0 <= sum(rec.values()) <= prof.forward_s
  assert rec["h0"] == pytest.approx(rec["h3"]) == pytest.approx(sum(rec.values()) / 4)


def test_profile_follows_the_input_into_nested_calls():
  inner = jax.jit(lambda v: checkpoint_name(v, "layer_in") * 2.0)
  sizes, _, input_tag = planner._tagged(
    lambda p, v: inner(v) @ p, jnp.ones((4, 4)), jnp.ones((2, 4))
  )
  assert sizes == {"layer_in": 32} and input_tag == "layer_in"
  # a name on the input and on another value does not free the input when offloaded
  both = lambda p, v: checkpoint_name(v, "t") + checkpoint_name(v @ p, "t")  # noqa: E731
  assert planner._tagged(both, jnp.ones((4, 4)), jnp.ones((2, 4)))[2] is None


def test_profile_gives_no_tag_the_flops_of_cudnns_attention():
  # Saving the attn tag does not spare cuDNN attention's forward pass (its backward reads the
  # forward's own outputs: tests/test_llama.py counts it), so the tag's share of a layer's
  # recomputation holds none of attention's FLOPs; XLA's attention (dot_generals) keeps its own.
  from _common import fake_flash_attention

  attention, _ = fake_flash_attention()

  def layer(w, x, attend):
    qkv = checkpoint_name(x @ w, "qkv").reshape(x.shape[0], x.shape[1], 3, 2, -1)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return checkpoint_name(attend(q, k, v), "attn").reshape(x.shape)

  def plain(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

  w, x = jnp.ones((16, 48)), jnp.ones((1, 32, 16))
  _, flops, _ = planner._tagged(lambda p, h: layer(p, h, attention), w, x)
  assert flops["qkv"] == 2 * 32 * 16 * 48 and flops["attn"] == 0, flops
  _, flops, _ = planner._tagged(lambda p, h: layer(p, h, plain), w, x)
  assert flops["attn"] == 2 * (2 * 32 * 32 * 2 * 8), flops  # QK^T and PV: 2 S^2 N D each


def test_profile_measures_bandwidth_once_per_directory(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  (tmp_path / "store").mkdir()
  tmp_path = tmp_path / "store"
  w, r = ssd.measured_bandwidth(tmp_path, nbytes=8 << 20)
  assert w > 0 and r > 0
  assert ssd.measured_bandwidth(str(tmp_path) + "/", nbytes=8 << 20) == (w, r)  # cached
  assert os.listdir(tmp_path) == []
  with pytest.raises(ValueError, match="nope"):
    ssd.measured_bandwidth(tmp_path / "nope")


def _small(p, x):  # a small block with several parameter leaves: x (B, H)
  h = checkpoint_name(jnp.tanh(x @ p["w1"] + p["b1"]), "up")  # (B, F)
  y = checkpoint_name(h @ p["w2"] + p["b2"], "down")  # (B, H)
  return x + y * p["scale"] + p["shift"]


def _small_args(B=4, H=16, F=32):
  k = jax.random.split(jax.random.key(2), 3)
  p = {
    "w1": jax.random.normal(k[0], (H, F)) / 4,
    "b1": jnp.zeros(F),
    "w2": jax.random.normal(k[1], (F, H)) / 4,
    "b2": jnp.zeros(H),
    "scale": jnp.ones(H),
    "shift": jnp.zeros(H),
  }
  return p, jax.random.normal(k[2], (B, H))


@pytest.mark.slow  # heavy (a disk probe); the profile's other tests stay in the README's command
def test_profile_measures_the_store_directory_by_default(tmp_path, monkeypatch, capfd):
  # Neither directory= nor bandwidth=: the store's own directory, probed with what a step of
  # this stack could send (16 MiB at least, in tensors of its largest tag: 1 MiB at least).
  from jax_ssdtrain._src.measure import disk

  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  measured, real = [], disk.measure

  def spy(directory, size, **kwargs):
    measured.append((directory, size, kwargs["tensor_bytes"]))
    return real(directory, size, **kwargs)

  monkeypatch.setattr(disk, "measure", spy)
  # The tiny-block case is compile-bound: one program stacks all the parameter leaves per scan
  # length, then four scans (forward, forward+backward, recomputing, one tag in the host tier)
  # at two lengths; nothing per leaf.
  compiles, listening = [], [True]

  def on_event(event, duration, **kwargs):
    if listening[0] and event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)

  p, x = _small_args()
  with ssd.configured(str(tmp_path / "store"), capacity_bytes=64 << 20):
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
      prof = ssd.profile(_small, p, x, num_layers=3, repeats=1, warmup=0, progress=False)
    finally:
      listening[0] = False
  assert measured == [(os.path.realpath(tmp_path / "store"), 16 << 20, 1 << 20)]
  assert prof.write_gbps > 0 and prof.read_gbps > 0
  assert len(compiles) == 2 + 2 * 4, compiles
  assert capfd.readouterr().err == ""  # progress=False
  # sizes for a real stack: 24 layers of 48 MiB of tags (largest 32 MiB) -> the 256 MiB cap
  assert planner._probe_sizes({"a": 32 << 20, "b": 16 << 20}, 24) == (256 << 20, 32 << 20)
  assert planner._probe_sizes({"a": 100 << 20}, 2) == (256 << 20, 64 << 20)
  assert planner._probe_sizes({"a": 3 << 20}, 10) == (32 << 20, 4 << 20)
  with pytest.raises(ValueError, match="bandwidth.*\\(1.0,\\)"):
    ssd.profile(_small, p, x, num_layers=3, bandwidth=(1.0,))
  with pytest.raises(ValueError, match="progress.*'yes'"):
    ssd.profile(_small, p, x, num_layers=3, bandwidth=(1.0, 1.0), progress="yes")


@pytest.mark.slow  # heavy (a full profile)
def test_profile_shows_its_progress(capfd):
  p, x = _small_args()
  ssd.profile(_small, p, x, num_layers=3, bandwidth=(1.0, 1.0), repeats=1, warmup=0, progress=True)
  err = capfd.readouterr().err
  # 10 steps: each scan length's compile, then its four timings
  assert "ssd.profile" in err and "10/10" in err and "timing the forward of 2 layers" in err, err


def test_progress_without_tqdm_prints_a_line_per_step(capfd, monkeypatch):
  monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
  with planner._Progress(2, enabled=True) as bar:
    for what in ("compiling 4 scans of 2 layers", "timing the forward of 2 layers"):
      bar.start(what)
      bar.finish()
  assert capfd.readouterr().err.splitlines() == [
    "ssd.profile [1/2] compiling 4 scans of 2 layers",
    "ssd.profile [2/2] timing the forward of 2 layers",
  ]
  with planner._Progress(2, enabled=None) as bar:  # stderr is no terminal here: nothing shown
    bar.start("compiling")
    bar.finish()
  assert capfd.readouterr().err == ""


# --------------------------------------------------------------------------- timing model, plan


@pytest.mark.parametrize("read_gbps,split", [(1.0, 3), (0.5, 2), (0.2, 1), (0.0, 0)])
def test_plan_split_fits_the_read_window(read_gbps, split):
  # Worked by hand (module docstring model): layer i's write runs from i + 1 to i + 2 s, the
  # forward ends at 4 s, layer i's backward starts at 4 + (3 - i) s; the cache serves the last
  # stored tensor; disk reads start after the writes. 1 GB/s, split 3: writes end at 4, layer 1
  # reads 4..5 (backward at 6), layer 0 5..6 (backward at 7); split 4 would read layer 2 from
  # 5 to 6 for a backward at 5.
  p = ssd.plan(one_tag(read_gbps), max_slowdown=0.0, allowed=["device", "nvme"])
  assert p.offload_layers == split
  assert p.location_map() == {"a": Location.NVME if split else Location.DEVICE} or split == 0
  assert p.stall_s == 0 and p.device_bytes == (4 - split) * GB


def test_one_more_layer_stalls():
  prof = one_tag(0.5)
  compute, stall = simulate(prof, 3, {"a": Location.NVME})
  assert compute == 8.0 and stall == pytest.approx(1.0)  # layer 0's read ends at 8 s, not 7 s


def test_disk_traffic_of_a_step_fits_in_the_step():
  # 8 layers of 0.1 + 0.1 s (1.6 s per step), 1 GB per layer at 1 GB/s, a cache that holds
  # everything (no reads): k layers write k GB per step, so from k = 2 the step waits k - 1.6 s.
  prof = ssd.Profile(
    num_layers=8,
    forward_s=0.1,
    backward_s=0.1,
    tags=(T("a", GB),),
    write_gbps=1.0,
    read_gbps=100.0,
    host_cache_bytes=100 * GB,
  )
  assert simulate(prof, 1, {"a": Location.NVME}) == (pytest.approx(1.6), 0.0)
  assert simulate(prof, 2, {"a": Location.NVME})[1] == pytest.approx(0.4)
  assert simulate(prof, 8, {"a": Location.NVME})[1] == pytest.approx(6.4)
  p = ssd.plan(prof, max_slowdown=0.0, allowed=["device", "nvme"])
  assert p.offload_layers == 1 and p.nvme_bytes <= p.allowed_nvme_bytes


def test_zero_and_infinite_bandwidth():
  tags = (T("layer_in", GB), T("qkv", 3 * GB, 0.1), T("mlp_up", 4 * GB, 0.1))
  base = ssd.Profile(
    num_layers=6,
    forward_s=1.0,
    backward_s=2.0,
    tags=tags,
    write_gbps=0.0,
    read_gbps=0.0,
    host_gbps=0.0,
    input_bytes=GB,
  )
  p = ssd.plan(base, allowed=["device", "host", "nvme"])
  assert p.offloaded_bytes == 0 and p.device_bytes == 8 * 6 * GB
  assert all(loc is Location.DEVICE for _, loc in p.locations)
  inf = dataclasses.replace(
    base, write_gbps=math.inf, read_gbps=math.inf, host_gbps=math.inf, host_cache_bytes=0
  )
  p = ssd.plan(inf, allowed=["device", "nvme"])
  assert p.offload_layers == 6 and p.device_bytes == 0 and p.stall_s == 0
  assert p.nvme_bytes == 8 * 6 * GB and all(loc is Location.NVME for _, loc in p.locations)
  text = str(p)
  for word in ("layer_in", "qkv", "mlp_up", "nvme", "predicted step", "6/6"):
    assert word in text


def test_recompute_only_when_it_fits_the_slowdown():
  prof = ssd.Profile(
    num_layers=2,
    forward_s=1.0,
    backward_s=2.0,
    tags=(T("cheap", GB, 0.01), T("dear", GB, 1.0)),
    write_gbps=0,
    read_gbps=0,
    input_bytes=GB // 2,
  )
  p = ssd.plan(prof, max_slowdown=0.02, allowed=["device", "remat"])
  assert p.location_map() == {"cheap": Location.REMAT, "dear": Location.DEVICE}
  assert p.compute_s == pytest.approx(6.02) and p.device_bytes == 2 * GB + 2 * (GB // 2)
  p = ssd.plan(prof, max_slowdown=1.0, allowed=["device", "remat"])
  assert p.location_map() == {"cheap": Location.REMAT, "dear": Location.REMAT}


def test_offloaded_input_tag_frees_the_input_of_recomputing_layers():
  prof = ssd.Profile(
    num_layers=4,
    forward_s=1.0,
    backward_s=2.0,
    write_gbps=0,
    read_gbps=0,
    tags=(T("x", GB // 4), T("h", GB, 0.5)),
    input_bytes=GB // 4,
    input_tag="x",
    host_gbps=100.0,
    staging_bytes=0,
  )
  remat, host, device = Location.REMAT, Location.HOST, Location.DEVICE
  # the smallest plan: every layer's input to the host, "h" recomputed from the loaded input
  least = ssd.frontier(prof, allowed=["device", "remat", "host"], fixed={"h": "remat"})[-1]
  assert least.offload_layers == 4 and least.location_map() == {"x": host, "h": remat}
  assert least.device_bytes == 0
  p = ssd.plan(prof, max_slowdown=1.0, allowed=["device", "remat"])  # the input stays on device
  assert p.location_map()["h"] is remat and p.device_bytes == GB
  p = planner._evaluate(prof, 3, {"x": host, "h": remat}, 12.0, 0)  # 1 kept layer holds its x
  assert p.device_bytes == GB // 4
  p = planner._evaluate(prof, 4, {"x": device, "h": remat}, 12.0, 0)  # counted once
  assert p.device_bytes == GB
  # a split scan holds the stack's weight gradients twice; an unsplit one does not
  weighty = dataclasses.replace(prof, param_bytes=GB // 8)
  assert (
    planner._evaluate(weighty, 3, {"x": host, "h": remat}, 12.0, 0).device_bytes
    == GB // 4 + GB // 2
  )
  assert planner._evaluate(weighty, 4, {"x": host, "h": remat}, 12.0, 0).device_bytes == 0
  separate = dataclasses.replace(weighty, split_grad_copy=False)  # segments of their own
  assert planner._evaluate(separate, 3, {"x": host, "h": remat}, 12.0, 0).device_bytes == GB // 4
  untagged = dataclasses.replace(prof, input_tag=None)  # x is some other tensor: input saved
  assert planner._evaluate(untagged, 4, {"x": host, "h": remat}, 12.0, 0).device_bytes == GB
  with pytest.raises(ValueError, match="input_tag"):
    dataclasses.replace(prof, input_tag="nope")


def test_each_offloaded_tag_costs_offload_s_per_layer():
  prof = ssd.Profile(
    num_layers=4,
    forward_s=1.0,
    backward_s=2.0,
    write_gbps=0,
    read_gbps=0,
    tags=(T("x", GB), T("h", GB)),
    input_bytes=GB,
    input_tag="x",
    host_gbps=1e9,
    staging_bytes=8 * GB,
    offload_s=0.5,
  )
  host, device = Location.HOST, Location.DEVICE
  assert simulate(prof, 2, {"x": host, "h": device}) == (pytest.approx(13.0), 0.0)
  assert simulate(prof, 2, {"x": host, "h": host}) == (pytest.approx(14.0), 0.0)
  assert simulate(prof, 0, {"x": host, "h": host}) == (pytest.approx(12.0), 0.0)
  assert dataclasses.replace(prof, batch=1).scaled(4).offload_s == 0.5  # per call, not per byte


def test_memory_budget_compiles_the_smallest_of_equally_fast_plans():
  # a fast host link: every split of "a" to the host is predicted within 0.1% of the others
  base = ssd.Profile(
    num_layers=8,
    forward_s=1.0,
    backward_s=2.0,
    batch=1,
    tags=(T("a", GB, 0.5),),
    write_gbps=0,
    read_gbps=0,
    host_gbps=1e6,
    staging_bytes=0,
    offload_s=1e-3,
  )
  first = []

  def memory(batch, plan):
    first.append(plan.offload_layers)
    return plan.device_bytes

  p = ssd.plan_for_budget(8 * GB, [1], lambda b: base, memory, allowed=["device", "host"])
  assert first == [8] and p.offload_layers == 8 and p.device_bytes == 0  # least memory
  first.clear()
  p = ssd.plan_for_budget(
    8 * GB, [1], lambda b: base, memory, allowed=["device", "host"], tolerance=0.0
  )
  assert first == [0] and p.offload_layers == 0  # the fastest: nothing offloaded
  with pytest.raises(ValueError, match="tolerance"):
    ssd.plan_for_budget(GB, [1], lambda b: base, memory, tolerance=-1)


def test_outside_time_scales_with_the_batch_but_the_update_does_not():
  prof = ssd.Profile(
    num_layers=2,
    forward_s=1.0,
    backward_s=2.0,
    tags=(T("a", GB, 0.5),),
    write_gbps=0,
    read_gbps=0,
    other_s=0.5,
    update_s=0.25,
    batch=4,
  )
  assert ssd.plan(prof, allowed=["device"]).step_s == pytest.approx(6.75)
  half = prof.scaled(2)
  assert (half.other_s, half.update_s) == (pytest.approx(0.25), 0.25)
  assert ssd.plan(half, allowed=["device"]).step_s == pytest.approx(3.5)
  with pytest.raises(ValueError, match="update_s"):
    dataclasses.replace(prof, update_s=-1.0)


@pytest.mark.parametrize("host_gbps,split", [(1.0, 4), (0.5, 1)])
def test_host_tier_is_pcie_bound(host_gbps, split):
  # by hand, 1 GB per layer, F = B = 1 s, 1 GB of staging: the device-to-host copy of layer i
  # ends at max(i + 1, previous) + 1/host_gbps and a store waits while more than 1 GB is not
  # copied yet. At 1 GB/s the copies keep pace (all 4 layers offload); at 0.5 GB/s the second
  # layer's store waits, so only the first offloads (its load comes from staging).
  prof = ssd.Profile(
    num_layers=4,
    forward_s=1.0,
    backward_s=1.0,
    tags=(T("a", GB, 1.0),),
    write_gbps=0,
    read_gbps=0,
    host_gbps=host_gbps,
    staging_bytes=GB,
  )
  p = ssd.plan(prof, max_slowdown=0.0)
  assert p.location_map() == {"a": Location.HOST} and p.offload_layers == split
  assert p.host_bytes == split * GB and p.nvme_bytes == 0
  assert simulate(prof, split, {"a": Location.HOST})[1] == 0
  if split < prof.num_layers:
    assert simulate(prof, split + 1, {"a": Location.HOST})[1] > 0


def test_plan_sizes_its_staging_arena_from_the_bytes_and_the_forward_time():
  # by hand: 4 layers of 1 GB to the host at 5 GB/s, F = 0.1 s, B = 1 s. The forward produces
  # 4 GB in 0.4 s while the link drains 2 GB: the copy of layer 3 ends at 0.9 s, and its store
  # (at 0.4 s) must find 0.9 - 0.4 = 0.5 s of copies, 2.5 GB, waiting in staging. Less arena
  # stalls the forward; more buys nothing. The plan takes the smallest arena within
  # STAGING_TOLERANCE of the configured 8 GB one's step (0.2% of ~4.4 s: up to ~44 MB less).
  mib = 1 << 20
  prof = ssd.Profile(
    num_layers=4,
    forward_s=0.1,
    backward_s=1.0,
    tags=(T("a", GB, 0.0),),
    write_gbps=0,
    read_gbps=0,
    host_gbps=5.0,
    staging_bytes=8 * GB,
  )
  p = planner._evaluate(prof, 4, {"a": Location.HOST}, 4.4, 0)
  assert 2.5 * GB - 50 * 10**6 <= p.staging_bytes <= 2.5 * GB + mib and p.staging_bytes % mib == 0
  assert p.step_s <= simulate(prof, 4, {"a": Location.HOST})[0] * (
    1 + planner.STAGING_TOLERANCE
  ) + simulate(prof, 4, {"a": Location.HOST})[1] * (1 + planner.STAGING_TOLERANCE)
  assert (
    sum(simulate(dataclasses.replace(prof, staging_bytes=GB), 4, {"a": Location.HOST}))
    > p.step_s * 1.05
  )  # a 1 GB arena stalls the forward
  assert p.store_options() == {"staging_bytes": p.staging_bytes}
  assert "staging arena" in p.table()
  # a link that keeps pace needs only room for two tensors; a plan offloading nothing, none
  fast = planner._evaluate(
    dataclasses.replace(prof, host_gbps=100.0), 4, {"a": Location.HOST}, 4.4, 0
  )
  assert fast.staging_bytes == -(-2 * GB // mib) * mib
  kept = planner._evaluate(prof, 0, {"a": Location.HOST}, 4.4, 0)
  assert kept.staging_bytes == 0 and kept.store_options() == {}
  # never above the configured arena
  tight = dataclasses.replace(prof, staging_bytes=GB)
  assert planner._evaluate(tight, 4, {"a": Location.HOST}, 4.4, 0).staging_bytes == GB


def test_profile_measures_the_link_only_on_a_gpu(monkeypatch):
  from jax_ssdtrain._src.measure import link

  calls = []
  monkeypatch.setattr(link, "measure_link", lambda *a, **k: calls.append(a) or None)
  if not any(d.platform == "gpu" for d in jax.local_devices()):
    assert planner.measured_link_gbps() == planner.DEFAULT_HOST_GBPS and not calls


def test_host_tier_staging_absorbs_the_backlog_and_serves_the_last_layers():
  # by hand, 2 layers of 1 GB at 1 GB/s, F = B = 1 s. Without staging: each store waits for its
  # device-to-host copy (forward ends at 4 instead of 2) and each backward for its
  # host-to-device copy (+1 s). With 1 GB of staging: the copy of layer 0 runs during layer 1,
  # layer 1 is loaded from staging, layer 0's read runs during layer 1's backward: no stall.
  def stall(staging):
    prof = ssd.Profile(
      num_layers=2,
      forward_s=1.0,
      backward_s=1.0,
      tags=(T("a", GB, 1.0),),
      write_gbps=0,
      read_gbps=0,
      host_gbps=1.0,
      staging_bytes=staging,
    )
    return simulate(prof, 2, {"a": Location.HOST})[1]

  assert stall(0) == pytest.approx(3.0)
  assert stall(GB) == pytest.approx(0.0)
  with pytest.raises(ValueError, match="staging_bytes"):
    ssd.Profile(
      num_layers=2,
      forward_s=1.0,
      backward_s=1.0,
      tags=(),
      write_gbps=0,
      read_gbps=0,
      staging_bytes=-1,
    )


def test_host_tensors_of_a_step_fit_the_host_tier():
  # 1 GB per layer to the host tier, PCIe fast enough for all 8 layers; a 3 GB host tier holds
  # 3 layers' tensors (the engine keeps them until their loads), so the plan stops at 3.
  prof = ssd.Profile(
    num_layers=8,
    forward_s=1.0,
    backward_s=1.0,
    tags=(T("a", GB, 1.0),),
    write_gbps=0,
    read_gbps=0,
    host_gbps=100.0,
    host_tier_bytes=3 * GB,
  )
  p = ssd.plan(prof, max_slowdown=0.0, allowed=("device", "host"))
  assert p.location_map() == {"a": Location.HOST} and p.offload_layers == 3
  assert p.host_bytes == 3 * GB
  roomy = ssd.plan(
    dataclasses.replace(prof, host_tier_bytes=8 * GB), max_slowdown=0.0, allowed=("device", "host")
  )
  assert roomy.offload_layers == 8
  with pytest.raises(ValueError, match="host_tier_bytes"):
    dataclasses.replace(prof, host_tier_bytes=-1)


def test_policies_follow_the_plan():
  from jax_ssdtrain._src.policies import StoreDecision, name_p

  p = ssd.plan(one_tag(0.5), max_slowdown=0.0, allowed=["device", "nvme"])
  assert p.offload_layers == 2
  first, rest = p.policies()  # (layers 0..offload_layers-1, the others): the documented order
  assert dict(first.locations) == {"a": Location.NVME}
  assert dict(rest.locations) == {"a": Location.DEVICE}
  assert first == ssd.location_policy(p.location_map(), min_bytes=p.min_bytes)
  assert rest == ssd.location_policy(p.kept_location_map(), min_bytes=p.min_bytes)
  # what jax.checkpoint hears about the 1 GB tag "a": the store, then saved on the device
  big = jax.core.ShapedArray((GB // 4,), jnp.float32)
  assert first(name_p, big, name="a") == StoreDecision(Location.NVME)
  assert rest(name_p, big, name="a") is True


def _split_of(plan):
  return next(line for line in plan.table().splitlines() if line.startswith("split:"))


def test_table_says_what_each_layer_does_with_its_tags():
  two = ssd.Profile(
    num_layers=4,
    forward_s=1.0,
    backward_s=1.0,
    tags=(T("up", GB), T("act", GB)),
    write_gbps=1.0,
    read_gbps=0.5,
    host_gbps=0.5,
  )
  # nothing goes to the store (all recomputed, or all on the device): no layer keeps anything
  for allowed in (["remat"], ["device"]):
    line = _split_of(ssd.plan(two, allowed=allowed))
    assert line == "split: none (no tag goes to the store; all 4 layers alike)", line
  p = ssd.plan(two, max_slowdown=0.0, fixed={"up": "host", "act": "nvme"})
  assert p.offload_layers == 1
  assert _split_of(p) == (
    "split: layer 0 sends act, up to the store, layers 1..3 keep them on the device"
  )
  with_k = lambda k: _split_of(dataclasses.replace(p, offload_layers=k))  # noqa: E731
  assert (
    with_k(2) == "split: layers 0..1 send act, up to the store, layers 2..3 keep them on the device"
  )
  assert (
    with_k(3) == "split: layers 0..2 send act, up to the store, layer 3 keeps them on the device"
  )
  assert with_k(4) == (
    "split: none (every layer sends act, up to the store; no layer keeps them on the device)"
  )
  assert with_k(0) == (
    "split: none (no layer sends act, up to the store; every layer keeps them on the device)"
  )
  fast = ssd.plan(one_tag(100.0, write_gbps=100.0), allowed=["nvme"])
  assert (fast.offload_layers, _split_of(fast)) == (
    4,
    "split: none (every layer sends a to the store; no layer keeps it on the device)",
  )


def _block(p, x):  # a hand-written layer: x (B, H), p {"w1": (H, F), "w2": (F, H)}
  up = checkpoint_name(x @ p["w1"], "up")
  act = checkpoint_name(jnp.sin(up), "act")
  return x + jnp.tanh(act @ p["w2"])


def _stacked_block_params(L, H=32, F=64):
  k1, k2 = jax.random.split(jax.random.key(3))
  return {
    "w1": jax.random.normal(k1, (L, H, F), jnp.float32) / 8,
    "w2": jax.random.normal(k2, (L, F, H), jnp.float32) / 8,
  }


def test_plan_scan_runs_a_hand_written_stack_as_planned(tmp_path):
  L, B, H = 4, 8, 32
  params, x = _stacked_block_params(L, H), jax.random.normal(jax.random.key(4), (B, H))
  prof = ssd.Profile(
    num_layers=L,
    forward_s=1.0,
    backward_s=1.0,
    tags=(T("up", GB), T("act", GB)),
    write_gbps=1.0,
    read_gbps=1.0,
    host_gbps=1.0,
  )
  plan = ssd.plan(prof, max_slowdown=0.0, fixed={"up": "host", "act": "nvme"}, min_bytes=0)
  k = plan.offload_layers
  assert 0 < k < L, plan

  def device_saving(ps, v):  # the same stack, every tag saved on the device
    body = jax.checkpoint(_block, policy=jax.checkpoint_policies.save_only_these_names("up", "act"))
    return jax.lax.scan(lambda h, p: (body(p, h), None), v, ps)[0].sum()

  def own_scan(ps, v):  # the recipe for a scan of one's own: policies()[0] first, then [1]
    offloading, keeping = plan.policies()
    h = v
    for policy, seg in ((offloading, slice(0, k)), (keeping, slice(k, L))):
      body = jax.checkpoint(_block, policy=policy, prevent_cse=False)
      seg_params = jax.tree.map(lambda a: a[seg], ps)
      h = jax.lax.scan(lambda c, p: (body(p, c), None), h, seg_params)[0]
    return h.sum()

  want = jax.jit(jax.value_and_grad(device_saving, argnums=(0, 1)))(params, x)
  with ssd.configured(str(tmp_path / "store"), capacity_bytes=64 << 20, host_tier_bytes=8 << 20):
    for fn in (lambda ps, v: plan.scan(_block, ps, v).sum(), own_scan):
      ssd.reset_stats()
      got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(params, x)
      ssd.flush()
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      # the first k layers store "up" (host) and "act" (nvme); the others keep them
      assert ssd.stats()["tensors_written"] == 2 * k
  with pytest.raises(ValueError, match="num_layers=4.*\\(3, 32, 64\\)"):
    plan.scan(_block, jax.tree.map(lambda a: a[:3], params), x)


def test_split_scan_is_the_one_split_scan():
  # The first k layers under one policy, the rest under the other, in two scans (one where a
  # segment is empty), from stacked parameters or from split_layers' segments: the values and
  # gradients of one plain scan, bit for bit, whatever the policies (None: no jax.checkpoint).
  L, B, H = 4, 8, 32
  params, x = _stacked_block_params(L, H), jax.random.normal(jax.random.key(4), (B, H))
  saving = jax.checkpoint_policies.save_only_these_names("up")

  def plain(ps, v):
    return jax.lax.scan(lambda h, p: (_block(p, h), None), v, ps)[0].sum()

  want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(params, x)
  for k in (0, 1, L):  # the empty first segment, a split inside the stack, the empty rest
    for policies in ((None, saving), (saving, jax.checkpoint_policies.nothing_saveable)):
      stacked = lambda ps, v: ssd.split_scan(_block, ps, v, split=k, policies=policies).sum()
      got = jax.jit(jax.value_and_grad(stacked, argnums=(0, 1)))(params, x)
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      segments = ssd.split_layers(params, k)
      assert (segments[0] is None) == (k == 0) and (segments[1] is None) == (k == L)
      presplit = lambda segs, v: ssd.split_scan(_block, segs, v, split=None, policies=policies)
      value, dx = jax.jit(jax.value_and_grad(lambda segs, v: presplit(segs, v).sum(), argnums=1))(
        segments, x
      )
      np.testing.assert_array_equal(np.asarray(want[0]), np.asarray(value))
      np.testing.assert_array_equal(np.asarray(want[1][1]), np.asarray(dx))
  # a jaxpr of two scans where the split is inside the stack, one at its ends
  scans = lambda k: str(
    jax.make_jaxpr(lambda ps: ssd.split_scan(_block, ps, x, split=k, policies=(None, None)))(params)
  ).count("scan[")
  assert (scans(0), scans(2), scans(L)) == (1, 2, 1)
  with pytest.raises(ValueError, match="split: 5 layers > the 4 stacked layers"):
    ssd.split_layers(params, 5)
  with pytest.raises(ValueError, match="split: expected an integer >= 0, got -1"):
    ssd.split_scan(_block, params, x, split=-1, policies=(None, None))
  with pytest.raises(ValueError, match="expected \\(first, rest\\), got 1"):
    ssd.split_scan(_block, params, x, split=1, policies=(None,))


# choose_placement's placement of a dense model's optimizer state: tests/test_planner_placement.py


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda: ssd.plan(one_tag(1.0), max_slowdown=-0.1), "max_slowdown.*-0.1"),
    (lambda: ssd.plan(one_tag(1.0), fixed={"nope": "nvme"}), "unknown tag 'nope'"),
    (lambda: ssd.plan(one_tag(1.0), fixed={"a": "disk"}), "unknown location 'disk'"),
    (lambda: ssd.plan(one_tag(1.0), allowed=["ssd"]), "unknown location 'ssd'"),
    (lambda: ssd.plan(one_tag(1.0), allowed=["nvme"], fixed={"a": "nvme"}, min_bytes=2 * GB), None),
    (lambda: one_tag(-1.0), "read_gbps.*-1.0"),
    (lambda: one_tag(1.0, layers=0), "num_layers.*0"),
    (lambda: one_tag(1.0, cache=-5), "host_cache_bytes.*-5"),
    (
      lambda: ssd.plan_for_budget(-3, [1], lambda b: one_tag(1.0), lambda b, p: 0),
      "budget_bytes.*-3",
    ),
    (lambda: ssd.plan_for_budget(GB, [0], lambda b: one_tag(1.0), lambda b, p: 0), "batches.*0"),
    (lambda: one_tag(1.0).scaled(2), "no batch size"),
  ],
)
def test_bad_inputs_raise_value_error(call, match):
  if match is None:  # a tag below min_bytes cannot be offloaded: it stays on the device
    assert call().location_map() == {"a": Location.DEVICE}
    return
  with pytest.raises(ValueError, match=match):
    call()


# --------------------------------------------------------------------------- memory budget


def test_memory_budget_picks_the_fastest_batch_that_fits():
  base = ssd.Profile(
    num_layers=4,
    forward_s=1.0,
    backward_s=1.0,
    batch=4,
    tags=(T("a", GB, 0.5), T("b", 2 * GB, 0.1)),
    write_gbps=1.0,
    read_gbps=0.5,
    host_gbps=0.0,
    host_cache_bytes=GB,
    input_bytes=GB // 4,
  )
  calls = []

  def memory(batch, plan):  # fake XLA: 1 GB of parameters + the plan's residuals
    calls.append(batch)
    return GB + plan.device_bytes

  def brute_force(budget):
    fits = [
      (b / p.step_s, b, p)
      for b in (1, 2, 4, 8)
      for p in ssd.frontier(base.scaled(b))
      if GB + p.device_bytes <= budget
    ]
    return max(fits, key=lambda t: t[:2])

  picked = []
  for budget in (40 * GB, 20 * GB, 8 * GB, 5 * GB):
    calls.clear()
    p = ssd.plan_for_budget(budget, [1, 2, 4, 8], base.scaled, memory, max_compiles=100)
    tps, batch, want = brute_force(budget)
    assert p.profile.batch == batch and p.step_s == want.step_s
    assert p.measured_device_bytes == GB + p.device_bytes <= budget
    assert min(calls) == batch  # smaller batches are not compiled
    picked.append(batch)
  assert picked == [8, 4, 2, 1]
  assert ssd.plan_for_budget(200 * GB, [1, 2, 8], base.scaled, memory).profile.batch == 8
  with pytest.raises(ValueError, match="no batch"):
    ssd.plan_for_budget(GB // 2, [1, 2], base.scaled, memory)


@pytest.mark.slow
def test_memory_budget_with_real_compiles():
  from scripts import training

  run = training.RunConfig(preset="tiny", batch=4, min_bytes=0)
  prof = training.profile_run(run, bandwidth=(math.inf, math.inf), repeats=1)
  assert prof.input_tag == "layer_in"  # found through flax's calls

  def memory(batch, plan):
    return training.step_memory_bytes(
      training.apply_plan(dataclasses.replace(run, batch=batch), plan)
    )

  sizes = {b: memory(b, ssd.plan(prof.scaled(b), min_bytes=0)) for b in (2, 4)}
  assert sizes[2] < sizes[4]
  budget = (sizes[2] + sizes[4]) // 2
  p = ssd.plan_for_budget(budget, [1, 2, 4], prof.scaled, memory, min_bytes=0)
  assert p.profile.batch == 2 and p.measured_device_bytes == memory(2, p) <= budget


# --------------------------------------------------------------------------- split-scan models


@pytest.mark.slow
def test_split_scan_identical_to_unsplit():
  import models
  from scripts import training

  run = training.RunConfig(
    preset="tiny",
    batch=2,
    min_bytes=0,
    model_overrides={"num_layers": 4},
    locations={"layer_in": "nvme", "qkv": "device", "attn": "remat", "mlp_up": "host"},
  )
  policy = run.remat_policy_object()
  cfg = run.model_config()
  whole = models.build_model("gpt", cfg, policy)
  tok = jax.random.randint(jax.random.key(0), (2, 33), 0, cfg.vocab_size)
  params = whole.init(jax.random.key(1), tok, method="loss")["params"]
  grads = lambda m: jax.jit(
    jax.value_and_grad(  # noqa: E731
      lambda p: m.apply({"params": p}, tok, method="loss")[0]
    )
  )(params)
  ref = grads(whole)
  for k in (1, 3):
    split = models.build_model("gpt", cfg, models.SplitPolicy(policy, policy, k))
    split_params = split.init(jax.random.key(1), tok, method="loss")["params"]
    assert jax.tree.structure(split_params) == jax.tree.structure(params)  # same layout
    got = grads(split)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # a run with a split: first layers offload, the rest keep those tags on the device
  two = dataclasses.replace(run, offload_layers=2).remat_policy_object()
  assert two.split == 2
  assert dict(two.first.locations)["mlp_up"] is Location.HOST
  assert dict(two.rest.locations)["mlp_up"] is Location.DEVICE
  with pytest.raises(ValueError, match="split.*-1"):
    models.SplitPolicy(policy, policy, -1)


# --------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_train_policy_auto(tmp_path, capsys, monkeypatch):
  from scripts import train, training

  profiled = []
  real = training.profile_run

  def profile_run(run, **kw):
    profiled.append((run.batch, kw.get("outside_layers", True)))
    return real(run, **kw)

  monkeypatch.setattr(training, "profile_run", profile_run)
  out = train.main(
    [
      "--preset",
      "tiny",
      "--batch",
      "4",
      "--steps",
      "3",
      "--policy",
      "auto",
      "--bandwidth",
      "100,100",
      "--store-dir",
      str(tmp_path / "st"),
      "--memory-budget",
      "1GB",
    ]
  )
  text = capsys.readouterr().out
  assert "predicted step" in text and "device memory of the step (XLA)" in text
  assert out["steps"] == 3 and np.isfinite(out["final_loss"])
  # each candidate batch has a profile of its own (the layers only, beside the run's batch)
  assert profiled == [(4, True), (2, False), (1, False)]


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--memory-budget", "-1GB"], "memory-budget"),
    (["--memory-budget", "1GB"], "needs --policy auto"),
    (["--policy", "auto", "--bandwidth", "1"], "WRITE,READ"),
    (["--policy", "auto", "--max-slowdown", "-1"], "max-slowdown"),
  ],
)
def test_train_policy_auto_errors(flags, message, capsys):
  from scripts import train

  with pytest.raises(SystemExit):
    train.main(["--steps", "1"] + flags)
  assert message in capsys.readouterr().err


def test_host_nvme_is_not_a_tier_the_planner_models():
  prof = dataclasses.replace(one_tag(1.0), host_gbps=1.0)
  everything = ssd.plan(prof, max_slowdown=1.0, allowed=tuple(ssd.Location), min_bytes=0)
  assert everything == ssd.plan(prof, max_slowdown=1.0, min_bytes=0)
  assert all(loc is not ssd.Location.HOST_NVME for _, loc in everything.locations)
  with pytest.raises(ValueError, match="fixed: the planner .* does not model 'host,nvme'"):
    ssd.plan(prof, fixed={"a": "host,nvme"}, min_bytes=0)
  with pytest.raises(ValueError, match="allowed: expected at least one of"):
    ssd.plan(prof, allowed=("host,nvme",), min_bytes=0)


def test_median_time_runs_warmup_then_repeats():
  # The timer ssd.profile and scripts.training share.
  from jax_ssdtrain._src.measure.timing import median_time

  calls = []
  t = median_time(lambda: calls.append(1) or jnp.ones(3), repeats=3, warmup=2)
  assert len(calls) == 2 + 1 + 3 and t >= 0
