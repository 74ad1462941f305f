"""The planner at long context (jax_ssdtrain/_src/planner/long_context.py) on the CPU: the byte
arithmetic of Llama 3 8B at 256K tokens against hand numbers, a sequence too long for its
budget refused with the arithmetic before anything compiles, and the planner's choice of
locations and chunk counts for the tiny preset under a small budget, compiled within it."""

import jax
import jax.numpy as jnp
import pytest

import jax_ssdtrain as ssd
import models
from jax_ssdtrain._src.planner import (
  LongContextError,
  Profile,
  TagProfile,
  check_long_context,
  long_context_bytes,
)
from models import llama
from models.common import SplitPolicy

GB = 10**9


# ----------------------------------------------------------------------------- arithmetic
def test_llama3_8b_at_256k_matches_hand_numbers():
  cfg = models.get_config("llama", "llama3-8b")
  S = 262144
  ar = long_context_bytes(cfg, S, 1, mlp_chunks=32, loss_chunks=64, param_dtype="bfloat16")
  tags = dict(ar.tag_bytes)
  # bfloat16 activations: H = 4096, N = 32, K = 8, D = 128, F = 14336, V = 128256, L = 32
  assert tags["layer_in"] == 2 * S * 4096 == 2_147_483_648  # 2 S H
  assert tags["qkv"] == 2 * S * (32 + 2 * 8) * 128 == 3_221_225_472
  assert tags["attn"] == 2 * S * 32 * 128 == 2_147_483_648
  assert tags["mlp_up"] == 2 * S * 2 * 14336 == 15_032_385_536
  assert ar.mlp_chunk_bytes == 2 * (S // 32) * 2 * 14336 == 469_762_048
  assert ar.loss_chunk_bytes == 4 * (S // 64) * 128256 == 2_101_346_304
  assert ar.attention_bytes == 3_221_225_472 + 2_147_483_648
  assert ar.parameters == llama.parameter_count(cfg) == 8_030_261_248
  assert ar.param_bytes == 4 * 8_030_261_248  # bfloat16 parameters and gradients
  # the layer inputs on the device, the rest recomputed: 32 x 2 S H resident
  assert ar.resident_tag_bytes == 32 * 2_147_483_648
  assert ar.floor_bytes == 32 * 2_147_483_648 + 4 * 8_030_261_248 + 5_368_709_120
  # the layer inputs in the host tier: nothing of theirs on the device, all of them stored
  off = long_context_bytes(
    cfg, S, 1, mlp_chunks=32, loss_chunks=64, locations={"layer_in": "host"}, param_dtype="bfloat16"
  )
  assert off.resident_tag_bytes == 0
  assert dict(off.store_bytes)["host"] == 32 * 2_147_483_648
  # a split: the last 8 layers keep their inputs on the device
  split = long_context_bytes(cfg, S, 1, locations={"layer_in": "nvme"}, offload_layers=24)
  assert split.resident_tag_bytes == 8 * 2_147_483_648
  assert dict(split.store_bytes)["nvme"] == 24 * 2_147_483_648


def test_the_8b_at_256k_fits_an_h200_only_with_chunks_and_offload():
  cfg = models.get_config("llama", "llama3-8b")
  room = dict(budget_bytes=139 * GB, host_tier_bytes=96 * GB, disk_free_bytes=60 * GB)
  good = dict(mlp_chunks=32, loss_chunks=64, locations={"layer_in": "host,nvme"})
  ar = check_long_context(cfg, 262144, 1, **room, **good, param_dtype="bfloat16")
  assert ar.floor_bytes < 139 * GB
  with pytest.raises(LongContextError) as e:  # the whole [S, vocab] float32 logits: 134 GB
    check_long_context(cfg, 262144, 1, **room, mlp_chunks=32, param_dtype="bfloat16")
  text = str(e.value)
  assert "134.49 GB" in text and "loss_chunks >= " in text and "offload the layer inputs" in text


def test_too_long_a_sequence_is_refused_with_the_numbers():
  cfg = models.get_config("llama", "tiny")
  S = 1 << 20
  with pytest.raises(LongContextError) as e:
    check_long_context(cfg, S, 1, budget_bytes=64 << 20, mlp_chunks=64, loss_chunks=64)
  text = str(e.value)
  layer_in = 2 * S * 64  # 2 S H, bfloat16
  assert f"{layer_in:,} bytes a layer" in text
  assert "exceeds the budget 67.1 MB" in text
  assert "offload the layer inputs" in text and "a shorter sequence" in text
  assert e.value.arithmetic.floor_bytes > 64 << 20
  # the store too small for the layer inputs: refused, naming the host tier's room
  with pytest.raises(LongContextError, match=r"more than its room 10\.0 MB"):
    check_long_context(
      cfg, S, 1, budget_bytes=1 << 40, host_tier_bytes=10**7, locations={"layer_in": "host"}
    )

  # the planner refuses it before calling the profile or compiling anything
  def never(*_):
    raise AssertionError("refused sequences must not be profiled or compiled")

  with pytest.raises(LongContextError, match="cannot fit"):
    ssd.plan_long_context(cfg, S, 1, 64 << 20, never, never, chunk_options=[(64, 64)])


def test_bad_arguments_name_themselves():
  cfg = models.get_config("llama", "tiny")
  with pytest.raises(ValueError, match="seq_len"):
    long_context_bytes(cfg, 0)
  with pytest.raises(ValueError, match="locations: unknown tag 'mlp'"):
    long_context_bytes(cfg, 16, locations={"mlp": "host"})
  with pytest.raises(ValueError, match=r"chunk_options\[0\]"):
    ssd.plan_long_context(cfg, 16, 1, 1 << 30, None, None, chunk_options=[(0, 1)])


# ----------------------------------------------------------------------------- the choice
S = 512


def _cfg(mlp_chunks, loss_chunks):
  # float32 compute, a wide MLP and vocabulary: the MLP's and the loss's chunks matter
  return models.get_config(
    "llama",
    "tiny",
    vocab_size=4096,
    mlp_dim=1024,
    mlp_chunks=mlp_chunks,
    loss_chunks=loss_chunks,
    dtype="float32",
  )


def test_the_planner_picks_chunks_and_locations_within_a_small_budget():
  budget = 26 << 20
  # measured rates, stated: recomputing costs, the link is fast, the disk slow
  profile = Profile(
    num_layers=2,
    forward_s=1e-3,
    backward_s=2e-3,
    tags=(
      TagProfile("layer_in", 0, 0.0),
      TagProfile("qkv", 0, 3e-4),
      TagProfile("attn", 0, 5e-4),
      TagProfile("mlp_up", 0, 4e-4),
    ),
    write_gbps=1.0,
    read_gbps=1.0,
    host_gbps=50.0,
    staging_bytes=64 << 20,
    host_tier_bytes=1 << 30,
    input_tag="layer_in",
  )
  measured = {}

  def memory(m, lc, plan):  # XLA's device memory of the step as configured
    cfg = _cfg(m, lc)
    first, rest = plan.policies()
    model = llama.Llama(cfg, SplitPolicy(first, rest, plan.offload_layers))
    tokens = jax.ShapeDtypeStruct((1, S + 1), jnp.int32)
    init = lambda r: llama.Llama(cfg).init(r, jnp.zeros((1, S + 1), jnp.int32), None, method="loss")  # noqa: E731
    params = jax.eval_shape(lambda r: init(r)["params"], jax.random.key(0))
    loss = lambda p, t: model.apply({"params": p}, t, method="loss")[0]  # noqa: E731
    ma = jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis()
    measured[(m, lc, plan.offload_layers, plan.locations)] = ma.temp_size_in_bytes
    return ma.temp_size_in_bytes

  plan = ssd.plan_long_context(
    _cfg(1, 1),
    S,
    1,
    budget,
    lambda m, lc: profile,
    memory,
    chunk_options=[(1, 1), (4, 4)],
    params_on_device=False,  # the memory function measures temporaries only
    min_bytes=0,
    max_compiles=2,
  )
  chosen = plan.model_options()
  offloads = any(loc.value in ("host", "nvme") for _, loc in plan.locations)
  # the link as fast as the compute: every tag in the host tier costs nothing predicted
  assert offloads and plan.offload_layers == 2, plan
  assert chosen == {"mlp_chunks": 4, "loss_chunks": 4}  # the whole loss's logits do not fit
  # its plan compiled within the budget, the staging arena counted
  temp = measured[(4, 4, plan.offload_layers, plan.locations)]
  assert plan.measured_device_bytes == temp + plan.staging_bytes <= budget
  assert plan.step_s > 0 and plan.step_s >= plan.baseline_s
  assert "model options: loss_chunks=4, mlp_chunks=4" in str(plan)
  # the unchunked step was compiled, and did not fit with its staging arena
  assert any(m == 1 for m, *_ in measured)
  assert all(v + plan.staging_bytes > budget for (m, *_), v in measured.items() if m == 1)


# ----------------------------------------------------------------------------- the benchmark
def test_the_benchmark_refuses_a_row_before_compiling(tmp_path):
  from scripts import bench_long_context as blc

  assert blc._plan_chunks("16/32,32/64") == [(16, 32), (32, 64)]
  with pytest.raises(ValueError, match="--plan-chunks"):
    blc._plan_chunks("16-32")
  cfg = models.get_config("llama", "tiny")
  spec = dict(seq=1 << 16, store_dir=str(tmp_path))
  with pytest.raises(LongContextError, match="cannot fit"):
    blc._check_fits(spec, "remat", cfg, 10**7, None)
  # a host tier of 1 MiB cannot hold the layer inputs; the files have room (the store is this
  # test's own: another test's store would lend its host tier)
  with ssd.configured(tmp_path / "store", host_tier_bytes=1 << 20):
    with pytest.raises(LongContextError, match="the tags in host need 16.8 MB"):
      blc._check_fits(spec, "ours_host_layer_in", cfg, 10**9, "host")
    blc._check_fits(spec, "ours_nvme_layer_in", cfg, 10**9, "host")  # fits: no error
