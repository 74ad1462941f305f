"""Long context on one GPU: a training step of the Llama model at sequence length S, per policy.

    python -m scripts.bench_long_context --preset llama3-8b --seq 131072 \
        --policies remat,jax_host_layer_in,ours_host_layer_in --optimizer device,host \
        [--steps 10 --warmup 1] [--ideal-layers 2,4 | --no-ideal] [--ssd host_tier_bytes=96GiB]
        [--store-dir /var/tmp/lc] [--out DIR]
    python -m scripts.bench_long_context --preset llama3-1b --seq 131072 --find-longest \
        --policies remat,ours_host_nvme_layer_in@host --steps 1 --no-ideal
    python -m scripts.bench_long_context --replot a.json b.json --out DIR   (runs merged)

This script owns the long-context benchmark: a full training step (forward, backward, AdamW
update) of ``models.llama.Llama`` (rotary positions, RMSNorm, SwiGLU in ``mlp_chunks`` sequence
chunks, grouped-query attention, an untied head, the loss in ``loss_chunks`` sequence chunks;
``jax.nn.dot_product_attention``, cuDNN's flash attention on a GPU) on one sequence of S tokens
(batch 1: S + 1 tokens in, S positions through the model), under each policy of ``--policies``:

* ``remat``: JAX alone, each layer recomputed from its input, which is saved on the device
  (``save_only_these_names("layer_in")``);
* ``jax_host_layer_in``: JAX's own offload of the layer inputs to pinned host memory
  (``save_and_offload_only_these_names(..., offload_src="device", offload_dst="pinned_host")``),
  the rest recomputed;
* ``ours_host_layer_in``, ``ours_host_nvme_layer_in``, ``ours_nvme_layer_in``: the layer inputs
  in the store (``ssd.offload_policy(["layer_in"], location=...)``: the host tier, the host tier
  spilling to the files, the files), the rest recomputed.

* ``NAME+attention`` (``remat+attention``, ``ours_host_nvme_layer_in+attention``, ...): the same,
  and cuDNN flash attention's output and softmax statistics saved on the device
  (``ssd.flash_attention_saveable`` as the policy's ``base``): the recomputed layers do not run
  attention's forward pass again (``2·S·N·D + 4·N·S`` bytes a layer on the device);
  ``NAME+attention=K``: in the first K layers only (``models.common.SplitPolicy``: two scans),
  the others recomputing attention.

* ``plan``: ``ssd.plan_long_context``'s choice at the device's budget (``--plan-budget-gb``):
  one layer profiled at S (``ssd.profile``), then each tag's location, the split and the MLP's
  and the loss's chunk counts (``--plan-chunks``), each candidate's step compiled for XLA's
  memory analysis; the row reports the predicted step beside the measured one.

Every row's sequence is first weighed by the planner's arithmetic (``check_long_context``): one
that cannot fit the device or the store fails before anything compiles, with the arithmetic.

A policy takes store options of its own after colons (``ours_host_nvme_layer_in:
host_tier_bytes=24GiB``, as ``scripts/bench_rok.py``'s) and an optimizer placement after ``@``
(``remat@device``); without ``@`` it runs once per placement of ``--optimizer``:

* ``device``: ``optax`` AdamW (``scripts.training.make_optimizer``: global-norm clipping, warm-up
  and cosine decay) under ``ssd.with_master_weights`` (pure JAX: a float32 copy of the
  parameters in the state), the state on the device: what JAX alone runs;
* ``jax_pinned_host``: JAX's own host offload of that state: in pinned host memory between the
  steps, moved to the device for the update and back (``scripts.training``'s
  ``optimizer_location="pinned_host"``, as MaxText's ``optimizer_memory_host_offload``);
* ``host``: the same transformation in the store's host tier
  (``ssd.offload_optimizer(..., location="host")``, updated by ``ssd.apply_gradients``);
* ``streamed_device``: the same streamed program with the state on the device
  (``location="device"``): the reference that ``host`` equals bit for bit.

``--optimizer-in-place`` makes the streamed placements update the state in place (one version
in the store instead of two: what lets the 8B shape's 96 GB of master weights and moments fit
a host of 125 GiB).

Every row has the same arithmetic: bfloat16 parameters (initialised in float32, the master copy
made from them, then cast: ``scripts.training.create_train_state``'s ``master_weights``),
bfloat16 compute, float32 master weights and moments; the policies change only where the layer
inputs wait and what is recomputed, so a row's losses equal those of ``remat`` with the same
optimizer placement bit for bit (``loss_same_as_remat``), and ``host``'s those of
``streamed_device``; ``device`` and the streamed placements agree to a few float32 ulps of the
update (``docs/optimizer.md``, "Exactness"), the first step's loss bit for bit. On a GPU the
comparison holds with ``--deterministic`` (cuDNN attention's backward pass adds in any order
otherwise: rows to time run without it); the script exits 1 where a deterministic row's losses
differ from remat's.

**The ideal** (``--ideal-layers``, default 2 and 4): the same model at the same S with that
many layers, ``--ideal-policy`` (``keep``: no remat; or ``selective``: the four tags saved)
and the optimizer on the device, few enough layers that everything fits on the device; its step
times are extended to the full depth by ``bench_fit.extend_to_depth`` (a least squares line:
bench_fit's and bench_layer_stream's ideal). Each row's ``x_ideal`` is the ideal's step time
over the row's (1.0: as fast as a device with room for everything).

**FLOPs** (model FLOPs: recomputation not counted; per step of B sequences of S positions, L
layers, hidden H, N query heads and K key/value heads of D, MLP F, vocabulary V):

    forward = 2 B S (L (H (N + 2K) D + N D H + 3 H F) + H V) + 2 B L N D S^2
    step    = 3 x forward

the first term every matmul's multiply-adds (the projections, the SwiGLU's three, the head),
the second causal attention's two matmuls (``Q K^T`` and ``P V``, ``2 S^2 N D`` each over the
full square, half of it under the causal mask: the ``S^2 / 2`` pairs of ``S (S + 1) / 2``,
rounded); the backward pass twice the forward. MFU is ``step / step time / --peak-tflops``
(default: the device kind's bf16 dense peak, ``bench_fit.PEAK_TFLOPS``).

**Reported per row**: the median step of ``--steps`` steps after ``--warmup`` (the losses of
every step), tokens/s, MFU, XLA's memory analysis of the compiled step (temp, arguments,
outputs, host temp), the store's staging, host tier, host cache and file peaks and its disk
traffic per step (``ssd.stats()``, ``bench_common.engine_row``), the device's peak bytes in use,
the process's peak resident memory, ``x_ideal``; beside them the disk probe (``python -m
jax_ssdtrain.probe DIR --raw``: O_DIRECT write and read of the store directory through the
engine and raw) and the link probe (``python -m jax_ssdtrain.probe --link``) of the same run.

``--only-ideal`` runs the ideal alone (a call of its own where the rows take one each;
``--replot`` merges the runs: the ideal of one S applies to every run's rows of that S).

``--find-longest``: per policy and placement, S doubles from ``--seq`` (its first value) until
the step fails (out of device memory at compile or run time, a timeout, or ``--max-seq``); the
longest that ran is reported (``longest``), the failures' reasons with it.

Each row runs in a process of its own (device memory starts empty; a row that runs out of it
cannot spoil the next) within ``--timeout`` seconds, cut to what ``--budget-s`` leaves of the
whole run, so that one call of a fixed length always writes its results. Writes OUT/longctx_<device>_<date>.json, .md and (with matplotlib)
.png; ``--merge`` adds the rows to the file of the same name (same row replaced).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as bc
from scripts import bench_fit
from scripts.bench_rok import _option as store_option
from scripts.bench_rok import split_policy

# policy -> (JAX's pinned host, our store's location or None, tags recomputed besides)
POLICIES = {
  "remat": None,
  "jax_host_layer_in": "pinned_host",
  "ours_host_layer_in": "host",
  "ours_host_nvme_layer_in": "host,nvme",
  "ours_nvme_layer_in": "nvme",
  "plan": "plan",  # ssd.plan_long_context's choice: tags, split, mlp_chunks and loss_chunks
}
OPTIMIZERS = {
  "device": None,
  "jax_pinned_host": "pinned_host",
  "host": "host",
  "streamed_device": "device",
}
IDEAL_POLICIES = ("keep", "selective")
TAGS = ("layer_in", "qkv", "attn", "mlp_up")
# --deterministic: cuDNN attention's backward pass (and XLA's scatters) otherwise add in any
# order on a GPU, and two runs of one program differ in the last bits
DETERMINISTIC = "--xla_gpu_exclude_nondeterministic_ops=true"


# ---------------------------------------------------------------------------------------------
# Arithmetic (no JAX)


def step_flops(cfg, seq: int, batch: int = 1) -> float:
  """Model FLOPs of one training step (the module doc's formula): 3 x the forward pass."""
  H, N, K, D, F, V, L = (
    cfg.hidden,
    cfg.num_heads,
    cfg.kv_heads,
    cfg.head_dim,
    cfg.mlp_dim,
    cfg.vocab_size,
    cfg.num_layers,
  )
  matmul = 2 * batch * seq * (L * (H * (N + 2 * K) * D + N * D * H + 3 * H * F) + H * V)
  attention = 2 * batch * L * N * D * seq * seq
  return 3.0 * (matmul + attention)


def chunks_for(seq: int, tokens: int) -> int:
  """Sequence chunks of at most ``tokens`` positions each (1: whole)."""
  return max(1, math.ceil(seq / tokens))


ATTENTION_SUFFIX = "+attention"  # NAME+attention[=K]: flash attention's outputs saved as well


def policy_parts(name: str) -> tuple[str, dict, bool | int]:
  """``"ours_host_nvme_layer_in+attention=20:host_tier_bytes=4GiB"`` -> ``(base, store options,
  where flash attention's outputs are saved)``: False (nowhere), True (every layer) or K (the
  first K layers)."""
  base, options = split_policy(name)
  base, plus, count = base.partition(ATTENTION_SUFFIX)
  if not plus:
    return base, options, False
  if count == "":
    return base, options, True
  layers = count[1:] if count.startswith("=") else ""
  if not layers.isdigit() or int(layers) < 1:
    raise ValueError(
      f"--policies: {name!r}: {ATTENTION_SUFFIX} takes a layer count ({ATTENTION_SUFFIX}=K, "
      "K >= 1) or none (every layer)"
    )
  return base, options, int(layers)


def parse_rows(text: str, optimizers: list[str]) -> list[tuple[str, str]]:
  """``--policies``: ``NAME[:KEY=VALUE...][@OPT]`` items -> ``(policy with its options, OPT)``
  pairs, one per ``optimizers`` where an item names none."""
  out = []
  for item in (t.strip() for t in text.split(",") if t.strip()):
    name, _, opt = item.partition("@")
    base, options, attention = policy_parts(name)
    if base not in POLICIES or (attention and base == "plan"):
      raise ValueError(
        f"--policies: unknown policy {base!r} in {item!r}; use one of {', '.join(POLICIES)}"
      )
    if options and POLICIES[base] not in ("host", "host,nvme", "nvme", "plan"):
      raise ValueError(f"--policies: {item!r}: store options apply to the ours_* policies only")
    for o in [opt] if opt else optimizers:
      if o not in OPTIMIZERS:
        raise ValueError(
          f"--policies: unknown optimizer placement {o!r} in {item!r}; use one "
          f"of {', '.join(OPTIMIZERS)}"
        )
      if (name, o) not in out:
        out.append((name, o))
  if not out:
    raise ValueError(f"--policies: no policy named in {text!r}")
  return out


# ---------------------------------------------------------------------------------------------
# One row, in a process of its own (imports JAX)


def _policy(name: str, min_bytes: int, attention: bool | int = False, layers: int | None = None):
  """The row's remat policy; ``attention`` K (< ``layers``): a SplitPolicy whose first K layers
  save flash attention's outputs besides."""
  if attention is not True and attention and layers is not None and attention < layers:
    from models.common import SplitPolicy

    return SplitPolicy(_policy(name, min_bytes, True), _policy(name, min_bytes), attention)
  attention = bool(attention)  # True, or K of every layer
  import jax

  import jax_ssdtrain as ssd

  cp = jax.checkpoint_policies
  if name == "keep":
    return None
  if name == "selective":
    return cp.save_only_these_names(*TAGS)
  where = POLICIES[name]
  if where in (None, "pinned_host"):
    policy = (
      cp.save_only_these_names("layer_in")
      if where is None
      else cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["layer_in"],
        offload_src="device",
        offload_dst="pinned_host",
      )
    )
    return _saving_attention(policy) if attention else policy
  base = ssd.flash_attention_saveable if attention else None
  return ssd.offload_policy(["layer_in"], min_bytes=min_bytes, location=where, base=base)


