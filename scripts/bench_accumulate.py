"""A GPT's optimizer step under gradient accumulation, its optimizer state in four places.

One process, side by side, the same model, batch and optimizer (the project's chain: global-norm
clipping, masked AdamW, warm-up/cosine schedule):

* ``device``: the state on the device (plain optax);
* ``host`` / ``nvme``: ``jax_ssdtrain.offload_optimizer`` (the store's host tier / its files);
* ``jax_pinned_host``: JAX's memory kinds, the state in ``pinned_host`` and moved to the device
  and back inside the step, as MaxText's ``optimizer_memory_host_offload`` does (GPU only).

An optimizer step with accumulation ``k`` is ``k - 1`` micro-batches that only add their
gradients (``accumulate``: one program, the same for every variant) and one micro-batch that adds
its gradients and updates (``update``). Both programs are timed on their own (median of
``--steps`` calls after ``--warmup``), and the step at each ``k`` of ``--accum`` is
``(k - 1) * accumulate + update``: the rows compare that with the state on the device. Device
memory per variant: XLA's memory analysis of the update program.

  python -m scripts.bench_accumulate --preset gpt-1.3b --accum 1,4,16 [--out DIR]
  python -m scripts.bench_accumulate --tiny           (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_ssdtrain as ssd
from scripts import bench_common as bc
from scripts import training

VARIANTS = ("device", "host", "nvme", "jax_pinned_host")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--preset", default="gpt-1.3b")
  p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--remat-policy", default="remat", help="keep | remat | offload (models.common)")
  p.add_argument("--accum", default="1,4,16", help="accumulation steps to report")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--min-bytes", type=ssd.parse_size, default="1MiB", help="smaller leaves stay")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--store-dir", default=None, help="store directory (default: a private temp)")
  p.add_argument("--tiny", action="store_true", help="the tiny preset, 3 steps (CPU smoke run)")
  bc.add_out_option(p)
  return p


def _median_time(fn, steps: int, warmup: int) -> float:
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    if i >= warmup:
      times.append(time.perf_counter() - t0)
    ssd.collect()  # the state's last version released, untimed (see docs/optimizer.md)
  return statistics.median(times)


def _pinned_host(tx):
  """``tx`` with its state in ``pinned_host``, moved to the device for the update and back."""
  dev = jax.devices()[0]
  on_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")

  def init(params):
    return jax.device_put(tx.init(params), on_host)

  def update(g, s, p=None):
    u, s = tx.update(g, jax.device_put(s, on_device), p)
    return u, jax.device_put(s, on_host)

  return optax.GradientTransformation(init, update), on_host


def run(args) -> dict:
  cfg = training.RunConfig(
    model="gpt",
    preset=args.preset,
    batch=args.batch,
    seq_len=args.seq_len,
    remat_policy=args.remat_policy,
    steps=1000,
  )
  state, model, _ = training.create_train_state(cfg)
  params = state.params
  del state
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  tokens = jax.random.randint(
    jax.random.key(1), (args.batch, cfg.example_length(cfg.model_config())), 0, 256
  )
  rng = jax.random.key(2)

  def grads_of(p):
    loss = lambda q: model.apply({"params": q}, tokens, rng, method="loss")[0]  # noqa: E731
    return jax.grad(loss)(p)

  accumulate = jax.jit(lambda p, acc: jax.tree.map(jnp.add, acc, grads_of(p)), donate_argnums=(1,))
  gpu = jax.default_backend() == "gpu"
  accums = [int(k) for k in args.accum.split(",")]
  store = args.store_dir or tempfile.mkdtemp(prefix="bench-acc-")
  rows = []
  with ssd.configured(store, capacity_bytes=8 * param_bytes, host_tier_bytes=8 * param_bytes):
    for variant in args.variants.split(","):
      if variant == "jax_pinned_host" and not gpu:
        continue
      loc = variant if variant in ("host", "nvme") else None
      tx = training.make_optimizer(
        training.RunConfig(steps=1000, optimizer_location=loc, min_bytes=args.min_bytes)
      )[0]
      state_sharding = None
      if variant == "jax_pinned_host":
        tx, on_host = _pinned_host(tx)
      p = jax.tree.map(jnp.copy, params)
      opt_state = tx.init(p)
      if variant == "jax_pinned_host":
        state_sharding = jax.tree.map(lambda _: on_host, opt_state)

      def update(p, s, acc, k, tx=tx):
        g = jax.tree.map(lambda a, b: (a + b) / k, acc, grads_of(p))
        p, s = ssd.apply_gradients(tx, g, s, p)  # in place inside the stream for ours
        return p, s, jax.tree.map(jnp.zeros_like, acc)

      step = jax.jit(update, donate_argnums=(0, 1, 2), out_shardings=(None, state_sharding, None))
      acc = jax.tree.map(jnp.zeros_like, p)
      k = jnp.float32(accums[-1])
      step_bytes = bc.device_bytes(step.lower(p, opt_state, acc, k).compile())
      box = {"p": p, "s": opt_state, "acc": acc}

      def one_update():
        box["p"], box["s"], box["acc"] = step(box["p"], box["s"], box["acc"], k)
        return box["p"]

      def one_accumulate():
        box["acc"] = accumulate(box["p"], box["acc"])
        return box["acc"]

      ssd.flush()
      ssd.reset_stats()
      t_update = _median_time(one_update, args.steps, args.warmup)
      ssd.flush()
      written = ssd.stats()["bytes_written"] / (args.steps + args.warmup)
      t_acc = _median_time(one_accumulate, args.steps, args.warmup)
      row = dict(
        variant=variant,
        written_gb_per_update=written / 1e9,
        update_s=t_update,
        accumulate_s=t_acc,
        step_device_gb=step_bytes / 1e9 if step_bytes is not None else None,
      )
      for kk in accums:
        row[f"step_s_k{kk}"] = (kk - 1) * t_acc + t_update
        row[f"tokens_per_s_k{kk}"] = kk * tokens.size / row[f"step_s_k{kk}"]
      rows.append(row)
      box.clear()  # the variant's state and parameters go before the next one's
      del opt_state, p, acc
      ssd.collect()
  base = next((r for r in rows if r["variant"] == "device"), None)
  for r in rows:
    for kk in accums:
      r[f"x_device_k{kk}"] = r[f"step_s_k{kk}"] / base[f"step_s_k{kk}"] if base else None
  return bc.bench_doc(
    "accumulate",
    args,
    param_gb=param_bytes / 1e9,
    tokens_per_micro_batch=int(tokens.size),
    accum=accums,
    rows=rows,
  )


def table(doc: dict) -> str:
  ks = doc["accum"]
  lines = [
    f"{doc['args']['preset']}, {doc['param_gb']:.2f} GB of float32 parameters, "
    f"{doc['tokens_per_micro_batch']} tokens per micro-batch; step at k = (k-1) x accumulate + "
    "update",
    "",
    "| variant | update ms | accumulate ms | update program GB | "
    + " | ".join(f"k={k}: step ms (x device)" for k in ks)
    + " |",
    "|---|---|---|---|" + "---|" * len(ks),
  ]
  for r in doc["rows"]:
    gb = f"{r['step_device_gb']:.1f}" if r["step_device_gb"] is not None else "-"
    cells = " | ".join(
      f"{1e3 * r[f'step_s_k{k}']:.0f} ({r[f'x_device_k{k}']:.3f})"
      if r[f"x_device_k{k}"]
      else f"{1e3 * r[f'step_s_k{k}']:.0f}"
      for k in ks
    )
    lines.append(
      f"| {r['variant']} | {1e3 * r['update_s']:.1f} | {1e3 * r['accumulate_s']:.1f} | {gb} | "
      f"{cells} |"
    )
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> None:
  with bc.figure(plt, path, figsize=(6, 3)) as (_, ax):
    width = 0.8 / max(len(doc["rows"]), 1)
    for j, r in enumerate(doc["rows"]):
      xs = np.arange(len(doc["accum"])) + j * width
      ax.bar(xs, [r[f"x_device_k{k}"] or 0 for k in doc["accum"]], width, label=r["variant"])
    ax.set_xticks(np.arange(len(doc["accum"])) + 0.4 - width / 2)
    ax.set_xticklabels([f"k={k}" for k in doc["accum"]])
    ax.set_ylabel("step time / state on device")
    ax.legend(fontsize=7)


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  if args.tiny:
    args.preset, args.batch, args.seq_len, args.steps, args.warmup = "tiny", 2, 16, 3, 1
    args.min_bytes = 4096
  doc = run(args)
  kind = bc.slug(jax.devices()[0].device_kind)
  bc.write_bench(args.out, f"accumulate_{kind}", doc, table(doc), plot)
  return doc


if __name__ == "__main__":
  main()
