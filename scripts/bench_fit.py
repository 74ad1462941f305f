"""What fits on one GPU: GPTs of growing size trained by JAX alone and with jax_ssdtrain.

    python -m scripts.bench_fit [--presets gpt-2.7b,gpt-4b,gpt-6.7b,gpt-8b]
        [--ways jax_remat,ours] [--ideal] [--steps 6] [--batch 4] [--accum K] [--out DIR]
    python -m scripts.bench_fit --tiny            (a CPU smoke run)

Each (preset, way) trains ``scripts/train.py`` in a process of its own (device memory starts
empty; a run that runs out of it cannot spoil the next) for ``--steps`` steps of ``--batch``
sequences of the preset's length, bfloat16 compute, float32 parameters and AdamW. The ways:

* ``jax_keep``: JAX alone, no rematerialization, the optimizer state on the device;
* ``jax_remat``: JAX alone, each layer recomputed from its input (JAX's least memory);
* ``jax_master_remat``: ``jax_remat`` with bfloat16 parameters and their float32 copy on the
  device (the arithmetic of the ways with master weights, everything on the device);
* ``ours``: the four tags of every layer in the store's host tier, the optimizer state in the
  host tier (``--optimizer-location host``: ``offload_optimizer`` and ``apply_gradients``, 8 bytes
  per parameter on the device);
* ``ours_spill``: the same with the optimizer state in ``host,nvme`` (the host tier first, the
  files for what does not fit);
* ``ours_master``: ``ours_spill`` with bfloat16 parameters on the device and their float32 copy
  in the store (``--master-weights``: 4 bytes per parameter on the device, 12 in the store).
* ``ours_master_inplace``: ``ours_master`` with the update in place (``--optimizer-in-place``:
  one version of the 12 bytes per parameter in the store instead of two).
* ``ours_master_inplace_keep`` and ``ours_master_inplace_remat``: the same with the four tags
  saved on the device, or each layer recomputed from its input, instead of the tags in the host
  tier (the host tier all the optimizer state's).

``--mesh`` (``scripts/train.py``'s, e.g. ``dp=4,fsdp``) trains every run, the ideal's too, on
that mesh of the first GPUs (the state made sharded: no device holds the whole model); the
batch is then global (``--batch`` sequences split over ``dp``) and MFU counts every device of
the mesh.

``--accum K`` trains ``K`` micro-batches of ``--batch`` sequences per optimizer step
(``accumulate_gradients``: a float32 mean of the gradients on the device, 4 bytes per parameter;
``--accum-dtype bfloat16`` for the ways with master weights: 2), every way and the ideal alike;
``--steps`` then counts optimizer steps.

A run that fails with XLA's RESOURCE_EXHAUSTED (at compile or at run time) does not fit. Reported
per run: tokens/s over the second half of the steps, the step time, MFU (6 x parameters x tokens/s
over ``--peak-tflops``; attention's FLOPs left out), XLA's peak device memory, the process's peak
resident host memory and the store's traffic. ``--ideal`` also trains each width with few
layers (``--ideal-layers``, default 1, 2, 4 and 8), everything on the device, and extends the time
per layer (a least squares line through the step times) to the preset's layer count: the step
of a device with room for everything (the issue's "ideal"); each run's ``x ideal`` is
its tokens/s over that. A way with master weights is measured against an ideal with them too
(bfloat16 parameters, their float32 copy on the device: the same model and arithmetic).

Writes OUT/fit_<device>_<date>.json, .md and (with matplotlib) .png.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from scripts import bench_common as bc

TAGS = "layer_in=host,qkv=host,attn=host,mlp_up=host"
KEPT = TAGS.replace("=host", "=device")  # the same four tags saved on the device
# ours_master's optimizer state, updated in place (the ways below add where the tags go)
_MASTER_INPLACE = ["--optimizer-location", "host,nvme", "--master-weights", "--optimizer-in-place"]
WAYS = {
  "jax_keep": ["--remat-policy", "keep"],
  "jax_remat": ["--remat-policy", "remat"],
  "jax_master_remat": ["--remat-policy", "remat", "--master-weights"],
  "ours": ["--locations", TAGS, "--optimizer-location", "host"],
  "ours_spill": ["--locations", TAGS, "--optimizer-location", "host,nvme"],
  "ours_master": ["--locations", TAGS, "--optimizer-location", "host,nvme", "--master-weights"],
  "ours_master_inplace": ["--locations", TAGS, *_MASTER_INPLACE],
  "ours_master_inplace_keep": ["--locations", KEPT, *_MASTER_INPLACE],
  "ours_master_inplace_remat": ["--remat-policy", "remat", *_MASTER_INPLACE],
}
# bf16 dense peak of the device kinds this runs on (TFLOP/s), for MFU.
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--presets", default="gpt-2.7b,gpt-4b,gpt-6.7b,gpt-8b")
  p.add_argument("--ways", default="jax_remat,ours", help=f"of {', '.join(WAYS)}")
  p.add_argument(
    "--ideal", action="store_true", help="also the runs of --ideal-layers layers (see above)"
  )
  p.add_argument(
    "--ideal-layers",
    type=_layer_counts,
    default=(1, 2, 4, 8),
    help="layer counts of the ideal's runs, comma-separated (default: 1,2,4,8; 1 and 2 alone "
    "overstate the time per layer by about a third at 4096 wide)",
  )
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
  p.add_argument(
    "--tags",
    default=TAGS,
    help="--locations of the ways that put activations in the host tier (default: %(default)s)",
  )
  p.add_argument(
    "--accum-dtype",
    choices=["float32", "bfloat16"],
    default="float32",
    help="of the running mean of the gradients, for the ways with master weights (the ideal's "
    "and JAX's stay float32)",
  )
  p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
  p.add_argument(
    "--mesh", default=None, help="scripts/train.py's --mesh for every run (e.g. dp=4,fsdp)"
  )
  p.add_argument("--peak-tflops", type=float, default=None, help="default: by device kind")
  p.add_argument("--timeout", type=float, default=900, help="seconds per run")
  p.add_argument("--store-dir", default=None, help="store directory (default: a private temp)")
  p.add_argument(
    "--ssd",
    action="append",
    default=[],
    metavar="VAR=VALUE",
    help="SSDTRAIN_* variable for the runs (e.g. SSDTRAIN_HOST_TIER=100GiB)",
  )
  p.add_argument("--tiny", action="store_true", help="the tiny preset, 2 steps (CPU smoke run)")
  bc.add_out_option(p)
  return p


def _train(args, preset: str, way_args: list[str], env: dict, layers: int | None = None) -> dict:
  """One scripts/train.py process: its summary JSON, or {"error", "oom", "stderr_tail"}."""
  with tempfile.TemporaryDirectory(prefix="bench-fit-") as tmp:
    summary = Path(tmp) / "summary.json"
    cmd = bc.module_command(
      "scripts.train",
      "--preset",
      preset,
      "--batch",
      str(args.batch),
      "--steps",
      str(args.steps * args.accum),  # train.py's steps are micro-batches
      *(["--accum", str(args.accum)] if args.accum > 1 else []),
      *(
        ["--accum-dtype", args.accum_dtype]
        if args.accum > 1 and "--master-weights" in way_args
        else []
      ),
      "--summary-json",
      str(summary),
      *(["--seq-len", str(args.seq_len)] if args.seq_len else []),
      *(["--mesh", args.mesh] if args.mesh else []),
      *(["--layers", str(layers)] if layers else []),
      *(["--store-dir", args.store_dir] if args.store_dir else []),
      *way_args,
    )
    row = bc.run_json_child(cmd, args.timeout, env)
    if summary.exists():
      return json.loads(summary.read_text())
  text = row.get("stderr_tail", "") + row.get("error", "")
  full = [ln for ln in text.splitlines() if "RESOURCE_EXHAUSTED" in ln or "Out of memory" in ln]
  row["oom"] = bool(full) and "ssdtrain" not in full[-1]  # the device's memory, not the store's
  if full and not row["oom"]:
    row["error"] = full[-1].split("RESOURCE_EXHAUSTED: ")[-1][:300]
  row["oom"] = row["oom"] or row.get("error", "").startswith("out of device memory")
  return row


def _measured(s: dict, peak_flops: float | None) -> dict:
  tps = s["tokens_per_s_second_half"] or s["tokens_per_s"]
  return dict(
    fits=True,
    n_params=s["n_params"],
    tokens_per_s=tps,
    step_s=s["tokens_per_step"] / tps if tps else None,
    mfu=6 * s["n_params"] * tps / peak_flops if peak_flops and tps else None,
    peak_device_gb=s["peak_device_gb"],
    peak_host_gb=s["peak_host_gb"],
    store_gb_written_per_step=s["gb_written"] / max(1, s["steps"]),
  )


def _layer_counts(text: str) -> tuple[int, ...]:
  try:
    counts = tuple(sorted({int(t) for t in text.split(",")}))
  except ValueError:
    counts = ()
  if len(counts) < 2 or counts[0] < 1:
    raise argparse.ArgumentTypeError(f"expected two or more layer counts >= 1, got {text!r}")
  return counts


def _ideal(args, preset: str, env: dict, master: bool) -> dict | None:
  """The step of a device with room for everything: the preset's width with few layers
  (``--ideal-layers``), the state on the device (``jax_keep``; with ``master``: bfloat16
  parameters, as the way that it measures), the time per layer (a least squares line through
  the step times) extended to the preset's depth."""
  way = WAYS["jax_keep"] + (["--master-weights"] if master else [])
  runs = [_train(args, preset, way, env, layers=n) for n in args.ideal_layers]
  if any("n_params" not in s for s in runs):
    return None
  import models

  layers = models.get_config("gpt", preset).num_layers
  times = [_measured(s, None)["step_s"] for s in runs]
  ideal = extend_to_depth(args.ideal_layers, times, layers) | dict(master=master)
  ideal["tokens_per_s"] = runs[0]["tokens_per_step"] / ideal["step_s"]
  return ideal


