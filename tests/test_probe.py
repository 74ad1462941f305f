"""The store's bandwidth cap (emulated arrays) and the probe (python -m jax_ssdtrain.probe)."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _limits import HANG_S

import jax_ssdtrain as ssd
from jax_ssdtrain import probe
from jax_ssdtrain._src import native, options
from jax_ssdtrain._src.config import parse_bandwidth
from jax_ssdtrain._src.measure import disk

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
  home = tmp_path / "xdg"
  monkeypatch.setenv("XDG_CACHE_HOME", str(home))
  return home


def _cli(*args, env=None, timeout=HANG_S):
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run(
    [sys.executable, "-m", "jax_ssdtrain.probe", *map(str, args)],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
  )


# ---------------------------------------------------------------------------------------------
# bandwidth_cap


@pytest.mark.parametrize("cap", [None, "100MB/s"])
def test_bandwidth_cap_is_honoured_both_ways(tmp_path, cap):
  rate = 100e6
  n, size = 4, 8 * MiB  # 32 MiB each way: 0.34 s at the cap
  src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
  dst = np.zeros_like(src)
  with ssd.configured(
    tmp_path / "store",
    capacity_bytes="256MiB",
    host_cache_bytes="16MiB",
    chunk_bytes="1MiB",
    io_threads=4,
    forwarding=False,
    bandwidth_cap=cap,
  ):
    ssd.reset_stats()
    t0 = time.perf_counter()
    handles = [native.store_host(src.ctypes.data, size, i) for i in range(n)]
    ssd.flush()
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in reversed(range(n)):
      dst[:] = 0
      native.load_host(handles[i], dst.ctypes.data, size, i)
      assert np.array_equal(src, dst)
    t_read = time.perf_counter() - t0
    s = ssd.stats()
  assert s["disk_bytes_written"] == s["disk_bytes_read"] == n * size
  if cap is None:
    assert s["bandwidth_cap"] == 0 and s["throttle_write_seconds"] == 0
    return
  assert s["bandwidth_cap"] == rate
  least = 0.95 * n * size / rate  # no transfer ends before its share of the cap's timeline
  assert t_write >= least and t_read >= least, (t_write, t_read)
  assert s["write_seconds"] >= least and s["read_seconds"] >= least, s
  assert s["throttle_write_seconds"] > 0 and s["throttle_read_seconds"] > 0


def test_bandwidth_cap_values(tmp_path, monkeypatch):
  parse = parse_bandwidth
  assert parse("7GB/s", what="x") == 7_000_000_000
  assert parse("512MiB/s", what="x") == 512 * MiB
  assert parse(14e9, what="x") == 14_000_000_000
  assert parse("off", what="x") is None and parse(None, what="x") is None
  for bad in ("fast", "7GB/h", -1, 0, "0GB/s", math.inf, math.nan, True):
    with pytest.raises(ValueError, match="bandwidth_cap"):
      ssd.configure(tmp_path, bandwidth_cap=bad)
  with ssd.configured(tmp_path, bandwidth_cap="28GB/s") as cfg:
    assert cfg.bandwidth_cap == 28_000_000_000
    assert ssd.stats()["bandwidth_cap"] == 28_000_000_000
  monkeypatch.setenv("SSDTRAIN_BANDWIDTH_CAP", "14GB/s")
  assert ssd.default_config().bandwidth_cap == 14_000_000_000
  monkeypatch.setenv("SSDTRAIN_BANDWIDTH_CAP", "quick")
  with pytest.raises(ValueError, match="SSDTRAIN_BANDWIDTH_CAP.*quick"):
    ssd.default_config()
  with pytest.raises(ValueError, match="bandwidth_cap.*-5"):  # the engine checks it too
    sent = options.engine_options(ssd.StoreConfig(capacity_bytes=1 << 30), (str(tmp_path),))
    native.configure({**sent, "bandwidth_cap": -5})


# ---------------------------------------------------------------------------------------------
# measure()


def test_measure_through_the_engine_is_cached_per_filesystem(tmp_path, cache_home):
  store = tmp_path / "store"
  store.mkdir()
  kw = dict(threads=2, tensor_bytes="4MiB", bandwidth_cap="100MB/s")
  r = probe.measure(store, "32MiB", raw=True, **kw)
  assert r.directory == os.path.realpath(store) and r.device == os.stat(store).st_dev
  assert (r.size, r.threads, r.tensor_bytes, r.bandwidth_cap) == (32 * MiB, 2, 4 * MiB, 10**8)
  assert not r.cached and r.backend == "posix"
  assert 0 < r.write_gbps <= 0.1 * 1.02 and 0 < r.read_gbps <= 0.1 * 1.02  # the cap holds
  assert 0 < r.engine_write_gbps <= 0.1 * 1.02 and 0 < r.engine_read_gbps <= 0.1 * 1.02
  assert r.raw_write_gbps > 0 and r.raw_read_gbps > 0 and r.raw_o_direct in (True, False)
  assert os.listdir(store) == []  # unlinked files only

  again = probe.measure(str(store) + "/", "32MiB", **kw)  # same real path: from the cache
  assert again.cached and again.write_gbps == r.write_gbps
  doc = json.loads((cache_home / "jax_ssdtrain" / "probe.json").read_text())
  # keyed by the filesystem (mount point and device): every directory on it shares the key
  assert len(doc) == 1 and next(iter(doc)).startswith(
    f"{disk.mount_point(r.directory)}|dev={r.device}|"
  )
  fresh = probe.measure(store, "32MiB", refresh=True, **kw)
  assert not fresh.cached and fresh.measured_at > r.measured_at


def test_measure_striped_over_files(tmp_path, cache_home):
  store = tmp_path / "store"
  store.mkdir()
  r = probe.measure(store, "16MiB", threads=2, tensor_bytes="1MiB", stripes=3)
  assert r.stripes == 3 and r.size == 16 * MiB and r.write_gbps > 0 and r.read_gbps > 0
  assert os.listdir(store) == []  # the stripe<i> subdirectories it made are gone
  one = probe.measure(store, "16MiB", threads=2, tensor_bytes="1MiB")  # another cache key
  assert one.stripes == 1 and not one.cached
  assert probe.measure(store, "16MiB", threads=2, tensor_bytes="1MiB", stripes=3).cached
  with pytest.raises(ValueError, match="stripes.*0"):
    probe.measure(store, "16MiB", tensor_bytes="1MiB", stripes=0)


def test_measure_errors_name_the_bad_value(tmp_path, cache_home):
  (tmp_path / "f").write_text("x")
  with pytest.raises(OSError, match="'.*f/nowhere' cannot be created"):  # below a file
    probe.measure(tmp_path / "f" / "nowhere")
  with pytest.raises(NotADirectoryError, match="'.*f' is not a directory"):
    probe.measure(tmp_path / "f")
  with pytest.raises(ValueError, match="size.*'lots'"):
    probe.measure(tmp_path, "lots")
  with pytest.raises(ValueError, match="threads.*0"):
    probe.measure(tmp_path, "64MiB", threads=0)
  with pytest.raises(ValueError, match="tensor_bytes.*1000"):
    probe.measure(tmp_path, "64MiB", tensor_bytes=1000)
  with pytest.raises(ValueError, match="free"):
    probe.measure(tmp_path, "1000TB")
  with pytest.raises(ValueError, match="bandwidth_cap.*'slow'"):
    probe.measure(tmp_path, "64MiB", bandwidth_cap="slow")


# ---------------------------------------------------------------------------------------------
# recommend() and wear()


def _result(threads, w, r, **kw):
  return probe.ProbeResult(
    directory="/d",
    device=1,
    size=1 << 30,
    threads=threads,
    tensor_bytes=64 * MiB,
    bandwidth_cap=None,
    write_gbps=w,
    read_gbps=r,
    engine_write_gbps=w,
    engine_read_gbps=r,
    o_direct=True,
    backend="posix",
    **kw,
  )


def test_recommend():
  results = [_result(4, 2.0, 1.0), _result(8, 2.5, 1.6), _result(16, 2.6, 1.62)]
  rec = probe.recommend(results, step_ms=150, bytes_per_step=int(1e9))
  assert rec.io_threads == 8  # fewest threads within 5% of the best slower direction
  fit = 0.15 / (1 / 2.5e9 + 1 / 1.6e9)
  assert rec.fit_bytes_per_step == int(fit)
  assert rec.host_tier_bytes >= 1e9 - fit and rec.host_tier_bytes - (1e9 - fit) < MiB
  assert rec.host_cache_bytes >= 1e9 - 2.5e9 * 0.05 and rec.staging_bytes == 256 * MiB
  assert any("host tier" in n for n in rec.notes)
  small = probe.recommend(results, step_ms=150, bytes_per_step=int(1e8))
  assert small.host_tier_bytes == 0 and not any("host tier" in n for n in small.notes)
  assert probe.recommend(results).fit_bytes_per_step is None
  with pytest.raises(ValueError, match="no probe results"):
    probe.recommend([])


def test_wear():
  w = probe.wear(int(2e9), step_ms=200, tbw=1200)
  assert w.steps_per_day == pytest.approx(432_000)
  assert w.tb_per_day == pytest.approx(864.0)
  assert w.days_to_rated == pytest.approx(1200 / 864)
  d = probe.wear(
    int(1e9), steps_per_day=1000, dwpd=1, capacity_bytes=int(3.84e12), warranty_years=5
  )
  assert d.tb_per_day == pytest.approx(1.0) and d.rated_tbw == pytest.approx(3.84 * 365 * 5)
  assert d.drive_writes_per_day == pytest.approx(1 / 3.84)
  assert probe.wear(0, step_ms=100, tbw=10).days_to_rated == math.inf
  with pytest.raises(ValueError, match="step_ms.*-1"):
    probe.wear(10, step_ms=-1)
  with pytest.raises(ValueError, match="dwpd.*capacity"):
    probe.wear(10, step_ms=1, dwpd=1)
  with pytest.raises(ValueError, match="not both"):
    probe.wear(10, step_ms=1, dwpd=1, tbw=5, capacity_bytes=10)


# ---------------------------------------------------------------------------------------------
# the command line


def test_cli_json_table_and_plan(tmp_path, cache_home):
  env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
  common = ["--size", "16MiB", "--tensor-size", "4MiB", "--threads", "1,2"]
  proc = _cli(
    tmp_path,
    *common,
    "--step-ms",
    "100",
    "--bytes-per-step",
    "1GB",
    "--tbw",
    "600",
    "--json",
    env=env,
  )
  assert proc.returncode == 0, proc.stderr
  doc = json.loads(proc.stdout)
  assert [r["threads"] for r in doc["results"]] == [1, 2]
  assert all(r["write_gbps"] > 0 and r["raw_read_gbps"] > 0 for r in doc["results"])
  assert doc["recommendation"]["io_threads"] in (1, 2)
  assert doc["wear"]["tb_per_day"] == pytest.approx(864.0)
  assert doc["wear"]["days_to_rated"] == pytest.approx(600 / 864)

  plan = tmp_path / "plan.json"
  plan.write_text(
    json.dumps({"summary": {"disk_bytes_written_per_step": 5e8, "predicted_step_ms": 200.0}})
  )
  proc = _cli(tmp_path, *common, "--plan", plan, "--dwpd", "1", "--capacity", "2TB", env=env)
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert "recommended settings" in out and "io_threads" in out and "SSD wear" in out
  assert "0.500 GB written per step x 432,000 steps/day = 216.00 TB/day" in out
  assert "3,650 TBW reached in 17 days" in out
  assert out.count("yes") == 2  # both thread counts from the cache


def test_cli_errors(tmp_path, cache_home):
  (tmp_path / "file").write_text("x")
  proc = _cli(tmp_path / "file" / "missing", "--size", "16MiB", "--tensor-size", "4MiB")
  assert proc.returncode == 1 and "probe: error:" in proc.stderr and "missing" in proc.stderr
  proc = _cli(tmp_path, "--dwpd", "1")
  assert proc.returncode == 2 and "--capacity" in proc.stderr
  proc = _cli(tmp_path, "--threads", "0")
  assert proc.returncode == 2 and "'0'" in proc.stderr
  proc = _cli(tmp_path, "--bandwidth-cap", "soon")
  assert proc.returncode == 2 and "soon" in proc.stderr
  (tmp_path / "bad.json").write_text('{"step_ms": 5}')
  proc = _cli(tmp_path, "--size", "16MiB", "--plan", tmp_path / "bad.json")
  assert proc.returncode == 1 and "disk_bytes_written_per_step" in proc.stderr


# ---------------------------------------------------------------------------------------------
# GPU: the cap under the CUDA handlers


@pytest.mark.gpu
def test_gpu_offload_through_a_capped_store(tmp_path):
  import jax
  import jax.numpy as jnp
  from jax.ad_checkpoint import checkpoint_name

  cap = 500e6
  layers, width, batch = 4, 1024, 2048  # h: 8 MiB per layer, f32

  def body(x, w):
    h = checkpoint_name(jnp.tanh(x @ w), "h")
    return checkpoint_name(h @ w.T, "out"), None

  def step(policy):
    f = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.jit(jax.grad(lambda w, x: jnp.mean(jax.lax.scan(f, x, w)[0] ** 2)))

  k1, k2 = jax.random.split(jax.random.key(0))
  w = jax.random.normal(k1, (layers, width, width)) / width**0.5
  x = jax.random.normal(k2, (batch, width))
  ref = step(jax.checkpoint_policies.save_only_these_names("h", "out"))(w, x)
  with ssd.configured(
    tmp_path / "store",
    capacity_bytes="1GiB",
    host_cache_bytes="16MiB",
    forwarding=False,
    bandwidth_cap=cap,
  ):
    ours = step(ssd.offload_policy(("h", "out"), min_bytes=0, location="nvme"))
    jax.block_until_ready(ours(w, x))
    ssd.reset_stats()
    got = ours(w, x)
    jax.block_until_ready(got)
    ssd.flush()
    s = ssd.stats()
  assert float(jnp.max(jnp.abs(got - ref))) <= 1e-5 * float(jnp.max(jnp.abs(ref)))
  assert s["bandwidth_cap"] == cap and s["disk_bytes_written"] >= layers * 8 * MiB
  assert s["write_seconds"] >= 0.95 * s["disk_bytes_written"] / cap
  assert s["read_seconds"] >= 0.95 * s["disk_bytes_read"] / cap


# ---------------------------------------------------------------------------------------------
# measure_disk_duplex()


def test_disk_duplex_reads_while_it_writes(tmp_path):
  r = probe.measure_disk_duplex(tmp_path, "16MiB", threads=2)
  assert (r.directory, r.size, r.threads) == (os.path.realpath(tmp_path), 16 * MiB, 2)
  assert r.read_gbps > 0 and r.write_gbps > 0 and r.o_direct in (True, False)
  # both directions moved `size` in `seconds` at most: neither side's rate is below that
  assert r.each_way_gbps <= min(r.read_gbps, r.write_gbps) * (1 + 1e-9)
  assert os.listdir(tmp_path) == []  # an unlinked file only


def test_disk_duplex_refuses_what_it_cannot_measure(tmp_path):
  with pytest.raises(ValueError, match="threads=1"):
    probe.measure_disk_duplex(tmp_path, "16MiB", threads=1)
  with pytest.raises(ValueError, match="needs .* bytes free"):
    probe.measure_disk_duplex(tmp_path, "1000TiB")


def test_probe_is_the_door_to_the_measure_package():
  # One measurement, one home: the CLI module re-exports the private package's objects, and
  # ssd.measured_bandwidth (the planner's shorthand) is the package's own call-through.
  from jax_ssdtrain._src.measure import link, recommend, wear

  assert probe.measure is disk.measure and probe.ProbeResult is disk.ProbeResult
  assert probe.measure_disk_duplex is disk.measure_disk_duplex
  assert probe.stripe_directories is disk.stripe_directories
  assert probe.measure_link is link.measure_link and probe.LinkResult is link.LinkResult
  assert probe.recommend is recommend.recommend and probe.wear is wear.wear
  assert ssd.measured_bandwidth is disk.measured_bandwidth