def _saving_attention(policy):
  """``policy``, and flash attention's outputs saved on the device (JAX's
  ``save_from_both_policies`` takes boolean policies only; an offloading one answers more)."""
  import jax_ssdtrain as ssd

  def saving_attention(prim, *avals, **params):
    if ssd.flash_attention_saveable(prim, *avals, **params):
      return True
    return policy(prim, *avals, **params)

  return saving_attention


def _run_row(spec: dict, row: dict) -> dict:
  """One row, measured in this process; ``row`` is filled as it goes, so that a row that fails
  keeps what it measured before (its init, compile, the steps it finished)."""
  import resource

  import jax
  import jax.numpy as jnp

  import jax_ssdtrain as ssd
  from scripts import training

  base, options, attention = policy_parts(spec["policy"])
  in_store = base in POLICIES and POLICIES[base] in ("host", "host,nvme", "nvme", "plan")
  opt_loc = OPTIMIZERS[spec["optimizer"]]
  dev = jax.devices()[0]
  row |= dict(device_kind=dev.device_kind, platform=dev.platform, jax=jax.__version__)
  if in_store or opt_loc in ("host",):
    cfg = ssd.configure(directory=spec["store_dir"], **(spec["ssd_options"] | options))
    row["store_config"] = {k: str(v) for k, v in dataclasses.asdict(cfg).items()}
  S = spec["seq"]
  run = training.RunConfig(
    model="llama",
    preset=spec["preset"],
    batch=1,
    seq_len=S + 1,  # the model's positions are the input's but the last (the shifted target)
    steps=spec["warmup"] + spec["steps"],
    warmup=1,
    seed=0,
    min_bytes=spec["min_bytes"],
    optimizer_location=opt_loc,
    optimizer_in_place=bool(spec["in_place"] and opt_loc not in (None, "pinned_host")),
    master_weights=True,
    model_overrides=dict(
      num_layers=spec["layers"],
      mlp_chunks=spec["mlp_chunks"],
      loss_chunks=spec["loss_chunks"],
      **({"attention": spec["attention"]} if spec.get("attention") else {}),
    ),
  )
  cfg = run.model_config()
  row["attention_impl"] = cfg.attention_impl()
  budget = spec.get("plan_budget_bytes") or (dev.memory_stats() or {}).get("bytes_limit")
  if base != "plan" and budget:  # a sequence that cannot fit: refused before anything compiles
    _check_fits(spec, base, cfg, budget, opt_loc)
  t0 = time.perf_counter()
  policy = _policy(
    base if base != "plan" else "remat", spec["min_bytes"], attention, cfg.num_layers
  )
  state, _, _ = training.create_train_state(run, policy=policy)
  jax.block_until_ready(state)
  row["init_s"] = time.perf_counter() - t0
  tokens = jax.random.randint(jax.random.key(7), (1, S + 1), 0, cfg.vocab_size, jnp.int32)
  rng = jax.random.key(0)
  if base == "plan":
    state, planned = _planned(spec, run, state, tokens, rng, budget, opt_loc)
    row |= planned
  row["n_params"] = sum(int(x.size) for x in jax.tree.leaves(state.params))
  t0 = time.perf_counter()
  step = training.jit_train_step().lower(state, tokens, rng).compile()
  row["compile_s"] = time.perf_counter() - t0
  ma = step.memory_analysis()
  for key in ("temp", "argument", "output", "alias", "host_temp"):
    value = getattr(ma, f"{key}_size_in_bytes", None) if ma is not None else None
    row[f"{key}_GB"] = value / 1e9 if value is not None else None
  times, losses = [], []
  row |= dict(steps_done_s=times, steps_done_losses=losses)  # kept by a row that fails
  for i in range(spec["warmup"] + spec["steps"]):
    if i == spec["warmup"] and (in_store or opt_loc == "host"):
      ssd.flush()
      ssd.reset_stats()
    t = time.perf_counter()
    try:
      state, metrics = step(state, tokens, rng)
      jax.block_until_ready(state)
    except Exception:
      row["failed_step"] = i  # counted from 0, warm-up included
      if in_store or opt_loc == "host":  # where the store's room went when it failed
        row["store_at_failure"] = _room_stats(ssd.stats())
      raise
    times.append(time.perf_counter() - t)
    losses.append(float(metrics["loss"]))
  del row["steps_done_s"], row["steps_done_losses"]
  measured = times[spec["warmup"] :]
  row |= dict(
    step_s_all=times,
    step_s=statistics.median(measured),
    losses=losses,
    tokens_per_step=S,
  )
  row["tokens_per_s"] = S / row["step_s"]
  if row.get("predicted_step_s"):
    row["measured_over_predicted"] = row["step_s"] / row["predicted_step_s"]
  if in_store or opt_loc == "host":
    ssd.flush()  # every write of the last step done: the counters exact
    row.update(bc.engine_row(ssd.stats(), spec["steps"]))
  mem = dev.memory_stats() or {}
  row["peak_GB"] = mem["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in mem else None
  row["device_limit_GB"] = mem["bytes_limit"] / 1e9 if "bytes_limit" in mem else None
  row["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
  return row


def _store_room(spec: dict) -> tuple[int, int]:
  """``(host tier bytes, disk free bytes)`` of the row's store (0 where it has none)."""
  import jax_ssdtrain as ssd

  cfg = ssd.current_config()
  host = int(cfg.host_tier_bytes) if cfg is not None else 0
  return host, shutil.disk_usage(spec["store_dir"]).free


def _check_fits(spec: dict, base: str, cfg, budget: int, opt_loc) -> None:
  """Raises the planner's LongContextError (the arithmetic, what to change) where the row's
  sequence cannot fit the device or the store."""
  from jax_ssdtrain._src.planner import check_long_context

  where = POLICIES.get(base)
  if base in IDEAL_POLICIES:
    locations = dict.fromkeys(TAGS, "device")
    host, disk = 0, 0
  elif where == "pinned_host":  # JAX's pinned host memory: not the store's room
    locations, (host, disk) = {"layer_in": "host"}, (1 << 62, 0)
  else:
    locations = {"layer_in": where or "device"}
    host, disk = _store_room(spec)
  check_long_context(
    cfg,
    spec["seq"],
    1,
    budget_bytes=int(budget),
    host_tier_bytes=host,
    disk_free_bytes=disk,
    locations=locations,
    param_dtype="bfloat16",  # master_weights: bfloat16 parameters and gradients
    optimizer_on_device=opt_loc in (None, "device"),  # streamed_device's too
  )


def _planned(spec: dict, run, state, tokens, rng, budget, opt_loc):
  """``--policies plan``: one layer profiled at S (``ssd.profile``), ``ssd.plan_long_context``
  over the chunk counts of ``--plan-chunks`` (each candidate's step compiled for XLA's memory
  analysis), the state's model replaced by the plan's. Returns ``(state, row fields)``."""
  import jax
  import jax.numpy as jnp

  import jax_ssdtrain as ssd
  import models
  from models import llama
  from scripts import training

  if not budget:
    raise ValueError("--policies plan: no device memory limit here; give --plan-budget-gb")
  cfg, S = run.model_config(), spec["seq"]
  block = llama.LlamaBlock(cfg)
  x = jnp.zeros((1, S, cfg.hidden), cfg.compute_dtype)
  params = jax.jit(lambda r, x=x: block.init(r, x)["params"])(jax.random.key(3))
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # as master_weights trains
  t0 = time.perf_counter()
  prof = ssd.profile(
    lambda p, h: block.apply({"params": p}, h)[0],
    params,
    x,
    num_layers=cfg.num_layers,
    directory=spec["store_dir"],
    batch=1,
    repeats=spec.get("plan_repeats", 3),
    warmup=1,
    progress=False,
  )
  del params, x
  profile_s = time.perf_counter() - t0

  def run_of(m, lc, plan):
    overrides = dict(run.model_overrides, mlp_chunks=m, loss_chunks=lc)
    return training.apply_plan(dataclasses.replace(run, model_overrides=overrides), plan)

  def memory(m, lc, plan):  # XLA's device memory of the whole step as planned
    r = run_of(m, lc, plan)
    model = models.build_model("llama", r.model_config(), r.remat_policy_object())
    compiled = training.jit_train_step().lower(state.replace(apply_fn=model.apply), tokens, rng)
    ma = compiled.compile().memory_analysis()
    return (
      ma.temp_size_in_bytes
      + ma.argument_size_in_bytes
      + ma.output_size_in_bytes
      - (ma.alias_size_in_bytes)
    )

  host, disk = _store_room(spec)
  t0 = time.perf_counter()
  plan = ssd.plan_long_context(
    cfg,
    S,
    1,
    int(budget),
    lambda m, lc: prof,
    memory,
    chunk_options=spec.get("plan_chunks"),
    host_tier_bytes=host,
    disk_free_bytes=disk,
    optimizer_on_device=opt_loc is None,
    param_dtype="bfloat16",
    min_bytes=spec["min_bytes"],
  )
  print(plan, flush=True)
  chosen = run_of(plan.model_options()["mlp_chunks"], plan.model_options()["loss_chunks"], plan)
  model = models.build_model("llama", chosen.model_config(), chosen.remat_policy_object())
  ssd.configure(**plan.store_options())
  return state.replace(apply_fn=model.apply), dict(
    predicted_step_s=plan.step_s,
    predicted_compute_s=plan.compute_s,
    predicted_stall_s=plan.stall_s,
    planned_device_GB=(plan.measured_device_bytes or 0) / 1e9,
    plan_budget_GB=int(budget) / 1e9,
    plan_locations={n: loc.value for n, loc in plan.locations},
    plan_offload_layers=plan.offload_layers,
    plan_staging_GB=plan.staging_bytes / 1e9,
    plan_mlp_chunks=plan.model_options()["mlp_chunks"],
    plan_loss_chunks=plan.model_options()["loss_chunks"],
    profile_s=profile_s,
    plan_s=time.perf_counter() - t0,
    plan_table=str(plan),
  )


def _room_stats(stats: dict) -> dict:
  """The store's counters of room and traffic (bytes, tensors, the largest free extents, the
  spills for fragmentation), from ``ssd.stats()``."""
  words = ("bytes", "tensors", "entries", "largest_free", "spills")
  return {
    k: v for k, v in stats.items() if isinstance(v, int | float) and any(w in k for w in words)
  }


def child_main(spec_json: str) -> int:
  spec = json.loads(spec_json)
  row: dict = {}
  try:
    _run_row(spec, row)
  except Exception as e:  # noqa: BLE001 - reported in the row (the parent's table says why)
    text = f"{type(e).__name__}: {e}"
    row |= dict(error=text[:2000], oom=_is_oom(text))
    print(json.dumps(row), flush=True)
    return 1
  print(json.dumps(row, default=float), flush=True)
  return 0


def _is_oom(text: str) -> bool:
  """Whether ``text`` (an error, a stderr tail) says the device ran out of memory (not the
  store: its messages name jax_ssdtrain)."""
  lines = [
    ln for ln in text.splitlines() if "RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()
  ]
  return bool(lines) and "ssdtrain" not in lines[-1]


# ---------------------------------------------------------------------------------------------
# The parent: rows, the ideal, the probes, the report (no JAX backend)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--preset", default="llama3-8b", help="a Llama preset of models/ (or tiny)")
  p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
  p.add_argument(
    "--seq",
    default="131072",
    help="sequence lengths S, comma-separated (with --find-longest: the first is the start)",
  )
  p.add_argument(
    "--policies",
    default="remat,jax_host_layer_in,ours_host_layer_in",
    help=f"NAME[:KEY=VALUE...][@OPT], comma-separated; NAME of {', '.join(POLICIES)}",
  )
  p.add_argument(
    "--optimizer",
    default="device",
    help=f"placements of the optimizer state for policies without @OPT: {', '.join(OPTIMIZERS)}",
  )
  p.add_argument(
    "--optimizer-in-place",
    action="store_true",
    help="the streamed placements keep one version of the state (offload_optimizer(in_place="
    "True)): half the host tier (the 8B shape's 12 bytes a parameter, 96 GB, fit a 125 GiB "
    "host once, not twice)",
  )
  p.add_argument("--steps", type=int, default=10, help="measured steps (default 10; 2 at 256K)")
  p.add_argument("--warmup", type=int, default=1, help="steps before them (default 1)")
  p.add_argument(
    "--deterministic",
    action="store_true",
    help=f"XLA_FLAGS {DETERMINISTIC} for every row: on a GPU the losses of the rows are then "
    "comparable bit for bit (slower: time rows without it)",
  )
  p.add_argument("--find-longest", action="store_true", help="double S until the step fails")
  p.add_argument("--max-seq", type=int, default=1 << 22, help="--find-longest's last S")
  p.add_argument(
    "--ideal-layers",
    type=bench_fit._layer_counts,
    default=(2, 4),
    help="layer counts of the ideal's runs (default 2,4)",
  )
  p.add_argument("--ideal-policy", choices=IDEAL_POLICIES, default="keep")
  p.add_argument("--no-ideal", action="store_true", help="no ideal runs")
  p.add_argument(
    "--only-ideal",
    action="store_true",
    help="the ideal's runs alone, at every --seq (a call of its own; --replot merges it with "
    "the rows' runs)",
  )
  p.add_argument(
    "--mlp-chunk-tokens", type=int, default=8192, help="positions per MLP chunk (default 8192)"
  )
  p.add_argument(
    "--loss-chunk-tokens", type=int, default=4096, help="positions per loss chunk (default 4096)"
  )
  p.add_argument(
    "--plan-budget-gb",
    type=float,
    default=None,
    help="--policies plan (and the refusal): the device budget in GB (default: the device's limit)",
  )
  p.add_argument(
    "--plan-chunks",
    default=None,
    help="--policies plan: MLP/LOSS chunk counts to choose from, comma-separated (e.g. "
    "16/32,32/64; default: the planner's)",
  )
  p.add_argument("--attention", choices=["auto", "xla", "cudnn"], default=None)
  p.add_argument(
    "--min-bytes",
    type=int,
    default=1 << 20,
    help="our policies and the streamed optimizer: smaller tensors stay on the device",
  )
  p.add_argument("--peak-tflops", type=float, default=None, help="default: by device kind")
  p.add_argument("--timeout", type=float, default=600, help="seconds per row (process)")
  p.add_argument(
    "--budget-s",
    type=float,
    default=None,
    help="seconds for the whole run: each row's --timeout is cut to what is left, so that the "
    "results are written within it (a row cut short fails: timed out)",
  )
  p.add_argument("--store-dir", default=None, help="store directory (default: a private temp)")
  p.add_argument(
    "--ssd",
    type=store_option,
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="ssd.configure option for every row that uses the store, e.g. host_tier_bytes=96GiB",
  )
  p.add_argument("--probe-gb", type=float, default=4.0, help="the disk probe's bytes")
  p.add_argument("--no-probe", action="store_true", help="no disk probe")
  p.add_argument("--no-link-probe", action="store_true", help="no link probe")
  p.add_argument("--merge", action="store_true", help="merge into today's JSON of the same name")
  p.add_argument("--replot", type=Path, nargs="+", metavar="JSON", help="saved runs again")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  bc.add_out_option(p)
  return p


def _seqs(text: str) -> list[int]:
  try:
    seqs = [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    seqs = []
  if not seqs or min(seqs) < 2:
    raise ValueError(f"--seq: expected sequence lengths >= 2, comma-separated, got {text!r}")
  return seqs


def _child(spec: dict, timeout: float, env: dict | None = None) -> dict:
  cmd = bc.module_command("scripts.bench_long_context", "--child", json.dumps(spec))
  row = bc.run_json_child(cmd, timeout, env)
  if "error" in row:
    row["oom"] = row.get("oom") or _is_oom(row.get("stderr_tail", "") + row["error"])
    row["stderr_tail"] = bc.tail(row.get("stderr_tail", ""), 1500)
  return row


def _spec(args, policy: str, optimizer: str, seq: int, layers: int, store_dir: str) -> dict:
  return dict(
    preset=args.preset,
    policy=policy,
    optimizer=optimizer,
    seq=seq,
    layers=layers,
    steps=args.steps,
    warmup=args.warmup,
    mlp_chunks=chunks_for(seq, args.mlp_chunk_tokens),
    loss_chunks=chunks_for(seq, args.loss_chunk_tokens),
    attention=args.attention,
    min_bytes=args.min_bytes,
    in_place=args.optimizer_in_place,
    store_dir=store_dir,
    ssd_options=dict(args.ssd),
    plan_budget_bytes=int(args.plan_budget_gb * 1e9) if args.plan_budget_gb else None,
    plan_chunks=_plan_chunks(args.plan_chunks),
  )


def _plan_chunks(text: str | None) -> list[tuple[int, int]] | None:
  """``--plan-chunks``: ``MLP/LOSS`` pairs, comma-separated (None: the planner's default)."""
  if not text:
    return None
  try:
    return [tuple(int(v) for v in t.split("/")) for t in text.split(",") if t.strip()]
  except ValueError:
    raise ValueError(
      f"--plan-chunks: expected MLP/LOSS chunk counts like 16/32, got {text!r}"
    ) from None


def disk_probe(directory: str, gb: float, timeout: float) -> dict:
  """``python -m jax_ssdtrain.probe DIR --raw --refresh --json``: the engine's and raw
  O_DIRECT write and read rates of ``directory`` now."""
  size = f"{max(64, int(gb * 1024))}MiB"
  cmd = bc.module_command(
    "jax_ssdtrain.probe", directory, "--size", size, "--threads", "8", "--refresh", "--json"
  )
  out = {"cmd": " ".join(cmd[1:]), "dir": directory}
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=bc.child_env())
    r = json.loads(proc.stdout)["results"][0]
  except (subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as e:
    return out | {"note": f"disk probe failed: {type(e).__name__}: {bc.tail(str(e), 300)}"}
  return out | {
    "write_GBps": r["raw_write_gbps"] or r["write_gbps"],
    "read_GBps": r["raw_read_gbps"] or r["read_gbps"],
    "raw_o_direct": r.get("raw_o_direct"),
    "engine_write_GBps": r["write_gbps"],
    "engine_read_GBps": r["read_gbps"],
    "o_direct": r["o_direct"],
    "size": r["size"],
  }


def link_probe(timeout: float) -> dict:
  cmd = bc.module_command("jax_ssdtrain.probe", "--link", "--refresh", "--json")
  r = bc.run_json_child(cmd, timeout)
  if "error" in r:
    return {
      "note": f"link probe failed: {r['error']}",
      "stderr_tail": bc.tail(r.get("stderr_tail", ""), 300),
    }
  return r


def run(args) -> dict:
  import models  # the preset's shape (no JAX backend)

  seqs = _seqs(args.seq)
  rows_wanted = (
    []
    if args.only_ideal
    else parse_rows(args.policies, [o.strip() for o in args.optimizer.split(",")])
  )
  full = models.get_config("llama", args.preset)
  layers = args.layers or full.num_layers
  made = None
  store_dir = args.store_dir
  if store_dir is None:
    store_dir = made = tempfile.mkdtemp(prefix="bench_long_context-", dir="/var/tmp")
  os.makedirs(store_dir, exist_ok=True)
  t_start = time.monotonic()
  env = dict(os.environ)
  if args.deterministic:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DETERMINISTIC}".strip()

  def left() -> float:
    """Seconds a row may still take: ``--timeout``, within what ``--budget-s`` leaves."""
    if args.budget_s is None:
      return args.timeout
    return min(args.timeout, args.budget_s - (time.monotonic() - t_start))

  try:
    probe = {"note": "--no-probe"}
    if not args.no_probe:
      print(f"disk probe: {store_dir}, {args.probe_gb:g} GB ...", flush=True)
      probe = disk_probe(store_dir, args.probe_gb, args.timeout)
      print(f"disk probe: {probe}", flush=True)
    link = {"note": "--no-link-probe"} if args.no_link_probe else link_probe(args.timeout)
    rows, longest = [], []

    def one(policy, opt, seq, n_layers=layers, kind="row"):
      head = dict(kind=kind, policy=policy, optimizer=opt, seq=seq, layers=n_layers)
      timeout = left()
      if timeout < 1:
        return head | dict(error=f"not run: --budget-s {args.budget_s:g} spent", oom=False)
      t0 = time.perf_counter()
      r = head | _child(_spec(args, policy, opt, seq, n_layers, store_dir), timeout, env)
      r["wall_s"] = time.perf_counter() - t0
      r |= dict(  # a plan's own where it chose them
        mlp_chunks=r.get("plan_mlp_chunks") or chunks_for(seq, args.mlp_chunk_tokens),
        loss_chunks=r.get("plan_loss_chunks") or chunks_for(seq, args.loss_chunk_tokens),
      )
      brief = {k: v for k, v in r.items() if k not in ("engine", "stderr_tail", "store_config")}
      print(json.dumps(brief, default=str), flush=True)
      return r

    for policy, opt in rows_wanted:
      if not args.find_longest:
        rows += [one(policy, opt, s) for s in seqs]
        continue
      s, best, failed = seqs[0], None, None
      while s <= args.max_seq:
        r = one(policy, opt, s)
        rows.append(r)
        if "error" in r:
          failed = r
          break
        best, s = r, 2 * s
      longest.append(
        dict(
          policy=policy,
          optimizer=opt,
          longest_seq=best["seq"] if best else None,
          failed_seq=failed["seq"] if failed else None,
          failed_oom=failed.get("oom") if failed else None,
          failed_why=(failed.get("error") or "")[:300]
          if failed
          else f"--max-seq {args.max_seq} reached",
        )
      )
    ideals = []
    if not args.no_ideal:
      # at every S measured; after --find-longest, at each policy's longest
      ideal_seqs = sorted(
        {lg["longest_seq"] for lg in longest if lg["longest_seq"]}
        if args.find_longest and not args.only_ideal
        else {r["seq"] for r in rows if "error" not in r} or seqs
      )
      for s in ideal_seqs:
        for n in args.ideal_layers:
          ideals.append(one(args.ideal_policy, "device", s, n, kind="ideal"))
  finally:
    if made:
      shutil.rmtree(made, ignore_errors=True)
  kind = bc.device_kind(rows + ideals)
  doc = bc.bench_doc(
    "longctx",
    args,
    device_kind=kind,
    platform=next((r["platform"] for r in rows + ideals if "platform" in r), None),
    peak_tflops=bench_fit.peak_tflops(kind, args.peak_tflops),
    preset=args.preset,
    layers=layers,
    ideal_layers=list(args.ideal_layers),
    ideal_policy=args.ideal_policy,
    optimizer_in_place=args.optimizer_in_place,
    deterministic=args.deterministic,
    steps=args.steps,
    warmup=args.warmup,
    probe=probe,
    link=link,
    rows=rows,
    ideal_runs=ideals,
    longest=longest,
  )
  doc["env"]["device_kind"] = kind
  return doc


def _ok(r: dict) -> bool:
  return "error" not in r and bool(r.get("step_s"))


def _key(r: dict):
  return r.get("kind"), r.get("policy"), r.get("optimizer"), r.get("seq"), r.get("layers")


def derive(doc: dict) -> None:
  """Fields relative to other rows, the ideal and the probes (again on merge and replot)."""
  import models

  full = models.get_config("llama", doc["preset"])
  layers = doc["layers"]
  cfg = models.get_config("llama", doc["preset"], num_layers=layers)
  peak = doc.get("peak_tflops")
  ideals = {}
  for s in sorted({r["seq"] for r in doc["ideal_runs"]}):
    runs = [r for r in doc["ideal_runs"] if r["seq"] == s and _ok(r)]
    counts = sorted({r["layers"] for r in runs})
    if len(counts) >= 2:
      times = [next(r["step_s"] for r in runs if r["layers"] == n) for n in counts]
      ideal = bench_fit.extend_to_depth(counts, times, layers) | dict(seq=s, layers=layers)
      ideal["tokens_per_s"] = s / ideal["step_s"]
      ideal["mfu"] = step_flops(cfg, s) / ideal["step_s"] / (peak * 1e12) if peak else None
      ideals[s] = ideal
  doc["ideal"] = list(ideals.values())
  doc["full_layers"] = full.num_layers
  sources = doc.get("sources") or [doc]
  remat = {
    (r.get("source", 0), r["optimizer"], r["seq"], r["layers"]): r
    for r in doc["rows"]
    if _ok(r) and split_policy(r["policy"])[0] == "remat"
  }
  streamed = {
    (r.get("source", 0), r["policy"], r["seq"], r["layers"]): r
    for r in doc["rows"]
    if _ok(r) and r["optimizer"] == "streamed_device"
  }
  on_device = {
    (r.get("source", 0), r["policy"], r["seq"], r["layers"]): r
    for r in doc["rows"]
    if _ok(r) and r["optimizer"] == "device"
  }
  for r in doc["rows"] + doc["ideal_runs"]:
    if not _ok(r):
      continue
    c = models.get_config("llama", doc["preset"], num_layers=r["layers"])
    r["step_TFLOP"] = step_flops(c, r["seq"]) / 1e12
    r["mfu"] = r["step_TFLOP"] / r["step_s"] / peak if peak else None
    r["device_GB"] = (r.get("temp_GB") or 0) + (r.get("staging_GB_peak") or 0)
    r["layer_in_GB_per_step"] = r["layers"] * r["seq"] * c.hidden * 2 / 1e9
    if r.get("kind") != "row":
      continue
    ideal = ideals.get(r["seq"])
    r["x_ideal"] = ideal["step_s"] / r["step_s"] if ideal and r["layers"] == layers else None
    ref = remat.get((r.get("source", 0), r["optimizer"], r["seq"], r["layers"]))
    r["loss_same_as_remat"] = ref["losses"] == r["losses"] if ref else None
    ref = on_device.get((r.get("source", 0), r["policy"], r["seq"], r["layers"]))
    if r["optimizer"] != "device" and ref:  # the streamed update against optax's: ulps apart
      r["loss_max_rel_diff_vs_device_optimizer"] = max(
        abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], ref["losses"])
      )
    ref = streamed.get((r.get("source", 0), r["policy"], r["seq"], r["layers"]))
    if r["optimizer"] == "host" and ref:
      r["loss_same_as_streamed_device"] = ref["losses"] == r["losses"]
    src = sources[r.get("source", 0)]
    probe, link = src.get("probe") or {}, src.get("link") or {}
    for io in ("write", "read"):
      engine, raw = r.get(f"{io}_GBps"), probe.get(f"{io}_GBps")
      r[f"{io}_vs_probe"] = engine / raw if engine and raw else None
    for way in ("d2h", "h2d"):
      engine, raw = r.get(f"link_{way}_GBps"), link.get(f"{way}_gbps")
      r[f"link_{way}_vs_probe"] = engine / raw if engine and raw else None


