"""Two processes on this machine (coordinator on 127.0.0.1), DP training of a tiny GPT with
offload; each process uses its own store directory ("{process}"). On CPU: 2 devices per process
vs a single-device reference. On GPUs (marked gpu): one GPU per process vs one process driving
both GPUs."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from _limits import HANG_S

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_multihost_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(runs) -> None:
  """Runs ``[(worker argv, env), ...]`` at once; asserts each exits 0 (its log's tail if not)."""
  procs = [
    subprocess.Popen(
      [sys.executable, WORKER, *a],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for a, env in runs
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=HANG_S)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
  env = dict(
    os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu"
  )
  template = str(tmp_path / "store-{process}")
  port = _free_port()
  outs = [tmp_path / f"out{i}.json" for i in range(3)]
  argv = [[str(i), "2", str(port), template, str(outs[i])] for i in range(2)]
  argv.append(["0", "0", "0", str(tmp_path / "ref-{process}"), str(outs[2])])
  _run_workers([(a, env) for a in argv])
  p0, p1, ref = (json.loads(o.read_text()) for o in outs)
  assert p0["store_directories"] == [str(tmp_path / "store-0")]
  assert p1["store_directories"] == [str(tmp_path / "store-1")]
  np.testing.assert_allclose(p0["losses"], ref["losses"], rtol=1e-5)
  assert p0["losses"] == p1["losses"]
  np.testing.assert_allclose(p0["param_sums"], ref["param_sums"], rtol=2e-4)  # 3 Adam steps
  assert p1["param_sums"] == p0["param_sums"]
  # Each process stored only its devices' shards: a quarter of the reference's bytes each.
  for r in (p0, p1):
    # Keyed by the ordinal XLA gives the handler: on CPU the device id.
    assert sorted(map(int, r["device_stats"])) == r["local_devices"], r
    for s in r["device_stats"].values():
      assert 4 * s["bytes_written"] == ref["device_stats"]["0"]["bytes_written"]


@pytest.mark.slow
def test_four_processes_stream_their_own_optimizer_blocks(tmp_path):
  """4 processes of one CPU device each, FSDP over the 4 with the optimizer state in the host
  tier (each process streams its own device's blocks), saved and restored by all four at once,
  against one process driving 4 CPU devices with the same mesh."""
  env = dict(
    os.environ,
    PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    JAX_PLATFORMS="cpu",
    SSD_MH_OPTIMIZER="host",
    SSD_MH_FSDP="1",
  )
  port = _free_port()
  outs = [tmp_path / f"out{i}.json" for i in range(5)]
  template = str(tmp_path / "store-{process}")
  runs = [
    (
      [str(i), "4", str(port), template, str(outs[i])],
      dict(env, SSD_MH_DEVICES="1", SSD_MH_CHECKPOINT=str(tmp_path / "ckpt")),
    )
    for i in range(4)
  ]
  runs.append(
    (
      ["0", "0", "0", str(tmp_path / "ref-{process}"), str(outs[4])],
      dict(env, SSD_MH_DEVICES="4", SSD_MH_CHECKPOINT=str(tmp_path / "ref-ckpt")),
    )
  )
  _run_workers(runs)
  *procs, ref = (json.loads(o.read_text()) for o in outs)
  assert [len(r["local_devices"]) for r in procs] == [1, 1, 1, 1] and ref["process_count"] == 1
  for r in procs[1:]:  # one program: every process the same losses and (gathered) parameters
    assert r["losses"] == procs[0]["losses"] and r["params_sha256"] == procs[0]["params_sha256"]
  # gloo's all-reduce against the in-process one: the same sums in another order
  np.testing.assert_allclose(procs[0]["losses"], ref["losses"], rtol=1e-5)
  np.testing.assert_allclose(procs[0]["param_sums"], ref["param_sums"], rtol=2e-4)
  assert all(r["restored_equal"] for r in procs + [ref]), [r["restored_equal"] for r in procs]
  # Each process stored through its own device only, as much as the reference's first device:
  # its blocks, and the whole state that create_train_state's init (on the process's first
  # device, before sharding) stored first.
  for r in procs:
    assert sorted(map(int, r["device_stats"])) == r["local_devices"], r
  written = [r["device_stats"][str(r["local_devices"][0])]["bytes_written"] for r in procs]
  first = ref["device_stats"][str(ref["local_devices"][0])]["bytes_written"]
  assert written == [first] * 4, (written, ref["device_stats"])


def _gpu_count(env) -> int:
  """GPUs JAX sees in a worker's environment, counted in a subprocess (no CUDA use here)."""
  proc = subprocess.run(
    [sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"],
    env=env,
    capture_output=True,
    text=True,
    timeout=HANG_S,
  )
  lines = proc.stdout.split()
  return int(lines[-1]) if proc.returncode == 0 and lines else 0


# Both programs run the same per-device computation (the same 2-way DP program; the gradient
# all-reduce adds 2 values, the same bits in either order): bitwise equal once XLA picks its
# kernels without timing them and without atomics (scatter-add of the embedding gradient).
GPU_XLA_FLAGS = " --xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"


def _gpu_env(n: int, **extra) -> tuple[dict, list[str]]:
  """The workers' environment on the first ``n`` GPUs (of ``CUDA_VISIBLE_DEVICES`` when set):
  (env, those GPUs' ids); ``extra`` added to env. Skips the test with fewer than ``n`` GPUs."""
  env = dict(
    os.environ,
    PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
  )
  env.pop("JAX_PLATFORMS", None)
  if _gpu_count(env) < n:
    pytest.skip(f"needs {n} GPUs")
  visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n)))).split(",")[:n]
  env.update(
    SSD_MH_PLATFORM="gpu",
    XLA_FLAGS=env.get("XLA_FLAGS", "") + GPU_XLA_FLAGS,
    CUDA_VISIBLE_DEVICES=",".join(visible),
    **extra,
  )
  return env, visible


