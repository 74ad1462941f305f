"""Smoke test of scripts/bench_rok.py: the tiny preset on CPU, three policies, no probe."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("keep", "selective", "ssd_nvme_named")


@pytest.mark.slow
def test_bench_rok_tiny(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    "-m",
    "scripts.bench_rok",
    "--tiny",
    "--steps",
    "2",
    "--policies",
    ",".join(POLICIES),
    "--no-probe",
    "--out",
    str(tmp_path),
    "--store-dir",
    str(tmp_path / "store"),
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_S)
  assert proc.returncode == 0, proc.stdout + proc.stderr

  (path,) = tmp_path.glob("rok_cpu_*.json")
  assert path.with_suffix(".png").stat().st_size > 0
  doc = json.loads(path.read_text())
  assert doc["env"]["device_kind"] == "cpu" and doc["env"]["jax"]
  rows = {r["policy"]: r for r in doc["rows"]}
  assert set(rows) == set(POLICIES)
  for r in rows.values():
    assert "error" not in r, r
    assert (r["H"], r["S"], r["B"], r["L"]) == (256, 128, 2, 2)
    assert len(r["step_ms_all"]) == 2 and r["step_ms_median"] > 0 and r["model_tflops"] > 0
    assert r["temp_GB"] > 0
  assert rows["selective"]["x_selective"] == 1.0
  assert rows["keep"]["temp_GB"] > rows["selective"]["temp_GB"]
  assert "check_ok" not in rows["keep"]  # checks default to the ssd policies

  ssd = rows["ssd_nvme_named"]
  assert ssd["offload_GB_per_step"] == pytest.approx(ssd["expected_offload_GB_per_step"])
  assert ssd["disk_MB_written_per_step"] > 0 and ssd["stall_ms_per_step"] >= 0
  assert ssd["engine"]["tensors_written"] == 2 * 2 * 4  # steps x layers x tags
  assert ssd["check_steps"] == 20 and ssd["check_identical_repeats"] is True
  assert ssd["check_max_rel_diff_vs_selective"] <= 1e-2 and ssd["check_ok"] is True
  assert "ssd_nvme_named" in proc.stdout and "x sel" in proc.stdout  # the table


@pytest.mark.slow
def test_bench_multigpu_cpu_smoke(tmp_path):
  """1 vs 2 CPU devices, FSDP, both offload policies and remat: the script runs end to end and
  writes its rows, and the offload adds no collective to the compiled program."""
  cmd = [
    sys.executable,
    "-m",
    "scripts.bench_multigpu",
    "--cpu-smoke",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--policies",
    "offload,offload_host,remat",
    "--layouts",
    "fsdp",
    "--host-cache",
    "64MiB",
    "--host-tier",
    "64MiB",
    "--out",
    str(tmp_path),
    "--store-dir",
    str(tmp_path / "store"),
  ]
  proc = subprocess.run(
    cmd,
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=HANG_S,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  (path,) = tmp_path.glob("multigpu_cpu_*.json")
  doc = json.loads(path.read_text())
  rows = {r["policy"]: r for r in doc["rows"]}
  assert sorted(rows) == ["offload", "offload_host", "remat"]
  for row in rows.values():
    assert (row["layout"], row["gpus"]) == ("fsdp", 2)
    assert row["efficiency"] > 0 and row["step_ms_1"] > 0 and row["step_ms_n"] > 0
    assert row["collectives_n"] > 0  # FSDP's all-gathers and all-reduces
  for policy in ("offload", "offload_host"):
    assert rows[policy]["collectives_added_vs_remat"] == 0, rows[policy]
    assert rows[policy]["collectives_same_as_remat"] is True, rows[policy]
  run2 = {r["policy"]: r for r in doc["runs"]["2"]["rows"]}
  host = run2["offload_host"]["engine"]
  assert host["host_tier_bytes_peak"] > 0 and host["disk_bytes_written"] == 0
  # Both devices stored the same (their own) shards; the stores are one directory per device.
  for policy in ("offload", "offload_host"):
    stats = run2[policy]["device_stats"]
    assert len(stats) == 2 and len({s["bytes_written"] for s in stats.values()}) == 1
  assert doc["runs"]["2"]["store_directories"] == [
    str(tmp_path / "store" / "n2" / f"gpu{i}") for i in range(2)
  ]
  assert "weak-scaling" in proc.stdout


@pytest.mark.slow
def test_bench_layer_stream_cpu_smoke(tmp_path):
  """The tiny GPT of 4 layers streamed from the host tier against its ideal (2 and 4 layers on
  the device): the script runs end to end, the 4-layer ideal is the same model (its losses
  agree), and the store holds what check_streamed_room's arithmetic says."""
  cmd = [sys.executable, "-m", "scripts.bench_layer_stream", "--cpu-smoke", "--out", str(tmp_path)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_S)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  (path,) = tmp_path.glob("layerstream_cpu_*.json")
  assert path.with_suffix(".md").read_text().startswith("cpu: tiny (4 layers)")
  doc = json.loads(path.read_text())
  s = doc["streamed"]
  assert "error" not in s, s
  assert (doc["layers"], doc["micro_batches"], doc["steps"]) == (4, 2, 2) and doc["steps_note"]
  assert len(s["step_s_all"]) == 3 and s["step_s"] > 0 and s["tokens_per_step"] == 2 * 2 * 32
  assert s["losses"][-1] < s["losses"][0]  # AdamW trains it
  assert s["max_loss_diff_vs_ideal_run"] < 2e-3  # bfloat16 compute, reassociated
  runs = {r["layers"]: r for r in doc["ideal_runs"]}
  assert sorted(runs) == [2, 4] and runs[4]["n_params"] == s["n_params"]
  # two layer counts: the extended line passes through both, and the 4-layer run is the ideal
  assert doc["ideal"]["step_s"] == pytest.approx(runs[4]["step_s"])
  assert s["x_ideal"] == pytest.approx(doc["ideal"]["step_s"] / s["step_s"])
  room, engine = s["store_room"], s["engine"]
  assert room["bytes_per_parameter"] == dict(params=2, master=4, optimizer_state=8, grad_sum=4)
  assert 0.5 * room["peak_bytes"] < engine["host_tier_GB_peak"] * 1e9 <= room["peak_bytes"]
  assert engine["disk_MB_written_per_step"] == 0  # the host tier alone
  # per step: the sums (4 B a parameter, a micro-batch) and the update (14 B) went out
  assert engine["offload_GB_per_step"] * 1e9 == pytest.approx(
    room["parameters"] * (2 * 4 + 14), rel=1e-6
  )
