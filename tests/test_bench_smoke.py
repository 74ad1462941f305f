"""Smoke tests of the benchmark scripts (bench_rok, bench_multigpu, bench_layer_stream,
bench_long_context): the tiny presets on CPU, end to end; bench_common's child runner."""

import json
import os
import sys

import pytest
from _common import run_module

POLICIES = ("keep", "selective", "ssd_nvme_named")


@pytest.mark.slow
def test_bench_rok_tiny(tmp_path):
  proc = run_module(
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
  )

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
  """1 vs 2 CPU devices, FSDP, both offload policies (the optimizer state in the host tier) and
  remat: the script runs end to end and writes its rows, and the offload adds no collective to
  the compiled program."""
  proc = run_module(
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
    "512MiB",  # the layer inputs and Adam's state (two versions during the update)
    "--out",
    str(tmp_path),
    "--store-dir",
    str(tmp_path / "store"),
  )
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
  run_module("scripts.bench_layer_stream", "--cpu-smoke", "--out", tmp_path)
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


@pytest.mark.slow
def test_bench_multigpu_cpu_smoke_1_2_4(tmp_path):
  """--gpus 1,2,4 on 1, 2 and 4 CPU devices, DP and FSDP, the layer inputs and the optimizer
  state in the host tier against remat: a row per layout and count, the points against remat,
  the collectives' arithmetic, and no collective added by the offload."""
  proc = run_module(
    "scripts.bench_multigpu",
    "--cpu-smoke",
    "--gpus",
    "1,2,4",
    "--steps",
    "2",
    "--warmup",
    "2",
    "--policies",
    "offload_host,remat",
    "--host-cache",
    "64MiB",
    "--host-tier",
    "1GiB",  # DP at 4: four replicas of Adam's state, two versions each during the update
    "--out",
    str(tmp_path),
    "--store-dir",
    str(tmp_path / "store"),
    env=dict(os.environ),  # --cpu-smoke puts each count's run on CPU devices itself
  )
  (path,) = tmp_path.glob("multigpu_cpu_*.json")
  doc = json.loads(path.read_text())
  assert doc["config"]["gpus"] == [1, 2, 4] and sorted(doc["runs"]) == ["1", "2", "4"]
  for n in ("1", "2", "4"):
    run = doc["runs"][n]
    assert not run.get("error") and run["partial"] is False, run.get("error")
    assert {r["gpus"] for r in run["rows"]} == {int(n)}
  # Every offloaded row keeps the optimizer state in the host tier; remat on the device.
  for run in doc["runs"].values():
    for r in run["rows"]:
      assert r["optimizer_location"] == ("host" if r["policy"] == "offload_host" else "device")
      assert r["engine"]["disk_bytes_written"] == 0
  rows = {(r["layout"], r["policy"], r["gpus"]): r for r in doc["rows"]}
  assert set(rows) == {
    (layout, policy, n)
    for layout in ("dp", "fsdp")
    for policy in ("offload_host", "remat")
    for n in (2, 4)
  }
  for (layout, policy, n), r in rows.items():
    assert r["efficiency"] > 0 and r["step_ms_1"] > 0 and r["step_ms_n"] > 0
    assert r["collectives_n"] > 0
    if policy == "offload_host":
      assert r["collectives_added_vs_remat"] == 0, r
      assert r["collectives_same_as_remat"] is True, r
      remat = rows[(layout, "remat", n)]
      points = 100 * (r["efficiency"] - remat["efficiency"])
      assert r["points_vs_no_offload"] == pytest.approx(points)
    else:
      assert r["points_vs_no_offload"] is None
  # The arithmetic: the model's bytes, and the ring collectives' formulas at each count.
  model = doc["runs"]["1"]["model"]
  assert model["param_bytes"] == 4 * model["param_count"] == model["grad_bytes"]
  assert model["opt_state_bytes"] >= 2 * model["param_bytes"]  # Adam's two moments
  arith = {(a["layout"], a["gpus"]): a for a in doc["arithmetic"]}
  assert set(arith) == {(layout, n) for layout in ("dp", "fsdp") for n in (2, 4)}
  p, g = model["param_bytes"], model["grad_bytes"]
  for (layout, n), a in arith.items():
    f = (n - 1) / n
    want = 2 * f * g if layout == "dp" else f * (2 * p + g)
    assert a["collective_GB_per_gpu_step"] == pytest.approx(want / 1e9)
    assert a["collective_ms"] == pytest.approx(1e3 * want / 450e9)
    assert a["optimizer_stream_gbps"] == pytest.approx(min(50.7, 88 / n))
    assert 0 < a["remat_efficiency_no_overlap"] <= 1 and a["offload_efficiency_no_overlap"] > 0
  assert [c["no_added_collective"] for c in doc["summary"]["checks"]] == [True, True]
  assert "points vs no offload" in proc.stdout and "Collectives' arithmetic" in proc.stdout