def _mesh_size(spec: str | None) -> int:
  """The devices of ``--mesh`` (1 without one)."""
  if not spec:
    return 1
  from models import parallel

  try:
    return parallel.parse_mesh(spec).size
  except ValueError as e:
    raise SystemExit(f"--mesh {spec!r}: {e}") from None


def extend_to_depth(layer_counts, step_times, layers: int) -> dict:
  """The ideal's step at ``layers`` layers from steps measured at ``layer_counts`` layers (the
  same width, everything on the device): a least squares line through the step times, its time
  per layer extended to the full depth. Also used by bench_layer_stream."""
  per_layer, fixed = np.polyfit(layer_counts, step_times, 1)
  ideal = {f"step_s_{n}": t for n, t in zip(layer_counts, step_times)}
  return ideal | dict(
    step_s=float(fixed + layers * per_layer), per_layer_s=float(per_layer), fixed_s=float(fixed)
  )


def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
  """The bf16 dense peak (TFLOP/s) of ``device_kind`` for MFU (``override`` where given)."""
  low = device_kind.lower()
  return override or next((v for k, v in PEAK_TFLOPS.items() if k in low), None)


def run(args) -> dict:
  import jax

  kind = jax.devices()[0].device_kind
  peak = peak_tflops(kind, args.peak_tflops)
  devices = _mesh_size(args.mesh)
  peak_flops = peak * 1e12 * devices if peak else None
  env = dict(os.environ)
  for item in args.ssd:
    key, sep, value = item.partition("=")
    if not sep or not key.startswith("SSDTRAIN_"):
      raise SystemExit(f"--ssd {item!r}: expected SSDTRAIN_VAR=VALUE")
    env[key] = value
  rows = []
  for preset in args.presets.split(","):
    ideals: dict[bool, dict | None] = {}

    def ideal_for(master: bool, preset=preset) -> dict | None:
      """The ideal of a way with (or without) master weights: the same parameters' dtype."""
      if master not in ideals:
        ideals[master] = _ideal(args, preset, env, master) if args.ideal else None
      return ideals[master]

    for way in args.ways.split(","):
      master = "--master-weights" in WAYS[way]
      ideal = ideal_for(master)
      way_args = [args.tags if a == TAGS else a for a in WAYS[way]]
      s = _train(args, preset, way_args, env)
      if "n_params" in s:
        row = dict(preset=preset, way=way) | _measured(s, peak_flops)
        if ideal:
          row["x_ideal"] = row["tokens_per_s"] / ideal["tokens_per_s"]
      else:
        row = dict(preset=preset, way=way, fits=False, oom=s["oom"], error=s.get("error"))
        row["stderr_tail"] = bc.tail(s.get("stderr_tail", ""), 1500)
      low = args.accum > 1 and master
      row |= dict(
        ideal=ideal,
        batch=args.batch,
        accum=args.accum,
        accum_dtype=args.accum_dtype if low else "float32",
        tags=args.tags if TAGS in WAYS[way] else None,
        steps=args.steps,
        ssd=list(args.ssd),
      )
      rows.append(row)
      print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail"}), flush=True)
  return bc.bench_doc(
    "fit",
    args,
    device_kind=kind,
    peak_tflops=peak,
    mesh=args.mesh,
    devices=devices,
    rows=rows,
  )


