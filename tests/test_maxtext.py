"""MaxText (its own model, config and trainer) with SSD offload through jax_ssdtrain.maxtext.

The runs need MaxText (Python >= 3.12, `pip install "jax_ssdtrain[maxtext]"`) and take about a
minute each on CPU: they are `slow` and skip, saying why, where MaxText cannot be imported.
Losses of 3 steps are compared bit for bit with MaxText saving the same tags on the device:
equal losses after two optimizer updates need equal gradients.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from _limits import HANG_S

import jax_ssdtrain.maxtext as ssd_maxtext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HAVE_MAXTEXT = importlib.util.find_spec("maxtext") is not None
needs_maxtext = pytest.mark.skipif(
  not HAVE_MAXTEXT,
  reason="MaxText is not installed (needs Python >= 3.12: pip install 'jax_ssdtrain[maxtext]')",
)


def run(tmp_path, mode, devices=1, *extra):
  out = tmp_path / mode
  out.mkdir()
  env = dict(
    os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
  )
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(HERE, "_maxtext_worker.py"),
      mode,
      str(devices),
      str(out),
      *extra,
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=HANG_S,
  )
  assert proc.returncode == 0, proc.stderr[-6000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def same_run(tmp_path, devices=1, *extra, location="nvme"):
  ours = run(tmp_path, location, devices, *extra)
  device = run(tmp_path, "device", devices, *extra)
  assert len(ours["losses"]) == 3 and ours["losses"] == device["losses"], (ours, device)
  assert ours["stats"]["tensors_written"] > 0 and ours["stats"]["bytes_read"] > 0, ours
  assert device["stats"]["tensors_written"] == 0, device
  assert ours["stats"]["live_entries"] == 0, ours  # every step's tensors released
  return ours


@pytest.mark.slow
@needs_maxtext
@pytest.mark.parametrize("scan", ["true", "false"])
def test_train_main_losses_equal_device_saving(tmp_path, scan):
  ours = same_run(tmp_path, 1, f"scan_layers={scan}")
  # every step stores the same tags of both layers, each loaded once
  assert ours["stats"]["tensors_written"] % (3 * 2) == 0, ours
  assert ours["stats"]["bytes_read"] == ours["stats"]["bytes_written"], ours


@pytest.mark.slow
@needs_maxtext
def test_host_tier(tmp_path):
  ours = same_run(tmp_path, 1, location="host")
  assert ours["stats"]["host_tier_bytes_peak"] > 0, ours


@pytest.mark.slow
@needs_maxtext
def test_fsdp_on_4_devices(tmp_path):
  same_run(tmp_path, 4, "ici_fsdp_parallelism=4")


@pytest.mark.slow
@needs_maxtext
def test_gradient_accumulation(tmp_path):
  same_run(tmp_path, 1, "gradient_accumulation_steps=2")


@pytest.mark.slow
@needs_maxtext
def test_pipeline_parallelism(tmp_path):
  # The pipeline wraps the policy with save_from_both_policies: composition with ours.
  same_run(
    tmp_path,
    2,
    "ici_pipeline_parallelism=2",
    "num_pipeline_microbatches=2",
    "per_device_batch_size=2",
  )


@pytest.mark.slow
@needs_maxtext
def test_launcher_runs_train_main(tmp_path):
  out = tmp_path / "launch"
  import maxtext

  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  env = dict(
    os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jax_ssdtrain.maxtext",
      "--ssd-location",
      "host",
      "--ssd-min-bytes",
      "0",
      "--ssd-dir",
      str(tmp_path / "store"),
      "--ssd-optimizer",
      "host",
      "--ssd-optimizer-min-bytes",
      "0",
      base,
      "run_name=l",
      f"base_output_directory={out}",
      "dataset_type=synthetic",
      "steps=2",
      "per_device_batch_size=1",
      "max_target_length=32",
      "base_emb_dim=64",
      "base_num_query_heads=4",
      "base_num_kv_heads=4",
      "base_mlp_dim=128",
      "base_num_decoder_layers=2",
      "head_dim=16",
      "vocab_size=256",
      "enable_checkpointing=false",
      "enable_goodput_recording=false",
      f"metrics_file={tmp_path / 'm.jsonl'}",
      "remat_policy=custom",
      "decoder_layer_input=offload",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=HANG_S,
  )
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
@needs_maxtext
def test_optimizer_state_in_store_fsdp_scan_gradient_accumulation(tmp_path):
  # --ssd-optimizer host against device (offload_optimizer's reference: the same streamed program,
  # the state on the devices): bit for bit; MaxText's own optimizer within float32 rounding.
  # Scanned layers, FSDP over 4 CPU devices, 2 micro-batches per step.
  extra = ("scan_layers=true", "ici_fsdp_parallelism=4", "gradient_accumulation_steps=2")
  ours = run(tmp_path, "device", 4, "--optimizer=host", *extra)
  (tmp_path / "device").rename(tmp_path / "host")
  reference = run(tmp_path, "device", 4, "--optimizer=device", *extra)
  (tmp_path / "device").rename(tmp_path / "reference")
  maxtext_own = run(tmp_path, "device", 4, *extra)
  assert len(ours["losses"]) == 3 and ours["losses"] == reference["losses"], (ours, reference)
  assert maxtext_own["optimizer"] is None
  for a, b in zip(ours["losses"], maxtext_own["losses"]):
    assert abs(a - b) <= 1e-5 * abs(b), (ours, maxtext_own)
  # Adam's mu and nu of every parameter in the store, each device its block: handles
  # uint32[devices, chunks, 2]; the counts on the devices. The reference keeps the moments.
  opt = ours["optimizer"]
  assert opt["handles"] > 0 and opt["handles"] == opt["leaves"] - 2, opt
  assert opt["handle_shapes"] == ["(4, 1, 2)"], opt
  assert reference["optimizer"]["handles"] == 0, reference
  assert ours["stats"]["tensors_written"] > 0 and ours["stats"]["host_tier_bytes_peak"] > 0, ours
  # the last state's entries (each leaf's block on each device) are all that is left
  assert ours["stats"]["live_entries"] == 4 * opt["handles"], ours
  assert reference["stats"]["tensors_written"] == 0, reference


# MaxText's own checkpoints with the optimizer state in our store: the schedule's length is
# fixed (learning_rate_schedule_steps=4: MaxText's default is `steps`, which the first run of a
# resumed pair sets to 2), MaxText saves at the end (save_checkpoint_on_completion) and a run with
# the same base_output_directory and run_name resumes from the latest step (async_checkpointing,
# MaxText's default, is on).
CHECKPOINTED = (
  "scan_layers=true",
  "ici_fsdp_parallelism=4",
  "enable_checkpointing=true",
  "skip_jax_distributed_system=true",
  "learning_rate_schedule_steps=4",
)


def _resumed(tmp_path, optimizer):
  """2 steps with checkpoints, then a run of ``steps=4`` resuming from them: (losses of both,
  the checkpoints' directory, the second run)."""
  first = run(tmp_path, "device", 4, f"--optimizer={optimizer}", *CHECKPOINTED, "steps=2")
  out = tmp_path / f"{optimizer}-first"
  (tmp_path / "device").rename(out)
  second = run(
    tmp_path,
    "device",
    4,
    f"--optimizer={optimizer}",
    *CHECKPOINTED,
    "steps=4",
    f"base_output_directory={out / 'out'}",
  )
  (tmp_path / "device").rename(tmp_path / f"{optimizer}-second")
  assert len(first["losses"]) == 2 and len(second["losses"]) == 2, (first, second)
  return first["losses"] + second["losses"], out / "out" / "t" / "checkpoints", second


def _uninterrupted(tmp_path, optimizer):
  ours = run(tmp_path, "device", 4, f"--optimizer={optimizer}", *CHECKPOINTED[:2], "steps=4")
  (tmp_path / "device").rename(tmp_path / f"{optimizer}-uninterrupted")
  assert len(ours["losses"]) == 4, ours
  return ours["losses"]


@pytest.mark.slow
@needs_maxtext
def test_optimizer_state_in_store_maxtext_checkpoints_resume_bit_for_bit(tmp_path):
  # --ssd-optimizer host, FSDP over 4 CPU devices, scanned layers: 2 steps + 2 resumed from
  # MaxText's checkpoint give the losses of 4 steps bit for bit.
  losses, checkpoints, second = _resumed(tmp_path, "host")
  assert losses == _uninterrupted(tmp_path, "host")
  assert second["stats"]["tensors_written"] > 0 and second["stats"]["live_entries"] > 0, second
  # steps 0 (save_checkpoint_on_start), 1 (the first run's end) and 3 (the second run's end)
  assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [0, 1, 3]
  step = checkpoints / "1"
  # MaxText's item holds a placeholder where opt_state's handles were, no uint32 handles
  tree = json.loads((step / "items" / "_METADATA").read_text())["tree_metadata"]
  opt = {k: v for k, v in tree.items() if "opt_state" in k}
  assert list(opt) == ["('opt_state',)"], opt
  assert opt["('opt_state',)"]["value_metadata"]["value_type"] == "np.ndarray", opt
  params = {
    k.replace("('params', 'params', ", "").rstrip(")").replace("'", "").replace(", ", "/")
    for k in tree
    if k.startswith("('params', 'params'")
  }
  # ssd_optimizer_state: Adam's moments, float arrays of the parameters' shapes, with values
  import numpy as np
  import tensorstore as ts

  layout = json.loads((step / "ssd_optimizer_state" / "layout.json").read_text())
  (state,) = layout["states"]
  moments = {}
  for i, leaf in enumerate(state["leaves"]):
    path = leaf["path"]
    if ".mu[" not in path and ".nu[" not in path:
      continue
    name = path.split(".", 1)[1][3:].replace("']['", "/").strip("[]'")
    moments.setdefault(path.split(".", 1)[1][:2], {})[name] = leaf
    array = ts.open(
      {
        "driver": "zarr3",
        "kvstore": {
          "driver": "file",
          "path": str(step / "ssd_optimizer_state" / f"state0/leaf{i}"),
        },
      },
      open=True,
    ).result()
    value = array.read().result()
    assert leaf["dtype"] == "float32" and value.dtype == np.float32, leaf
    assert list(value.shape) == leaf["shape"], (leaf, value.shape)
    assert np.isfinite(value).all() and np.abs(value).max() > 0, leaf
  assert sorted(moments) == ["mu", "nu"], sorted(moments)
  assert set(moments["mu"]) == set(moments["nu"]) == params, (sorted(moments["mu"]), params)
  # the model's dimensions (emb 64, 2 scanned layers, mlp 128, vocab 256)
  assert moments["mu"]["decoder/layers/mlp/wi_0/kernel"]["shape"] == [64, 2, 128]
  assert moments["nu"]["token_embedder/embedding"]["shape"] == [256, 64]


@pytest.mark.slow
@needs_maxtext
def test_optimizer_state_on_device_maxtext_checkpoints_resume_as_in_store(tmp_path):
  # --ssd-optimizer device (the reference, the state on the devices) saved and resumed the same
  # way: its 2 + 2 steps equal the 4 steps of --ssd-optimizer host bit for bit.
  losses, checkpoints, _ = _resumed(tmp_path, "device")
  assert losses == _uninterrupted(tmp_path, "host")
  assert (checkpoints / "1" / "ssd_optimizer_state" / "layout.json").exists()


def _run_bench(tmp_path, *args):
  """scripts/bench_maxtext.py --tiny, 3 steps after 1 of warmup, with ``args``: the path of the
  JSON it wrote in ``tmp_path`` and its contents."""
  env = dict(
    os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "scripts.bench_maxtext",
      "--tiny",
      "--steps",
      "3",
      "--warmup",
      "1",
      *args,
      "--store-dir",
      str(tmp_path / "work"),
      "--out",
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=HANG_S,
  )
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
  (path,) = tmp_path.glob("maxtext_*_tiny.json")
  return path, json.loads(path.read_text())


@pytest.mark.slow
@needs_maxtext
def test_bench_maxtext_tiny_with_a_variants_own_store_options(tmp_path):
  # scripts/bench_maxtext.py as the GPU call runs it: each variant in its own process; the
  # second @host variant's own staging arena overrides --ssd's.
  variants = (
    "minimal,minimal_offloaded@host,"
    "minimal_offloaded@host:staging_bytes=32MiB:host_tier_bytes=256MiB"
  )
  _, doc = _run_bench(tmp_path, "--variants", variants, "--ssd", "staging_bytes=16MiB")
  rows = {r["variant"]: r for r in doc["rows"]}
  assert list(rows) == variants.split(","), rows
  device, ours, ours_small = rows.values()
  assert device["store_bytes_per_step"] is None and device["location"] == "maxtext"
  for r in (ours, ours_small):
    assert r["location"] == "host" and r["store_bytes_per_step"] > 0, r
    assert r["last_loss"] == device["last_loss"], (r, device)
  # On CPU there is no GPU staging arena: the configured size is what the store reports.
  assert ours["config_staging_bytes"] == 16 << 20, ours
  assert ours_small["config_staging_bytes"] == 32 << 20, ours_small
  assert ours_small["config_host_tier_bytes"] == 256 << 20, ours_small


@pytest.mark.slow
@needs_maxtext
def test_bench_maxtext_fsdp_on_2_devices(tmp_path):
  # --fsdp 2 as the two-GPU call runs it: each variant on 2 (CPU) devices, MaxText's FSDP over
  # them, our store one directory per device, each device storing its own shards.
  path, doc = _run_bench(tmp_path, "--fsdp", "2", "--variants", "minimal,minimal_offloaded@host")
  assert path.name.endswith("_fsdp2_tiny.json"), path
  assert doc["config"]["fsdp"] == 2
  device, ours = doc["rows"]
  assert device["devices"] == ours["devices"] == 2, doc["rows"]
  assert ours["last_loss"] == device["last_loss"], (ours, device)
  per_device = ours["store_bytes_per_step_per_device"]
  assert sorted(per_device) == ["0", "1"] and all(b > 0 for b in per_device.values()), ours
  assert sum(per_device.values()) == ours["store_bytes_per_step"], ours
  store = tmp_path / "work" / "minimal_offloaded_host" / "store"
  assert sorted(p.name for p in store.iterdir()) == ["gpu0", "gpu1"]


def test_bench_maxtext_rejects_bad_variants():
  from scripts import bench_maxtext

  assert bench_maxtext.parse_variant("minimal_offloaded@host:staging_bytes=2GiB") == (
    "minimal_offloaded",
    "host",
    {"staging_bytes": "2GiB"},
  )
  assert bench_maxtext.parse_variant("full") == ("full", None, {})
  for bad in (
    "minimal@disk",
    "@host",
    "minimal:staging_bytes=1GiB",
    "minimal_offloaded@nvme:staging_bytes",
  ):
    with pytest.raises(Exception, match="variant"):
      bench_maxtext.parse_variant(bad)


# ---------------------------------------------------------------------------------------------
# Fast: what install() patches, and its errors


@needs_maxtext
def test_install_routes_offload_names_and_restores(monkeypatch):
  from maxtext.layers import nnx_decoders
  from maxtext.utils import maxtext_utils

  import jax_ssdtrain as ssd

  original = nnx_decoders.NNXDecoder.get_remat_policy

  class Cfg:  # the fields get_save_and_offload_names reads
    remat_policy = "custom"
    tensors_on_device = ["mlpwo"]
    tensors_to_offload = ["query_proj", "decoder_layer_input"]

  class Decoder:
    config = Cfg()

  ssd_maxtext.install("host", min_bytes=0)
  try:
    policy = nnx_decoders.NNXDecoder.get_remat_policy(Decoder())
    assert isinstance(policy, ssd.OffloadPolicy)
    assert dict(policy.locations) == {
      "query_proj": ssd.Location.HOST,
      "decoder_layer_input": ssd.Location.HOST,
      "mlpwo": ssd.Location.DEVICE,
    }
    assert maxtext_utils.get_save_and_offload_names(Cfg()) == ([], [])  # global layers
    ssd_maxtext.install("nvme")  # replaces, does not stack
    assert (
      dict(nnx_decoders.NNXDecoder.get_remat_policy(Decoder()).locations)["query_proj"]
      is ssd.Location.NVME
    )
  finally:
    ssd_maxtext.uninstall()
  assert nnx_decoders.NNXDecoder.get_remat_policy is original
  assert maxtext_utils.get_save_and_offload_names(Cfg()) == (
    ["mlpwo"],
    ["query_proj", "decoder_layer_input"],
  )


@needs_maxtext
def test_install_optimizer_wraps_maxtexts_optimizer_and_restores():
  import optax
  from maxtext.common import checkpointing
  from maxtext.optimizers import optimizers

  import jax_ssdtrain as ssd

  original = optimizers.get_optimizer
  create_manager = checkpointing.create_orbax_checkpoint_manager

  class Cfg:  # what MaxText's get_optimizer reads for plain sgd, and the refused settings
    opt_type = "sgd"
    skip_step_on_spikes = False
    trainable_parameters_mask = None
    logical_axis_rules = ()
    optimizer_memory_host_offload = False
    enable_emergency_checkpoint = False
    enable_multi_tier_checkpointing = False
    load_full_state_path = ""
    shard_optimizer_over_data = False

  ssd_maxtext.install("host", optimizer="device", optimizer_options={"min_bytes": 0})
  try:
    assert ssd_maxtext.installed()["optimizer"] is ssd.Location.DEVICE
    tx = optimizers.get_optimizer(Cfg(), 0.1)
    import jax.numpy as jnp

    state = tx.init({"w": jnp.ones((4, 4))})
    assert isinstance(state, ssd.OffloadedState) and state.location == "device"
    assert checkpointing.create_orbax_checkpoint_manager is not create_manager
    # MaxText's checkpoints are taken (enable_checkpointing is not refused), not its emergency
    # and multi-tier managers'
    assert checkpointing.create_orbax_checkpoint_manager("", False, False, 1) is None
    bad = Cfg()
    bad.optimizer_memory_host_offload = True
    bad.enable_emergency_checkpoint = True
    with pytest.raises(
      ValueError,
      match=r"optimizer_memory_host_offload=True: .*\| enable_emergency_checkpoint=True: ",
    ):
      optimizers.get_optimizer(bad, 0.1)
    ssd_maxtext.install("host")  # replaces: MaxText's optimizer again
    assert optimizers.get_optimizer is original
    assert checkpointing.create_orbax_checkpoint_manager is create_manager
  finally:
    ssd_maxtext.uninstall()
  assert optimizers.get_optimizer is original
  assert checkpointing.create_orbax_checkpoint_manager is create_manager
  assert isinstance(optimizers.get_optimizer(Cfg(), 0.1), optax.GradientTransformation)
  with pytest.raises(ValueError, match="optimizer: unknown location 'disk'"):
    ssd_maxtext.install(optimizer="disk")
  with pytest.raises(ValueError, match="optimizer: expected 'host'"):
    ssd_maxtext.install(optimizer="remat")
  with pytest.raises(ValueError, match="optimizer_options: unknown"):
    ssd_maxtext.install(optimizer="host", optimizer_options={"mu_dtype": "bf16"})
  with pytest.raises(ValueError, match="without optimizer="):
    ssd_maxtext.install(optimizer_options={"min_bytes": 0})
  assert ssd_maxtext.installed() is None


@needs_maxtext
def test_install_names_what_a_maxtext_release_changed(monkeypatch):
  from maxtext.utils import maxtext_utils

  monkeypatch.setattr(maxtext_utils, "get_save_and_offload_names", lambda cfg, extra: ([], []))
  with pytest.raises(RuntimeError, match=r"get_save_and_offload_names\(cfg, extra\)"):
    ssd_maxtext.install()
  assert ssd_maxtext.installed() is None


def test_install_without_maxtext_says_how(monkeypatch):
  import builtins

  real_import = builtins.__import__

  def no_maxtext(name, *args, **kwargs):
    if name == "maxtext" or name.startswith("maxtext."):
      raise ImportError("No module named 'maxtext'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_maxtext)
  monkeypatch.setattr(ssd_maxtext.importlib, "import_module", lambda name: no_maxtext(name))
  with pytest.raises(ssd_maxtext.MaxTextMissing, match=r"jax_ssdtrain\[maxtext\]"):
    ssd_maxtext.install()
  with pytest.raises(ValueError, match="location"):
    ssd_maxtext.install("device")


# ---------------------------------------------------------------------------------------------
# docs/maxtext.md, "MaxText's optimizer_memory_host_offload": the optimizer state in our store
# under nnx.Optimizer, as a loop of one's own around a MaxText model would build it


def _nnx_losses(make_tx):
  """The losses of 3 nnx.jit steps of a Linear model trained by nnx.Optimizer(model,
  make_tx(adamw), wrt=nnx.Param), and the optimizer."""
  import jax.numpy as jnp
  import optax
  from flax import nnx

  model = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, make_tx(optax.adamw(1e-3)), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss

  x = jnp.ones((8, 256))
  return [float(step(model, opt, x)) for _ in range(3)], opt


def test_nnx_optimizer_takes_offload_optimizer_with_pure_params(tmp_path):
  import optax
  from flax import nnx

  import jax_ssdtrain as ssd

  losses = _nnx_losses

  def in_store(tx):
    offloaded = ssd.offload_optimizer(tx, location="host", min_bytes=1024)
    # nnx.Optimizer passes init the Params (Variables), update plain arrays: init gets them pure
    return optax.GradientTransformationExtraArgs(
      lambda params: offloaded.init(nnx.as_pure(params)), offloaded.update
    )

  with ssd.configured(str(tmp_path / "store"), capacity_bytes=64 << 20):
    _check_nnx_losses(losses, in_store)


def _check_nnx_losses(losses, in_store):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import jax_ssdtrain as ssd

  reference, _ = losses(lambda tx: tx)
  ours, opt = losses(in_store)
  assert ours[0] == reference[0]
  assert jnp.allclose(jnp.array(ours), jnp.array(reference), rtol=1e-5), (ours, reference)
  ssd.flush()
  assert ssd.stats()["tensors_written"] > 0
  # the moments of the kernel are in the store: on the device, only handles
  assert any(
    isinstance(x, ssd.OffloadedState)
    for x in jax.tree.leaves(
      nnx.as_pure(opt.opt_state), is_leaf=lambda x: isinstance(x, ssd.OffloadedState)
    )
  )


def test_nnx_optimizer_takes_offload_optimizer_as_it_is(tmp_path):
  # nnx.Optimizer(model, offload_optimizer(tx), wrt=nnx.Param): init gets the nnx.Param
  # variables, update plain arrays; init reads the variables' values (nnx.as_pure) itself.
  import optax

  import jax_ssdtrain as ssd

  in_store = lambda tx: ssd.offload_optimizer(tx, location="host", min_bytes=1024)  # noqa: E731
  with ssd.configured(str(tmp_path / "store"), capacity_bytes=64 << 20):
    _check_nnx_losses(_nnx_losses, in_store)
    assert isinstance(in_store(optax.adamw(1e-3)), optax.GradientTransformation)
