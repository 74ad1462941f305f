"""Smoke test of scripts/bench_emulated.py: tiny shape on CPU, one capped RAM store, one point."""

import json

import pytest
from _common import run_module

CAP = 0.02  # GB/s: the tiny sweep_4 step writes and reads ~2.4 MB, ~0.1 s each way at the cap


@pytest.mark.slow
def test_bench_emulated_tiny(tmp_path):
  proc = run_module(
    "scripts.bench_emulated",
    "--tiny",
    "--caps",
    str(CAP),
    "--points",
    "4",
    "--no-disk",
    "--no-probe",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--shm-dir",
    str(tmp_path / "shm"),
    "--out",
    str(tmp_path),
  )

  (path,) = tmp_path.glob("emulated_cpu_*.json")
  assert path.with_suffix(".png").stat().st_size > 0
  doc = json.loads(path.read_text())
  assert doc["shape"] == [256, 128, 2, 2]
  rows = {(r["store"], r["policy"]): r for r in doc["rows"]}
  assert set(rows) == {("none", "selective"), (f"shm_{CAP:g}GBps", "ssd_nvme_sweep_4")}
  for r in rows.values():
    assert "error" not in r, r
    assert len(r["step_ms_all"]) == 2 and r["step_ms_median"] > 0 and r["model_tflops"] > 0
  capped = rows[(f"shm_{CAP:g}GBps", "ssd_nvme_sweep_4")]
  assert capped["cap_GBps"] == CAP and capped["store_config"]["bandwidth_cap"] == int(CAP * 1e9)
  engine = capped["engine"]
  assert engine["bandwidth_cap"] == int(CAP * 1e9) and engine["disk_bytes_written"] > 0
  # No transfer finishes before its share of the cap's timeline.
  assert engine["write_seconds"] >= 0.95 * engine["disk_bytes_written"] / (CAP * 1e9)
  assert "shm_0.02GBps" in proc.stdout and "offload GB/step" in proc.stdout  # the table
