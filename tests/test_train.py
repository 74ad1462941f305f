"""Training entry point: loaders, checkpoint round trip, CLI flags and errors."""

import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from scripts import data as data_lib
from scripts import train as train_script
from scripts import training

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def shards(tmp_path):
  """Three 1-D uint16 token shards; shard i holds i*10000 + 0..(999 + 10 i)."""
  for i in range(3):
    np.save(tmp_path / f"shard_{i}.npy", (np.arange(1000 + 10 * i) + 10000 * i).astype(np.uint16))
  return str(tmp_path / "*.npy")


def _check_windows(batch, length):
  assert batch.dtype == np.int32 and batch.shape[1] == length
  for row in batch:  # every row is one contiguous window of one shard
    np.testing.assert_array_equal(np.diff(row), 1)
    assert row[0] // 10000 == row[-1] // 10000


def test_memmap_loader(shards):
  loader = data_lib.MemmapLoader(shards, batch=4, length=17, seed=3, prefetch=2)
  try:
    batches = [next(loader) for _ in range(5)]
  finally:
    loader.close()
  for b in batches:
    _check_windows(b, 17)
    assert b.shape == (4, 17)
  np.testing.assert_array_equal(batches[3], loader.batch_at(3))  # deterministic per step
  resumed = data_lib.MemmapLoader(shards, batch=4, length=17, seed=3, start_step=3)
  np.testing.assert_array_equal(next(resumed), batches[3])
  resumed.close()
  # 2-D shards are read as a token stream
  d = os.path.dirname(shards)
  np.save(os.path.join(d, "two_d.npy"), np.arange(64, dtype=np.int32).reshape(4, 16))
  assert next(data_lib.MemmapLoader(os.path.join(d, "two_d.npy"), 2, 20)).shape == (2, 20)


def test_memmap_loader_errors(tmp_path, shards):
  with pytest.raises(data_lib.DataError, match="no data files match"):
    data_lib.MemmapLoader(str(tmp_path / "missing" / "*.npy"), 2, 8)
  os.makedirs(tmp_path / "f")
  np.save(tmp_path / "f" / "float.npy", np.zeros(100, np.float32))
  with pytest.raises(data_lib.DataError, match="integer"):
    data_lib.MemmapLoader(str(tmp_path / "f" / "*.npy"), 2, 8)
  with pytest.raises(data_lib.DataError, match="window"):
    data_lib.MemmapLoader(shards, 2, 5000)
  with pytest.raises(data_lib.DataError, match="out of range"):
    data_lib.MemmapLoader(shards, 2, 8, vocab_size=100).batch_at(0)


def test_dali_loader(shards):
  pytest.importorskip("nvidia.dali")
  batches = data_lib.make_batches(shards, "dali", batch=4, length=17, vocab_size=1 << 16)
  for _ in range(3):
    b = next(batches)
    assert b.shape == (4, 17)
    _check_windows(b, 17)


def test_synthetic_is_deterministic():
  a = data_lib.synthetic_batches(2, 9, 256, seed=1)
  first = [next(a) for _ in range(3)]
  np.testing.assert_array_equal(
    next(data_lib.synthetic_batches(2, 9, 256, seed=1, start_step=2)), first[2]
  )
  assert first[0].max() < 255


@pytest.mark.slow  # the CLI run-and-restore test keeps a restore in the README's command
def test_checkpoint_restore_next_step_identical(tmp_path):
  run = training.RunConfig(
    model="gpt", batch=4, steps=10, locations="qkv=nvme,mlp_up=nvme", min_bytes=0
  )
  cfg = run.model_config()
  batches = data_lib.synthetic_batches(run.batch, run.example_length(cfg), cfg.vocab_size)
  data = [next(batches) for _ in range(4)]
  step, rng = jax.jit(training.train_step), jax.random.key(7)
  state, _, _ = training.create_train_state(run)
  for b in data[:3]:
    state, _ = step(state, b, rng)
  manager = training.checkpoint_manager(str(tmp_path / "ckpt"))
  training.save_checkpoint(manager, state)
  _, expected = step(state, data[3], rng)

  fresh, _, _ = training.create_train_state(training.RunConfig(**{**run.__dict__, "seed": 99}))
  restored = training.restore_checkpoint(training.checkpoint_manager(str(tmp_path / "ckpt")), fresh)
  assert int(restored.step) == 3
  _, got = step(restored, data[3], rng)
  assert float(got["loss"]) == float(expected["loss"])