@pytest.mark.slow
def test_bench_long_context_row_failing_in_a_later_step_keeps_the_steps_before(tmp_path):
  """A write fault injected at the 6th file write (4 layer inputs a step, every one on the
  files): the row fails in its second step, and keeps the first step's time, its compile and
  where the store's room was when it failed; the table says which step failed."""
  proc = run_module(
    "scripts.bench_long_context",
    *("--preset", "tiny", "--layers", "4", "--seq", "64", "--steps", "2", "--warmup", "0"),
    *("--policies", "ours_nvme_layer_in", "--optimizer", "device", "--min-bytes", "0"),
    *("--peak-tflops", "1", "--no-probe", "--no-link-probe", "--no-ideal"),
    *("--ssd", "forwarding=False", "--store-dir", str(tmp_path / "store"), "--out", str(tmp_path)),
    env=dict(os.environ, JAX_PLATFORMS="cpu", SSDTRAIN_FAULT="write:6:EIO"),
  )
  (path,) = tmp_path.glob("longctx_cpu_*.json")
  (row,) = json.loads(path.read_text())["rows"]
  assert "Input/output error" in row["error"] and not row["oom"], row
  assert row["failed_step"] == 1 and len(row["steps_done_s"]) == 1, row
  assert row["compile_s"] > 0 and row["init_s"] > 0, row
  assert row["store_at_failure"]["tensors_written"] >= 4, row["store_at_failure"]
  assert "failed: step 2 " in path.with_suffix(".md").read_text(), proc.stdout


LONG_ROWS = (
  "remat",
  "jax_host_layer_in",
  "ours_host_layer_in",
  "ours_host_nvme_layer_in:host_tier_bytes=16KiB",  # 4 layer inputs of 8 KiB: two spill
  "ours_nvme_layer_in",
  "ours_host_layer_in@host",
  "ours_host_layer_in@streamed_device",
  "remat@jax_pinned_host",
  "ours_host_layer_in+attention=2",  # two scans (XLA's attention here: nothing more saved)
)