def _f(v, spec="{:.2f}") -> str:
  return "-" if v is None else spec.format(v)


def _seq(s: int) -> str:
  return f"{s // 1024}K" if s >= 1024 and s % 1024 == 0 else str(s)


def _size_text(value) -> str:
  """A store option's value as given to ``configure``: ``"6442450944"`` -> ``"6GiB"``."""
  try:
    n = int(value)
  except (TypeError, ValueError):
    return str(value)
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if n and n % (1 << shift) == 0:
      return f"{n >> shift}{unit}"
  return str(n)


def _store_note(r: dict, rows: list[dict]) -> str:
  """`` (KEY=VALUE, ...)``: the store options in which this row differs from another row of its
  policy and optimizer (merged runs with other sizes); ``""`` where none does."""
  mine = r.get("store_config") or {}
  differ = set()
  for o in rows:
    if (o["policy"], o["optimizer"]) == (r["policy"], r["optimizer"]):
      theirs = o.get("store_config") or {}
      differ |= {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
  note = ", ".join(f"{k}={_size_text(mine[k])}" for k in sorted(differ) if k in mine)
  return f" ({note})" if note else ""


def row_name(r: dict, rows: list[dict]) -> str:
  """``policy @ optimizer`` and its store note: the plot's name of a row."""
  return f"{r['policy']} @ {r['optimizer']}{_store_note(r, rows)}"


def table(doc: dict) -> str:
  head = (
    f"{doc['device_kind']}: {doc['preset']} ({doc['layers']} layers), batch 1, median of "
    f"{doc['steps']} steps after {doc['warmup']}"
    + ("; the streamed optimizer state updated in place" if doc.get("optimizer_in_place") else "")
    + (
      f"; ideal: {doc['ideal_policy']} with {', '.join(map(str, doc['ideal_layers']))} layers "
      f"extended to {doc['layers']}"
      if doc["ideal_runs"]
      else "; no ideal"
    )
  )
  lines = [
    head,
    "",
    "| S | policy | optimizer | step s | tokens/s | MFU | x ideal | device GB (XLA temp + "
    "staging) | peak GB | host tier GB | disk GB w/r a step | disk GB/s w/r (x probe) | "
    "link GB/s d2h/h2d (x probe) | stall ms | loss = remat |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in doc["rows"]:
    lead = f"| {_seq(r['seq'])} | {r['policy']}{_store_note(r, doc['rows'])} | {r['optimizer']} |"
    if not _ok(r):
      why = "out of device memory" if r.get("oom") else (r.get("error") or "?")[:200]
      if "LongContextError" in (r.get("error") or ""):  # refused: the verdict and the way out
        said = r["error"].splitlines()
        why = f"refused before compiling: {said[0].partition(': ')[2]} {said[-1]}"
      if r.get("failed_step") is not None:  # the steps it finished before the one that failed
        done = ", ".join(f"{t:.3f}" for t in r.get("steps_done_s") or []) or "none"
        why = f"step {r['failed_step'] + 1} {why} (steps done, s: {done})"
      lines.append(f"{lead} failed: {why} | | | | | | | | | | | |")
      continue
    engine = "engine" in r
    disk = (
      f"{r['disk_MB_written_per_step'] / 1e3:.2f}/{r['disk_MB_read_per_step'] / 1e3:.2f}"
      if engine
      else "-"
    )
    rates = (
      f"{r['write_GBps']:.2f}/{r['read_GBps']:.2f} "
      f"({_f(r.get('write_vs_probe'))}/{_f(r.get('read_vs_probe'))})"
      if engine and (r.get("write_GBps") or r.get("read_GBps"))
      else "-"
    )
    link = (
      f"{r['link_d2h_GBps']:.1f}/{r['link_h2d_GBps']:.1f} "
      f"({_f(r.get('link_d2h_vs_probe'))}/{_f(r.get('link_h2d_vs_probe'))})"
      if r.get("link_d2h_GB_per_step") or r.get("link_h2d_GB_per_step")
      else "-"
    )
    same = {True: "same", False: "DIFF", None: "-"}[r.get("loss_same_as_remat")]
    temp, stage = r.get("temp_GB") or 0, r.get("staging_GB_peak") or 0
    lines.append(
      f"{lead} {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
      f"{_f(r.get('mfu') and 100 * r['mfu'], '{:.1f}%')} | {_f(r.get('x_ideal'), '{:.3f}')} | "
      f"{temp + stage:.1f} ({temp:.1f} + {stage:.1f}) | {_f(r.get('peak_GB'), '{:.1f}')} | "
      f"{_f(r.get('host_tier_GB_peak'), '{:.1f}')} | {disk} | {rates} | {link} | "
      f"{_f(r.get('stall_ms_per_step'), '{:.0f}')} | {same} |"
    )
  for i in doc.get("ideal") or []:
    runs = ", ".join(
      f"{r['layers']}: {r['step_s']:.3f} s"
      for r in doc["ideal_runs"]
      if r["seq"] == i["seq"] and _ok(r)
    )
    lines.append(
      f"| {_seq(i['seq'])} | ideal ({runs}) | device | {i['step_s']:.3f} | "
      f"{i['tokens_per_s']:,.0f} | {_f(i.get('mfu') and 100 * i['mfu'], '{:.1f}%')} | 1.000 "
      "| | | | | | | | |"
    )
  for r in doc["ideal_runs"]:
    if not _ok(r):
      why = "out of device memory" if r.get("oom") else (r.get("error") or "?")[:200]
      lines.append(
        f"| {_seq(r['seq'])} | ideal, {r['layers']} layers | device | failed: {why} "
        "| | | | | | | | | | | |"
      )
  for lg in doc.get("longest") or []:
    lines.append(
      f"\nlongest, {lg['policy']} (optimizer {lg['optimizer']}): "
      f"{_seq(lg['longest_seq']) if lg['longest_seq'] else 'none'}"
      + (
        f"; {_seq(lg['failed_seq'])} failed: "
        f"{'out of device memory' if lg['failed_oom'] else lg['failed_why']}"
        if lg.get("failed_seq")
        else f" ({lg['failed_why']})"
      )
    )
  for r in doc["rows"]:  # --policies plan: the planner's prediction against the measured step
    if _ok(r) and r.get("predicted_step_s"):
      where = ", ".join(f"{n} {loc}" for n, loc in sorted(r["plan_locations"].items()))
      lines.append(
        f"\nplan, {_seq(r['seq'])} (optimizer {r['optimizer']}): predicted "
        f"{r['predicted_step_s']:.3f} s, measured {r['step_s']:.3f} s (x"
        f"{r['step_s'] / r['predicted_step_s']:.3f}); mlp_chunks {r['plan_mlp_chunks']}, "
        f"loss_chunks {r['plan_loss_chunks']}, {where} in the first "
        f"{r['plan_offload_layers']} layers, staging {r['plan_staging_GB']:.2f} GB; device "
        f"{r['planned_device_GB']:.1f} GB (XLA + staging) of {r['plan_budget_GB']:.1f} GB"
      )
  lines.append("")
  for src in doc.get("sources") or [doc]:
    lines += _probe_lines(src, f"{src['file']} ({src['date']}): " if "sources" in doc else "")
  return "\n".join(lines)


def _probe_lines(src: dict, lead: str) -> list[str]:
  """The disk and link probes of one run, a line each."""
  probe, link = src.get("probe") or {}, src.get("link") or {}
  lines = []
  lines.append(
    lead
    + (
      f"disk probe ({probe.get('dir')}): O_DIRECT write {probe['write_GBps']:.2f} GB/s, read "
      f"{probe['read_GBps']:.2f} GB/s (through the engine {probe['engine_write_GBps']:.2f}/"
      f"{probe['engine_read_GBps']:.2f})"
      if probe.get("write_GBps")
      else f"disk probe: {probe.get('note', 'not run')}"
    )
  )
  lines.append(
    lead
    + (
      f"link probe (pinned, {link['size'] / 2**30:.0f} GiB copies): D2H {link['d2h_gbps']:.1f} GB/s,"
      f" H2D {link['h2d_gbps']:.1f} alone; {link['duplex_d2h_gbps']:.1f}/"
      f"{link['duplex_h2d_gbps']:.1f} both at once"
      if link.get("d2h_gbps")
      else f"link probe: {link.get('note', 'not run')}"
    )
  )
  return lines


def plot(plt, doc: dict, path: Path) -> str | None:
  rows = [r for r in doc["rows"] if _ok(r)]
  if not rows:
    return "no plot: no row ran"
  with bc.figure(plt, path, 1, 2, figsize=(11, 4)) as (fig, (tps, mem)):
    for label in sorted({row_name(r, rows) for r in rows}):
      pts = sorted(((r["seq"], r) for r in rows if row_name(r, rows) == label), key=lambda p: p[0])
      tps.plot([s for s, _ in pts], [r["tokens_per_s"] for _, r in pts], "o-", label=label)
      mem.plot([s for s, _ in pts], [r["device_GB"] for _, r in pts], "o-", label=label)
    ideal = doc.get("ideal") or []
    if ideal:
      tps.plot([i["seq"] for i in ideal], [i["tokens_per_s"] for i in ideal], "kx--", label="ideal")
    for ax, what in ((tps, "tokens/s"), (mem, "device GB (XLA temp + staging)")):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("sequence length S")
      ax.set_ylabel(what)
      ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # from zero: rows of one size read as alike
      ax.grid(alpha=0.3)
    tps.legend(fontsize=7)
    fig.suptitle(
      f"{doc['preset']} ({doc['layers']} layers), {doc['device_kind']}, {doc.get('date')}",
      fontsize=9,
    )
  return None


def report(doc: dict, stem: Path) -> None:
  derive(doc)
  bc.write_results(stem, doc, table(doc), plot)
  print(f"wrote {stem}.json")


def replot(paths: list[Path], out: Path) -> int:
  """The table and plot of saved runs again. One JSON is rewritten in place; several (of the
  same preset) are merged into OUT/longctx_<device>_<date of the first>: their rows, ideal
  runs and longest in order, each row with the index of its run in ``sources`` (that run's
  file, date and probes: its rows are set beside its own probes)."""
  docs = [json.loads(Path(p).read_text()) for p in paths]
  if len(docs) == 1:
    report(docs[0], bc.stem_of(paths[0]))
    return 0
  presets = {(d["preset"], d["layers"]) for d in docs}
  if len(presets) > 1:
    raise SystemExit(f"--replot: runs of different models {sorted(presets)}: merge one at a time")
  tagged = lambda field: [r | {"source": i} for i, d in enumerate(docs) for r in d[field]]  # noqa: E731
  doc = docs[0] | dict(
    sources=[
      {"file": p.name} | {k: d.get(k) for k in ("date", "probe", "link")}
      for p, d in zip(paths, docs)
    ],
    rows=tagged("rows"),
    ideal_runs=tagged("ideal_runs"),
    longest=[lg for d in docs for lg in d.get("longest", [])],
  )
  report(doc, Path(out) / f"longctx_{bc.slug(doc['device_kind'])}_{doc['date']}")
  return 0


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.child is not None:
    return child_main(args.child)
  if args.replot:
    return replot(args.replot, args.out)
  if args.only_ideal and args.no_ideal:
    raise SystemExit("--only-ideal and --no-ideal: give one or the other")
  try:
    parse_rows(args.policies, [o.strip() for o in args.optimizer.split(",")])
    _seqs(args.seq)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  if args.steps < 1 or args.warmup < 0:
    raise SystemExit(f"--steps {args.steps} / --warmup {args.warmup}: need >= 1 and >= 0")
  doc = run(args)
  stem = args.out / f"longctx_{bc.slug(doc['device_kind'])}_{bc.today()}"
  if args.merge and Path(f"{stem}.json").exists():
    old = json.loads(Path(f"{stem}.json").read_text())
    doc["rows"] = bc.merge_rows(old.get("rows", []), doc["rows"], _key)
    doc["ideal_runs"] = bc.merge_rows(old.get("ideal_runs", []), doc["ideal_runs"], _key)
    doc["longest"] = old.get("longest", []) + doc["longest"]
  report(doc, stem)
  # bit for bit where the programs are deterministic (the CPU's; a GPU's with --deterministic)
  exact = doc.get("platform") == "cpu" or args.deterministic
  bad = [r for r in doc["rows"] if r.get("loss_same_as_remat") is False and exact]
  for r in bad:
    print(
      f"FAIL {r['policy']} @ {r['optimizer']}, S={r['seq']}: losses differ from remat's",
      file=sys.stderr,
    )
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