@pytest.mark.gpu
def test_two_gpu_processes_match_one_process(tmp_path):
  """2 processes with one GPU each (NCCL across processes, a store per process) vs one process
  driving both GPUs: the same losses, gradient norms and parameters, bit for bit."""
  env, visible = _gpu_env(2)
  template = str(tmp_path / "store-{process}")
  port = _free_port()
  outs = [tmp_path / f"out{i}.json" for i in range(3)]
  # the two processes together, then the reference (both GPUs, one process)
  _run_workers(
    [
      ([str(i), "2", str(port), template, str(outs[i])], dict(env, CUDA_VISIBLE_DEVICES=visible[i]))
      for i in range(2)
    ]
  )
  _run_workers([(["0", "0", "0", str(tmp_path / "ref-{process}"), str(outs[2])], env)])
  p0, p1, ref = (json.loads(o.read_text()) for o in outs)
  for r, n, local in ((p0, 2, 1), (p1, 2, 1), (ref, 1, 2)):
    assert (r["platform"], r["process_count"], len(r["local_devices"])) == ("gpu", n, local), r
  assert p0["local_devices"] != p1["local_devices"]  # global device ids: a device each
  # Each process's store is its own directory, holding that process's store file(s).
  for r, directory in ((p0, "store-0"), (p1, "store-1"), (ref, "ref-0")):
    assert r["store_directories"] == [str(tmp_path / directory)], r
    assert r["store_open_files"][str(tmp_path / directory)] >= 1, r
    assert r["store_stats"]["file0_bytes_written"] > 0, r
  # Bitwise: the two processes (the same all-reduce result on both) and the reference.
  for r in (p1, ref):
    assert r["losses"] == p0["losses"], (r["losses"], p0["losses"])
    assert r["grad_norms"] == p0["grad_norms"], (r["grad_norms"], p0["grad_norms"])
    assert r["params_sha256"] == p0["params_sha256"], np.max(
      np.abs(np.array(r["param_sums"]) / np.array(p0["param_sums"]) - 1)
    )
  # Each GPU stored only its shards: the same bytes as each GPU of the reference.
  assert len(ref["device_stats"]) == 2, ref["device_stats"]
  (shard,) = {s["bytes_written"] for s in ref["device_stats"].values()}
  assert shard > 0
  for r in (p0, p1):
    (s,) = r["device_stats"].values()  # one GPU: the CUDA ordinal it sees, 0
    assert s["bytes_written"] == s["bytes_read"] == shard, (r["device_stats"], shard)


@pytest.mark.gpu
def test_four_gpu_processes_stream_their_own_optimizer_blocks(tmp_path):
  """4 processes with one GPU each, FSDP over the 4 with the optimizer state in the host tier
  (each process streams its GPU's blocks), saved and restored by the 4 at once, vs one process
  driving the 4 GPUs: the same losses, gradient norms and parameters, bit for bit."""
  env, visible = _gpu_env(4, SSD_MH_OPTIMIZER="host", SSD_MH_FSDP="1")
  template = str(tmp_path / "store-{process}")
  port = _free_port()
  outs = [tmp_path / f"out{i}.json" for i in range(5)]
  ckpt = dict(SSD_MH_CHECKPOINT=str(tmp_path / "ckpt"))
  _run_workers(
    [
      (
        [str(i), "4", str(port), template, str(outs[i])],
        dict(env, CUDA_VISIBLE_DEVICES=visible[i], **ckpt),
      )
      for i in range(4)
    ]
  )
  ref_env = dict(env, SSD_MH_CHECKPOINT=str(tmp_path / "ref-ckpt"))
  _run_workers([(["0", "0", "0", str(tmp_path / "ref-{process}"), str(outs[4])], ref_env)])
  *procs, ref = (json.loads(o.read_text()) for o in outs)
  for r in procs:
    assert (r["platform"], r["process_count"], len(r["local_devices"])) == ("gpu", 4, 1), r
  assert (ref["process_count"], len(ref["local_devices"])) == (1, 4), ref
  for r in procs[1:] + [ref]:
    assert r["losses"] == procs[0]["losses"], (r["losses"], procs[0]["losses"])
    assert r["grad_norms"] == procs[0]["grad_norms"], (r["grad_norms"], procs[0]["grad_norms"])
    assert r["params_sha256"] == procs[0]["params_sha256"]
  assert all(r["restored_equal"] for r in procs + [ref]), [r["restored_equal"] for r in procs]
  # Each GPU stored only its own blocks (and, as the reference's first GPU, the whole state
  # that create_train_state's init stored before sharding).
  first = ref["device_stats"][str(ref["local_devices"][0])]["bytes_written"]
  for r in procs:
    (s,) = r["device_stats"].values()
    assert s["bytes_written"] == first > 0, (r["device_stats"], ref["device_stats"])