@pytest.mark.slow
def test_bench_long_context_cpu_smoke(tmp_path):
  """The tiny Llama of 4 layers at S=64 under every policy, its AdamW state on the device, in
  JAX's pinned host memory and in the host tier, against the ideal of 2 and 4 layers: every row has its fields, the rows
  that offload the layer inputs train bit for bit as remat, the host tier's optimizer as the
  same stream on the device, and the store's counters say where the bytes went."""
  proc = run_module(
    "scripts.bench_long_context",
    "--preset",
    "tiny",
    "--layers",
    "4",
    "--seq",
    "64",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--policies",
    ",".join(LONG_ROWS),
    "--optimizer",
    "device",
    "--min-bytes",
    "0",
    "--mlp-chunk-tokens",
    "16",  # 4 MLP chunks and 4 loss chunks
    "--loss-chunk-tokens",
    "16",
    "--peak-tflops",
    "1",
    "--no-probe",
    "--no-link-probe",
    "--store-dir",
    str(tmp_path / "store"),
    "--out",
    str(tmp_path),
  )
  (path,) = tmp_path.glob("longctx_cpu_*.json")
  assert path.with_suffix(".png").stat().st_size > 0
  assert path.with_suffix(".md").read_text().startswith("cpu: tiny (4 layers)")
  doc = json.loads(path.read_text())
  assert doc["probe"] == {"note": "--no-probe"} and doc["link"] == {"note": "--no-link-probe"}
  rows = {(r["policy"], r["optimizer"]): r for r in doc["rows"]}
  want = [(n.split("@")[0], n.split("@")[1] if "@" in n else "device") for n in LONG_ROWS]
  assert list(rows) == want
  import models
  from scripts import bench_long_context as lc

  cfg = models.get_config("llama", "tiny", num_layers=4)
  flops = lc.step_flops(cfg, 64)
  (ideal,) = doc["ideal"]
  runs = {r["layers"]: r for r in doc["ideal_runs"]}
  assert sorted(runs) == [2, 4] and ideal["seq"] == 64 and ideal["layers"] == 4
  assert ideal["step_s"] == pytest.approx(runs[4]["step_s"])  # a line through two points
  for r in rows.values():
    assert "error" not in r, r
    assert (r["seq"], r["layers"], r["mlp_chunks"], r["loss_chunks"]) == (64, 4, 4, 4)
    assert len(r["step_s_all"]) == 3 and len(r["losses"]) == 3 and r["step_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(64 / r["step_s"])
    assert r["step_TFLOP"] == pytest.approx(flops / 1e12)
    assert r["mfu"] == pytest.approx(flops / 1e12 / r["step_s"])
    assert r["x_ideal"] == pytest.approx(ideal["step_s"] / r["step_s"])
    assert r["temp_GB"] > 0 and r["argument_GB"] > 0
    assert r["device_GB"] == pytest.approx(r["temp_GB"] + r.get("staging_GB_peak", 0))
    assert r["n_params"] == runs[4]["n_params"]
  remat = rows[("remat", "device")]
  assert remat["losses"][2] != remat["losses"][0]  # the update changed the parameters
  for (policy, opt), r in rows.items():
    if opt == "device":
      assert r["loss_same_as_remat"] is True, (policy, r["losses"], remat["losses"])
    assert r["losses"][0] == remat["losses"][0]  # before any update: one arithmetic
  host = rows[("ours_host_layer_in", "host")]
  assert host["loss_same_as_streamed_device"] is True
  # JAX's own host offload of the optimizer state: the update's arithmetic unchanged
  assert rows[("remat", "jax_pinned_host")]["losses"] == remat["losses"]
  layer_in = 4 * 64 * cfg.hidden * 2  # bytes of the 4 layer inputs of a step
  for (policy, _), r in rows.items():
    if not policy.startswith("ours_"):
      assert "engine" not in r
      continue
    assert r["offload_GB_per_step"] * 1e9 >= layer_in and r["staging_GB_peak"] >= 0
    assert r["engine"]["tensors_written"] >= 2 * 4  # steps x layers
  assert rows[("ours_host_layer_in", "device")]["disk_MB_written_per_step"] == 0
  assert rows[("ours_host_layer_in", "device")]["host_tier_GB_peak"] * 1e9 >= layer_in
  # each layer input written to the files, or skipped where its load came first (forwarded from
  # the host cache before its write-behind began: timing, one in eight once under load)
  nvme = rows[("ours_nvme_layer_in", "device")]
  written = nvme["disk_MB_written_per_step"] + nvme["write_skipped_MB_per_step"]
  assert nvme["disk_MB_written_per_step"] > 0 and written * 1e6 >= layer_in, nvme
  spill = rows[("ours_host_nvme_layer_in:host_tier_bytes=16KiB", "device")]
  assert 0 < spill["host_tier_GB_peak"] * 1e9 <= 16 * 1024
  assert 0 < spill["disk_MB_written_per_step"] * 1e6 < layer_in
  assert "loss = remat" in proc.stdout and "same" in proc.stdout


def test_bench_long_context_flops_and_rows():
  """The step's FLOPs (the docstring's formula, by hand for the 8B shape at 128K) and the
  --policies grammar, its errors naming the item."""
  import models
  from scripts import bench_long_context as lc

  cfg = models.get_config("llama", "llama3-8b")
  S, H, L, V = 131072, 4096, 32, 128256
  per_layer = H * (32 + 16) * 128 + 32 * 128 * H + 3 * H * 14336
  forward = 2 * S * (L * per_layer + H * V) + 2 * L * 32 * 128 * S * S
  assert lc.step_flops(cfg, S) == 3 * forward
  assert lc.chunks_for(S, 8192) == 16 and lc.chunks_for(100, 8192) == 1
  assert lc.parse_rows("remat,ours_host_layer_in:staging_bytes=2GiB@host", ["device", "host"]) == [
    ("remat", "device"),
    ("remat", "host"),
    ("ours_host_layer_in:staging_bytes=2GiB", "host"),
  ]
  with pytest.raises(ValueError, match="unknown policy 'keep_all'"):
    lc.parse_rows("keep_all", ["device"])
  with pytest.raises(ValueError, match="unknown optimizer placement 'disk'"):
    lc.parse_rows("remat@disk", ["device"])
  with pytest.raises(ValueError, match="store options apply to the ours_"):
    lc.parse_rows("remat:staging_bytes=1GiB", ["device"])
  # NAME+attention: flash attention's outputs saved besides the policy's own choices
  import jax

  import jax_ssdtrain as ssd

  item = "ours_host_nvme_layer_in+attention:host_tier_bytes=4GiB"
  assert lc.parse_rows(f"{item}@host", ["device"]) == [(item, "host")]
  assert lc.policy_parts(item) == ("ours_host_nvme_layer_in", {"host_tier_bytes": "4GiB"}, True)
  assert lc._policy("ours_host_nvme_layer_in", 0, True).base is ssd.flash_attention_saveable
  assert lc._policy("ours_host_nvme_layer_in", 0).base is None
  from jax.extend.core import Primitive

  from jax_ssdtrain._src import jax_internals as ji
  from jax_ssdtrain._src.policies import decision_rank  # 3: saved, 0: recomputed

  flash = Primitive(ji.FLASH_ATTENTION_FORWARD)
  for name in ("remat", "jax_host_layer_in"):  # JAX's policies, and the outputs saved
    assert decision_rank(lc._policy(name, 0, True)(flash)) == 3
    assert decision_rank(lc._policy(name, 0, True)(jax.lax.exp_p)) == 0
    assert decision_rank(lc._policy(name, 0)(flash)) == 0
  with pytest.raises(ValueError, match="unknown policy 'plan'"):
    lc.parse_rows("plan+attention", ["device"])
  # +attention=K: the first K layers save them (two scans), the others recompute attention
  assert lc.policy_parts("remat+attention=20")[2] == 20
  split = lc._policy("ours_host_layer_in", 0, 20, layers=32)
  assert split.split == 20 and split.first.base is ssd.flash_attention_saveable
  assert split.rest.base is None
  assert lc._policy("ours_host_layer_in", 0, 32, layers=32).base is ssd.flash_attention_saveable
  with pytest.raises(ValueError, match=r"\+attention takes a layer count"):
    lc.parse_rows("remat+attention=x", ["device"])


def _child(code: str) -> list[str]:
  return [sys.executable, "-c", code]


def test_run_json_child_results_timeouts_and_a_gpu_stuck_after_another_ran_out(monkeypatch):
  # bench_common.run_json_child: the child's last JSON line (and its exit status); a child past
  # its time; a child whose GPUs wait in a collective for one that ran out of device memory
  # (XLA's log lines) is stopped soon after, not at its timeout.
  from scripts import bench_common as bc

  row = bc.run_json_child(_child("print('x'); print('{\"a\": 1}'); print('{\"a\": 2}')"), 60)
  assert row == {"a": 2}
  row = bc.run_json_child(_child("import sys; print('{\"a\": 1}'); sys.exit(3)"), 60)
  assert row["a"] == 1 and row["error"] == "exit status 3"
  row = bc.run_json_child(_child("import time; time.sleep(60)"), 1)
  assert row["error"] == "timed out after 1 s"
  monkeypatch.setattr(bc, "STUCK_AFTER_OOM_S", 1.0)
  stuck = (
    "import sys, time\n"
    "print('W bfc_allocator.cc:598] Allocator (GPU_0_bfc) ran out of memory trying to allocate "
    "73.82GiB', file=sys.stderr, flush=True)\n"
    "print('E rendezvous.cc:116] [id=1] This thread has been waiting for 10 seconds and may be "
    "stuck.', file=sys.stderr, flush=True)\n"
    "time.sleep(60)\n"
  )
  row = bc.run_json_child(_child(stuck), 50)
  assert row["error"].startswith("out of device memory on one GPU, the others stuck"), row
  assert "ran out of memory" in row["stderr_tail"]