def test_cli_default_offload_run_and_restore(tmp_path):
  work = str(tmp_path / "work")
  flags = [
    "--model",
    "gpt",
    "--preset",
    "tiny",
    "--batch",
    "4",
    "--locations",
    "layer_in=nvme,qkv=nvme,attn=nvme,mlp_up=nvme",
    "--workdir",
    work,
    "--store-dir",
    str(tmp_path / "store"),
  ]
  s = train_script.main(flags + ["--steps", "6", "--checkpoint-every", "3"])
  assert s["steps"] == 6 and s["offload"] and np.isfinite(s["final_loss"])
  assert s["gb_written"] > 0 and s["gb_read"] > 0
  summary = tmp_path / "summary.json"
  s2 = train_script.main(flags + ["--steps", "8", "--restore", "--summary-json", str(summary)])
  assert s2["steps"] == 8
  written = json.loads(summary.read_text())
  assert {k: written[k] for k in s2} == s2 and written["argv"][-1] == str(summary)
  rows = list(csv.DictReader(open(os.path.join(work, "metrics.csv"))))
  assert [int(r["step"]) for r in rows] == list(range(1, 9))


# Three training runs of the CLI (41 s on 2 cores): in .ci/run's slow stage, so that the README's
# test command stays within its 10 minutes. The checkpoint it restores is tested by default in
# test_checkpointing.py and test_optimizer.py.
@pytest.mark.slow
def test_cli_optimizer_state_in_the_store_and_restore(tmp_path):
  import shutil

  # bfloat16 parameters, 2 micro-batches per update (3 updates)
  base = ["--preset", "tiny", "--batch", "2", "--steps", "6", "--accum", "2", "--master-weights"]
  base += ["--store-dir", str(tmp_path / "s")]
  plain = train_script.main(base)
  work = tmp_path / "work"
  flags = base + ["--optimizer-location", "host,nvme", "--optimizer-in-place"]
  ours = train_script.main(flags + ["--workdir", str(work), "--checkpoint-every", "2"])
  assert plain["optimizer_location"] == "device" and ours["optimizer_location"] == "host,nvme"
  # tx's state streamed through the store (one version, updated in place); the losses are tx's
  # on the device to a few ulps
  assert ours["gb_read"] > plain["gb_read"] and ours["gb_written"] > plain["gb_written"]
  np.testing.assert_allclose(ours["final_loss"], plain["final_loss"], rtol=1e-4)
  # Resume from step 4's checkpoint (the state written from the store, read back into it):
  # the same last loss as never stopping.
  shutil.rmtree(work / "checkpoints" / "6")
  resumed = train_script.main(flags + ["--workdir", str(work), "--restore"])
  assert resumed["final_loss"] == ours["final_loss"]


@pytest.mark.slow  # the planner's own test of the decision stays in the README's command
def test_cli_optimizer_location_auto_weighs_the_device(capsys):
  # auto keeps the state on the device when the compiled step fits the budget with it there,
  # else leaves it to the store's choice of tier (train.py's summary names where it went: the
  # CLI test above).
  flags = ["--preset", "tiny", "--batch", "2", "--steps", "2", "--optimizer-location", "auto"]
  run = training.RunConfig(preset="tiny", batch=2, steps=2, optimizer_location="auto")
  cfg = train_script.parse_config(flags + ["--memory-budget", "10GB"])
  roomy = train_script.place_optimizer(run, cfg)
  assert "optimizer state: on the device (the step takes" in capsys.readouterr().out
  assert roomy.optimizer_location is None and roomy.batch == run.batch
  cfg = dataclasses.replace(cfg, memory_budget=64 << 10)
  assert train_script.place_optimizer(run, cfg) is run
  out = capsys.readouterr().out
  assert "optimizer state: in the store (the step takes" in out and "budget 0.1 MiB" in out
  if jax.default_backend() == "cpu":  # no memory limit to weigh the state against
    cfg = dataclasses.replace(cfg, memory_budget=None)
    assert train_script.place_optimizer(run, cfg) is run
    assert "no device memory limit" in capsys.readouterr().out


def test_progress_bar_counts_every_step(tmp_path, capsys):
  # Each refresh of the bar that shows a step's loss shows that step's count: 1/5 ... 5/5 (a
  # bar iterating the range kept showing 1/5 while the losses of later steps were logged).
  train_script.main(
    ["--steps", "5", "--batch", "2", "--log-every", "1", "--store-dir", str(tmp_path / "s")]
  )
  frames = re.split(r"[\r\n]", capsys.readouterr().err)
  counts = {}  # loss shown -> the counts shown beside it
  for frame in frames:
    shown = re.search(r"\b(\d+)/5\b.*loss=([\d.]+)", frame)
    if shown:
      counts.setdefault(shown[2], set()).add(int(shown[1]))
  assert len(counts) == 5, frames
  assert sorted(min(c) for c in counts.values()) == [1, 2, 3, 4, 5], counts


