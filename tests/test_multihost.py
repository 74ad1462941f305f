"""Two CPU processes on this machine (coordinator on 127.0.0.1), 2 devices each, DP training of
a tiny GPT with offload; each process uses its own store directory ("{process}")."""

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
  procs = [
    subprocess.Popen(
      [sys.executable, WORKER, *a],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for a in argv
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
