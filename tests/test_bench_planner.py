"""Smoke test of scripts/bench_planner.py: tiny stack on CPU, plans that offload, a memory cap."""

import json

import pytest
from _common import run_module


@pytest.mark.slow
def test_bench_planner_tiny(tmp_path):
  run_module(
    "scripts.bench_planner",
    "--tiny",
    "--no-presets",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--bandwidth",
    "100,100",
    "--cap-gb",
    "1",
    "--max-slowdown",
    "1",
    "--cap-policies",
    "keep,recompute,selective,ssd_host_named",
    "--out",
    str(tmp_path),
    "--store-dir",
    str(tmp_path / "store"),
  )
  (path,) = tmp_path.glob("planner_cpu_*.json")
  assert path.with_suffix(".png").stat().st_size > 0
  assert "| auto_nvme |" in path.with_suffix(".md").read_text()
  doc = json.loads(path.read_text())
  assert doc["bandwidth"] == [100.0, 100.0]
  stack, cap = doc["parts"]
  rows = {r["policy"]: r for r in stack["rows"]}
  assert set(rows) == {"keep", "selective", "auto", "auto_nvme", "host_all"}
  for r in rows.values():
    assert r["step_ms"] > 0 and r["predicted_ms"] > 0 and r["device_GB"] > 0
  # every tag of both layers in the host tier, measured with the arena the planner sized for it
  host_all = stack["plans"]["host_all"]
  assert host_all["offload_layers"] == 2 and host_all["host_GB"] > 0
  assert set(host_all["locations"].values()) == {"host"}
  assert host_all["staging_GB"] > 0
  assert rows["host_all"]["staging_GB"] == pytest.approx(host_all["staging_GB"])
  assert rows["host_all"]["offload_GB_per_step"] == pytest.approx(host_all["host_GB"])
  plan = stack["plans"]["auto_nvme"]
  # fast disk, a 100% bound: the least memory, every layer offloads
  assert plan["offload_layers"] == 2 and plan["nvme_GB"] > 0
  assert rows["auto_nvme"]["offload_GB_per_step"] == pytest.approx(plan["nvme_GB"])
  assert rows["auto_nvme"]["device_GB"] < rows["keep"]["device_GB"]
  assert {(r["policy"], r["batch"]) for r in cap["grid"]} == {
    (n, b) for n in ("keep", "recompute", "selective", "ssd_host_named") for b in (1, 2, 4)
  }
  assert all(r["tokens_per_s"] > 0 for r in cap["grid"])
  ((under,),) = [cap["caps"]]
  rows = {r["policy"]: r for r in under["rows"]}
  assert set(rows) == {"keep", "recompute", "selective", "ssd_host_named", "auto", "auto_nvme"}
  assert all(r["batch"] and r["device_GB"] <= 1 for r in rows.values())
  best_jax = max(
    r["tokens_per_s"] for n, r in rows.items() if n in ("keep", "recompute", "selective")
  )
  for r in rows.values():
    assert r["x_best_jax"] == pytest.approx(r["tokens_per_s"] / best_jax)
  # the planner's compiles are recorded, and the plan it measured is one of them
  # (auto_nvme may have chosen and measured the same plan: then it is there twice)
  mine = [
    c
    for c in cap["compiles"]
    if c["batch"] == rows["auto"]["batch"]
    and c["offload_layers"] == rows["auto"]["plan"]["offload_layers"]
    and c["locations"] == rows["auto"]["plan"]["locations"]
    and c["cap_GB"] == 1
  ]
  assert mine
  for m in mine:
    assert m["device_GB"] == pytest.approx(rows["auto"]["device_GB"]) and m["device_GB"] <= 1
  assert path.with_name(path.stem + "_cap.png").stat().st_size > 0
  assert "| ssd_host_named | 4 |" in path.with_suffix(".md").read_text()