@pytest.mark.slow
def test_cli_memmap_data(tmp_path, shards, capsys):
  os.makedirs(tmp_path / "small")
  for i in range(2):
    np.save(tmp_path / "small" / f"{i}.npy", (np.arange(500) % 200).astype(np.int32))
  flags = [
    "--model",
    "bert",
    "--batch",
    "2",
    "--steps",
    "2",
    "--remat-policy",
    "remat",
    "--seq-len",
    "16",
  ]
  s = train_script.main(flags + ["--data", str(tmp_path / "small" / "*.npy")])
  assert s["steps"] == 2 and np.isfinite(s["final_loss"]) and not s["offload"]
  with pytest.raises(SystemExit):  # ids up to 20999 do not fit tiny's vocabulary of 256
    train_script.main(flags + ["--data", shards])
  assert "out of range" in capsys.readouterr().err


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--locations", "qkv=ssd"], "unknown location"),
    (["--locations", "foo=nvme"], "unknown tag"),
    (["--locations", "qkv"], "TAG=LOCATION"),
    (["--locations", ""], "expected TAG=LOCATION[,TAG=LOCATION...] (e.g. layer_in=nvme), got ''"),
    (["--locations", " , "], "leave --locations out"),
    (["--batch", "0"], "must be > 0"),
    (["--steps", "x"], "expected a int"),
    (["--preset", "huge"], "invalid choice"),
    (["--model", "llama2"], "invalid choice"),
    (["--remat-policy", "sometimes"], "invalid choice"),
    (["--loader", "tfrecord"], "invalid choice"),
    (["--data", "/nonexistent/tokens.npy"], "no such file"),
    (["--data", "/nonexistent/*.npy"], "no data files match"),
    (["--restore"], "--restore needs --workdir"),
    (["--optimizer-in-place"], "optimizer_in_place needs optimizer_location"),
    (
      ["--memory-budget", "1GB"],
      "--memory-budget needs --policy auto, --optimizer-location auto or --stream-layers auto",
    ),
    (["--accum-dtype", "bfloat16"], "--accum-dtype needs --accum K > 1"),
    (["--accum", "0"], "must be > 0"),
    (["--seq-len", "4096"], "exceeds the preset's max_len"),
    (["--mesh", "dp=64"], "--mesh: a mesh of 64 devices: there are only"),
    (["--devices", "0"], "--devices needs --mesh"),
    (["--mesh", "dp=2", "--devices", "0,x"], "expected device ids like 0,1"),
    (["--mesh", "dp=1", "--devices", "4096"], "--devices: no device 4096; there are"),
    (["--mesh", "dp=1", "--devices", "0,0"], "distinct device ids"),
    (["--model", "bert", "--stream-layers", "host"], "not --model bert"),
    (["--stream-layers", "host", "--mesh", "dp=1"], "does not go with --mesh"),
    (["--stream-layers", "host", "--policy", "auto", "--master-weights"], "--policy, --master-"),
    (["--stream-layers", "host", "--preset", "gpt-13b"], "does not fit"),
  ],
)
def test_cli_errors(flags, message, capsys):
  with pytest.raises(SystemExit) as e:
    train_script.main(flags)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


# Four training runs of the CLI (about 45 s on 2 cores): in .ci/run's slow stage, so that the
# README's test command stays within its 10 minutes (test_layer_stream.py tests the same
# equality by default, through the library).
@pytest.mark.slow
def test_cli_stream_layers_equals_the_device_and_streams(tmp_path):
  # The GPT's stack streamed from the host tier and from the files: the same losses and gradient
  # norms, bit for bit, as the same programs with every stack on the device; in place too.
  base = ["--preset", "tiny", "--layers", "3", "--batch", "2", "--seq-len", "16", "--steps", "2"]
  base += ["--accum", "2", "--accum-dtype", "bfloat16", "--log-every", "1"]
  runs = {}
  for loc in ("device", "host", "nvme"):
    runs[loc] = train_script.main(base + ["--stream-layers", loc, "--store-dir", str(tmp_path)])
  in_place = train_script.main(
    base + ["--stream-layers", "host", "--optimizer-in-place", "--store-dir", str(tmp_path)]
  )
  want = runs["device"]
  assert want["gb_written"] == 0 and np.isfinite(want["losses"]).all()
  for got in (runs["host"], runs["nvme"], in_place):
    assert got["losses"] == want["losses"]
    assert got["gb_written"] > 0 and got["gb_read"] > 0  # it went through the store
  assert want["losses"][1] < want["losses"][0]


