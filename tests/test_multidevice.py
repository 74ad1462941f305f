"""Offload under jax.sharding on 4 CPU devices (a subprocess: the flag that makes them must be
set before JAX starts). DP, FSDP and TP on the MLP: grads equal the single-device grads, the
offloading program has the same collectives as the one saving on the device, every device
stores exactly its shards."""

import pytest
from _common import run_worker, skip_without_gpus

WORKER = "_multidevice_worker.py"


# The tests of the worker's result: one process of about 40 s on 2 cores, run by the slow stage.
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  return run_worker(WORKER, tmp_dir=tmp_path_factory.mktemp("multidevice"), JAX_PLATFORMS="cpu")


@SLOW
def test_worker_leaves_nothing_behind(result):
  # The {device} store directories (ssd-md-*) and the default store's temporary directory
  # are removed by the time the worker exits.
  assert result["left_behind"] == [], result["left_behind"]


CASES = ("dp-nvme", "fsdp-nvme", "tp-nvme", "tp-host")


@SLOW
@pytest.mark.parametrize("case", CASES)
def test_grads_match_single_device(result, case):
  r = result["layouts"][case]
  assert r["stores_in_hlo"] > 0
  assert r["vs_single"] < 1e-6, r
  # The same sharded program saving on the device: identical arithmetic.
  assert r["vs_device_saving"] == 0.0, r


@SLOW
@pytest.mark.parametrize("case", CASES)
def test_every_device_releases_its_entries_after_the_step(result, case):
  # Counted per device: each device's entries are released at their last load in the step.
  assert result["layouts"][case]["live_after_step"] == 0, result["layouts"][case]


@SLOW
@pytest.mark.parametrize("case", CASES)
def test_no_collectives_added(result, case):
  r = result["layouts"][case]
  assert r["collectives"] == r["collectives_device_saving"], r


@SLOW
def test_fsdp_gathers_weights_not_activations(result):
  # Under FSDP (inside the training step's batch_sharded_activations) only weights are
  # gathered: no all-to-all of logits, and no more all-reduces than data parallelism's
  # gradient reductions (a vocab-split table made the partitioner exchange logits and
  # all-reduce looked-up rows).
  fsdp, dp = (
    result["layouts"]["fsdp-nvme"]["collectives"],
    result["layouts"]["dp-nvme"]["collectives"],
  )
  assert fsdp["all-to-all"] == 0, fsdp
  assert fsdp["all-reduce"] <= dp["all-reduce"], (fsdp, dp)
  assert fsdp["all-gather"] > 0, fsdp  # the sharded weights


@SLOW
@pytest.mark.parametrize("case", CASES)
def test_each_device_stores_its_shard(result, case):
  r = result["layouts"][case]
  stats = r["device_stats"]
  assert sorted(stats) == sorted(result["devices"]), stats
  for dev, s in stats.items():
    assert s["bytes_written"] == r["expected_shard_bytes"], (dev, s)
    assert s["bytes_read"] == r["expected_shard_bytes"], (dev, s)


@SLOW
def test_shard_map(result):
  r = result["shard_map"]
  assert r["diff"] == 0.0
  # (32, 64) float32 batch over 4 devices: each stores its (8, 64) block.
  assert r["expected_shard_bytes"] == 8 * 64 * 4
  assert {d: s["bytes_written"] for d, s in r["device_stats"].items()} == {
    d: 8 * 64 * 4 for d in result["devices"]
  }


@SLOW
def test_device_placeholder_gives_each_device_its_own_files(result):
  r = result["per_device_dirs"]
  n = r["directories"]
  assert r["device_groups"] == n == len(result["devices"]), r
  # Device i's tensor (4096 bytes) is written to and read from directory i only.
  assert r["device_bytes_written"] == [4096] * n, r
  assert r["file_bytes_written"] == [4096] * n, r
  assert r["file_bytes_read"] == [4096] * n, r


@SLOW
def test_handle_on_another_device_is_refused(result):
  msg = result["wrong_device"]["error"]
  assert msg and "stored by device" in msg and "used by a load on device" in msg, msg
  assert "'moved'" in msg


def test_parse_mesh_and_specs():
  from models import parallel

  assert parallel.parse_mesh("dp=2, tp=2, fsdp") == parallel.Parallelism(2, 2, True)
  assert parallel.parse_mesh("dp=4") == parallel.Parallelism(data=4)
  for bad, msg in [
    ("dp=x", "integer"),
    ("pp=2", "unknown entry"),
    ("fsdp=1", "no value"),
    ("dp=0", "positive"),
  ]:
    with pytest.raises(ValueError, match=msg):
      parallel.parse_mesh(bad)
  par = parallel.Parallelism(data=2, model=2, fsdp=True)
  P = parallel.P
  up = "['params']['decoder']['layers']['mlp']['up']['kernel']"
  down = "['params']['decoder']['layers']['mlp']['down']['kernel']"
  assert par.spec(up, (2, 64, 256)) == P(None, "data", "model")
  assert par.spec(down, (2, 256, 64)) == P(None, "model", "data")
  assert par.spec("['params']['embed']['tokens']['embedding']", (256, 64)) == P("data", None)
  assert par.spec("['params']['decoder']['layers']['ln_mlp']['scale']", (2, 64)) == P(None, "data")
  assert par.spec("['params']['decoder']['ln_final']['scale']", (64,)) == P(None)
  with pytest.raises(ValueError, match="not divisible by model=2"):
    par.spec(up, (2, 64, 255))