def table(doc: dict) -> str:
  lines = [
    f"{doc['device_kind']}"
    + (f" x {doc['devices']}, mesh {doc['mesh']}" if doc.get("mesh") else "")
    + ", sequences of the preset's length (2048)",
    "",
    "| model | way | batch x accum | fits | tokens/s | micro-batch s | MFU | x ideal | device GB "
    "| host GB |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in doc["rows"]:
    low = " (bf16 mean)" if r.get("accum_dtype") == "bfloat16" else ""
    way = r["way"] + (f" (`{r['tags']}`)" if r.get("tags") not in (None, TAGS) else "")
    head = f"| {r['preset']} | {way} | {r['batch']} x {r.get('accum', 1)}{low} |"
    if not r["fits"]:
      why = "no (device memory)" if r.get("oom") else f"no: {r.get('error')}"
      lines.append(f"{head} {why} | | | | | | |")
      continue
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    xi = f"{r['x_ideal']:.2f}" if r.get("x_ideal") else "-"
    lines.append(
      f"{head} yes ({r['n_params'] / 1e9:.2f}B) | {r['tokens_per_s']:,.0f} | {r['step_s']:.2f} | "
      f"{mfu} | {xi} | {r['peak_device_gb']:.1f} | {r['peak_host_gb']:.1f} |"
    )
  return "\n".join(lines)


def plot(plt, doc: dict, path: Path) -> str | None:
  fits = [r for r in doc["rows"] if r["fits"]]
  if not fits:
    return "no plot: no configuration fits"
  with bc.figure(plt, path, figsize=(6, 3)) as (_, ax):
    for way in sorted({r["way"] for r in fits}):
      pts = [(r["n_params"] / 1e9, r["tokens_per_s"]) for r in fits if r["way"] == way]
      ax.plot(*zip(*pts), marker="o", label=way)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens/s")
    ax.legend()


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  if args.tiny:
    args.presets, args.steps, args.batch, args.ideal = "tiny", 2, 2, True
    args.ideal_layers = (1, 2)  # tiny has 2 layers
  doc = run(args)
  bc.write_bench(args.out, f"fit_{bc.slug(doc['device_kind'])}", doc, table(doc), plot)
  return doc


if __name__ == "__main__":
  main()