@pytest.mark.slow  # two training runs of the CLI (~20 s on 2 cores)
def test_cli_stream_layers_auto_chooses_and_says_so(tmp_path, capsys):
  # --stream-layers auto: the device where the step fits --memory-budget with the stack there,
  # else the host tier (which holds it); the choice printed; the same losses bit for bit.
  base = ["--preset", "tiny", "--layers", "3", "--batch", "2", "--seq-len", "16", "--steps", "2"]
  base += ["--stream-layers", "auto", "--store-dir", str(tmp_path)]
  fits = train_script.main(base + ["--memory-budget", "1GB"])
  assert "layer stack: device (the step takes" in capsys.readouterr().out
  tight = train_script.main(base + ["--memory-budget", "1MB"])
  out = capsys.readouterr().out
  # every class on the device is refused by its bytes alone (2.6 MiB), not compiled
  assert "layer stack: host (at least " in out and "the step takes " in out, out
  assert "fits host_tier_bytes" in out, out
  assert fits["gb_written"] == 0 and tight["gb_written"] > 0
  assert tight["losses"] == fits["losses"]
  # each class placed by hand: the parameters on the device, the sum in the host tier, the
  # state in the files (--stream-sum, --stream-state); the same losses
  apart = base[: base.index("--stream-layers")] + ["--store-dir", str(tmp_path)]
  apart += ["--stream-layers", "device", "--stream-sum", "host", "--stream-state", "nvme"]
  split = train_script.main(apart)
  out = capsys.readouterr().out
  assert "(params device, grad_sum host, optimizer_state nvme)" in out, out
  assert "layer stream: read-ahead prefetch_bytes " in out  # sized from the layer
  assert split["losses"] == fits["losses"] and split["gb_written"] > 0
  assert (split["stream_sum"], split["stream_state"]) == ("host", "nvme")
  with pytest.raises(SystemExit):  # auto places every class itself
    train_script.main(base + ["--stream-sum", "host"])


@pytest.mark.slow  # ~21 s: the layer stream's resume stays in the README's command through
# test_layer_stream_checkpoint.py's resume_equals_never_stopping
def test_cli_stream_layers_resume_equals_never_stopping(tmp_path):
  # Checkpoints of the streamed stack, its optimizer state and the side's (every 2 steps, Orbax
  # through jax_ssdtrain.checkpointing): resumed from step 2, steps 3 and 4 are those of the run
  # that never stopped, bit for bit.
  import shutil

  base = ["--preset", "tiny", "--layers", "2", "--batch", "2", "--seq-len", "16", "--steps", "4"]
  base += ["--stream-layers", "host", "--store-dir", str(tmp_path / "s")]
  work = tmp_path / "work"
  straight = train_script.main(base + ["--workdir", str(work), "--checkpoint-every", "2"])
  assert sorted(os.listdir(work / "checkpoints")) == ["2", "4"]
  shutil.rmtree(work / "checkpoints" / "4")
  resumed = train_script.main(base + ["--workdir", str(work), "--restore"])
  assert resumed["losses"] == straight["losses"][2:]
  with pytest.raises(SystemExit):  # nothing to restore
    train_script.main(base + ["--workdir", str(tmp_path / "empty"), "--restore"])


@pytest.mark.gpu
def test_gpu_gpt_small_offload_matches_device():
  run = dict(model="gpt", preset="small", batch=2, seq_len=512, min_bytes=0)
  tags = "layer_in={0},qkv={0},attn={0},mlp_up={0}"
  out = {}
  for loc in ("nvme", "device"):
    state, _, _ = training.create_train_state(training.RunConfig(locations=tags.format(loc), **run))
    b = next(data_lib.synthetic_batches(2, 513, 50304, 0))
    _, m = jax.jit(training.train_step)(state, b, jax.random.key(0))
    out[loc] = float(m["loss"])
  np.testing.assert_allclose(out["nvme"], out["device"], rtol=1e-3)


@pytest.mark.gpu
def test_gpu_master_weights_leave_the_free_device_memory_in_one_block(tmp_path):
  # create_train_state makes float32 parameters, then their bfloat16 cast: the cast's buffers lie
  # above the float32 ones, whose freed space would stay a hole below them, leaving XLA's pool
  # in two free blocks (the 8B shape at 256K then failed to fit its 99 GiB temporary buffer in a
  # 133 GiB pool). With the state in the host tier nothing else is left on the device: its free
  # memory is one block but for the hole's remainder (float32 less bfloat16: half the hole).
  script = f"""
import json, jax
import jax_ssdtrain as ssd
from scripts import training
ssd.configure(directory={str(tmp_path)!r})
run = training.RunConfig(model="gpt", preset="small", batch=1, seq_len=64, master_weights=True,
                         optimizer_location="host")
state, _, _ = training.create_train_state(run)
f32 = sum(4 * x.size for x in jax.tree.leaves(state.params))
s = jax.devices()[0].memory_stats()
print(json.dumps(dict(f32=f32, free=s["bytes_limit"] - s["bytes_in_use"],
                      largest=s["largest_free_block_bytes"])))
"""
  done = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600
  )
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  print(got)
  # without the move: at least the float32 parameters' bytes short of one block
  assert got["free"] - got["largest"] <= got["f32"] // 2 + (64 << 20), got