@pytest.mark.slow  # test_two_of_four_cpu_devices keeps a smaller mesh in the README's command
def test_meshes_smaller_than_the_machine(tmp_path):
  """On 4 CPU devices, meshes of fewer: models.parallel takes the first devices (it refused any
  mesh not over every device: "mesh data=2 x model=1 needs 2 devices, got 4", as
  test_two_gpus on a 4-GPU machine), or those chosen; scripts/train.py's --mesh dp=2 trains on
  the first 2, or on --devices 2,3, which alone store the offloaded activations."""
  r = run_worker("_mesh_subset_worker.py", tmp_dir=tmp_path, JAX_PLATFORMS="cpu")
  assert r["devices"] == [0, 1, 2, 3]
  assert r["dp2"] == [[0], [1]] and r["tp2"] == [[0, 1]] and r["dp1"] == [[0]]
  assert r["explicit"] == [[3], [1]]
  assert "a mesh of 8 devices: there are only 4" in r["too_many"], r["too_many"]
  assert "no device 7; there are 4 (ids 0, 1, 2, 3)" in r["no_such_device"], r["no_such_device"]
  first, chosen = r["train_first"], r["train_chosen"]
  assert first["stored_by"] == [0, 1] and chosen["stored_by"] == [2, 3], (first, chosen)
  assert first["gb_written"] == chosen["gb_written"] > 0
  assert first["final_loss"] == chosen["final_loss"], (first, chosen)


def _check_first_devices(r: dict, n: int) -> None:
  """The worker's result on the first ``n`` devices (of ``n`` or more): each layout's grads as
  the single device's, the offload adds no collectives, and each of the ``n`` devices (those
  only) stores and loads exactly its shards."""
  assert r["left_behind"] == [], r["left_behind"]
  assert r["devices"] == [str(i) for i in range(n)], r["devices"]
  for case, c in r["layouts"].items():
    assert c["stores_in_hlo"] > 0, case
    assert c["vs_single"] < 1e-4, (case, c["vs_single"])
    assert c["vs_device_saving"] < 1e-6, (case, c["vs_device_saving"])
    assert c["collectives"] == c["collectives_device_saving"], (case, c)
    assert sorted(c["device_stats"]) == r["devices"], (case, c["device_stats"])
    for s in c["device_stats"].values():
      assert s["bytes_written"] == s["bytes_read"] == c["expected_shard_bytes"], (case, s)
  assert r["shard_map"]["diff"] < 1e-6
  assert sorted(r["shard_map"]["device_stats"]) == r["devices"], r["shard_map"]
  # {device}: a directory per device of the machine; the mesh's devices use theirs alone
  d = r["per_device_dirs"]
  assert d["directories"] == d["device_groups"] == r["visible_devices"], d
  assert d["device_bytes_written"] == [4096] * n, d
  assert (
    d["file_bytes_written"] == d["file_bytes_read"] == [4096] * n + [0] * (r["visible_devices"] - n)
  ), d


@SLOW
def test_two_of_four_cpu_devices(tmp_path):
  """test_two_gpus's worker on a machine with more devices than it needs: 2 of 4 CPU devices."""
  r = run_worker(
    WORKER, tmp_dir=tmp_path, JAX_PLATFORMS="cpu", SSD_MD_DEVICES="2", SSD_MD_CPU_DEVICES="4"
  )
  assert r["visible_devices"] == 4
  _check_first_devices(r, 2)
  msg = r["wrong_device"]["error"]
  assert msg and "stored by device" in msg and "used by a load on device" in msg, msg


def _gpu_worker(tmp_path, n: int) -> dict:
  """The worker on the first ``n`` GPUs (skipped where there are fewer; more are left idle)."""
  skip_without_gpus(n)
  return run_worker(
    WORKER,
    tmp_dir=tmp_path,
    SSD_MD_PLATFORM="gpu",
    SSD_MD_DEVICES=str(n),
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
  )


@pytest.mark.gpu
def test_two_gpus(tmp_path):
  """The same checks on 2 GPUs (DP, FSDP over 2; TP 1x2), in a subprocess; the first 2 GPUs of
  a machine with more."""
  _check_first_devices(_gpu_worker(tmp_path, 2), 2)


@pytest.mark.gpu
def test_four_gpus(tmp_path):
  """The same checks on 4 GPUs (DP, FSDP over 4; TP 2x2)."""
  _check_first_devices(_gpu_worker(tmp_path, 4), 4)
