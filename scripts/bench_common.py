"""What the benchmark scripts share: the GPT-like layer stack they measure and its policies, child
processes, the storage probe, and their one tail: the output directory and the files written
there (``write_results``: STEM.json, the table as STEM.md and printed, the plot drawn by
``plot(plt, doc, path)`` in a ``figure`` as STEM.png; ``replot`` for saved runs).

Importing this module imports no JAX (the stack's functions import it when called): a
benchmark's parent process must not touch the accelerator (JAX would reserve most of its
memory); only its child processes do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where results go unless --out says otherwise: outside the source tree.
DEFAULT_OUT = Path(tempfile.gettempdir()) / "jax_ssdtrain-benchmarks"


def add_out_option(parser: argparse.ArgumentParser) -> None:
  """``--out DIR``: where the JSON, table and plot go (default: DEFAULT_OUT)."""
  parser.add_argument(
    "--out",
    type=Path,
    default=DEFAULT_OUT,
    help=f"directory of the results: JSON, table, plot (default: {DEFAULT_OUT})",
  )


def child_env(env: dict | None = None) -> dict:
  """``env`` (default: this process's environment) with the repository root first on
  PYTHONPATH, so that a ``python -m scripts.NAME`` child imports this checkout's ``scripts``,
  ``models`` and ``jax_ssdtrain`` whatever its working directory."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
  return env


def module_command(module: str, *args: str) -> list[str]:
  """The command line running ``module`` (e.g. ``scripts.bench_rok``) with this interpreter."""
  return [sys.executable, "-m", module, *args]


def tail(text, n: int = 3000) -> str:
  if isinstance(text, bytes):
    text = text.decode(errors="replace")
  return (text or "")[-n:]


def pyplot():
  """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed (the
  benchmarks then write their JSON and tables without a plot)."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt


# ---------------------------------------------------------------------------------------------
# The tail of every benchmark: its JSON, table and plot written one way


def stem_of(path: Path) -> Path:
  """``DIR/NAME.json`` -> ``DIR/NAME`` (a name with dots of its own kept whole)."""
  path = Path(path)
  return path.with_name(path.name.removesuffix(".json"))


def write_results(stem: Path, doc: dict, text: str, plot=None, *, quiet: bool = False) -> None:
  """STEM.json (``doc``) and STEM.md (``text``), and unless ``quiet``: the table printed and,
  with ``plot`` and matplotlib installed, STEM.png. ``plot(plt, doc, path)`` draws ``doc``'s
  figure into ``path`` (see :func:`figure`); it returns a note saying why, where it draws
  nothing, else None."""
  stem = Path(stem)
  stem.parent.mkdir(parents=True, exist_ok=True)
  Path(f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
  Path(f"{stem}.md").write_text(text + "\n")
  if quiet:
    return
  print(text)
  if plot is None:
    return
  plt = pyplot()
  png = Path(f"{stem}.png")
  note = "no plot: matplotlib is not installed" if plt is None else plot(plt, doc, png)
  print(note or f"plot: {png}")


def bench_doc(bench: str, args, **fields) -> dict:
  """A benchmark's JSON: its name, date, arguments (as text) and environment, then ``fields``."""
  return dict(
    bench=bench,
    date=today(),
    args={k: str(v) for k, v in vars(args).items()},
    env=host_env(),
    **fields,
  )


def write_bench(out: Path, name: str, doc: dict, text: str, plot=None) -> Path:
  """``write_results`` into OUT/NAME_<today>.* (OUT made if missing), then prints the JSON's
  path; returns the stem."""
  stem = Path(out) / f"{name}_{today()}"
  write_results(stem, doc, text, plot)
  print(f"wrote {stem}.json")
  return stem


@contextlib.contextmanager
def figure(plt, path: Path, *args, dpi=None, **kwargs):
  """``plt.subplots(*args, **kwargs)`` (the figure and its axes) for a ``with`` block, after
  which the figure is laid out, saved to ``path`` and closed."""
  fig, axes = plt.subplots(*args, **kwargs)
  yield fig, axes
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)


def replot(paths: list[Path], out: Path, name: str, report, *, keys, field, tag_source=False):
  """``--replot``: the table and plot of saved runs again, through ``report(doc, stem)``. One
  JSON is rewritten in place; several are merged into OUT/NAME_<device>_<date of the first>:
  their ``field`` items in order (with ``tag_source``, each with the index of its run in
  ``sources``), and in ``sources`` each run's file and ``keys``."""
  docs = [json.loads(Path(p).read_text()) for p in paths]
  if len(docs) == 1:
    report(docs[0], stem_of(paths[0]))
    return 0
  doc = {
    "date": docs[0]["date"],
    "env": docs[0]["env"],
    "sources": [{"file": p.name} | {k: d.get(k) for k in keys} for p, d in zip(paths, docs)],
    field: [
      item | {"source": i} if tag_source else item for i, d in enumerate(docs) for item in d[field]
    ],
  }
  report(doc, Path(out) / f"{name}_{slug(doc['env'].get('device_kind'))}_{doc['date']}")
  return 0


def device_kind(rows) -> str:
  """The device kind a run's rows recorded (JAX's ``device_kind``); where none ran far enough
  to record one, the first GPU's name from ``nvidia-smi`` (JAX's kind for NVIDIA GPUs), else
  ``"unknown"``: the results' file names and tables then still name the machine."""
  kind = next((r["device_kind"] for r in rows if r and "device_kind" in r), None)
  if kind:
    return kind
  try:
    out = (
      subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
      )
      .stdout.split("\n")[0]
      .strip()
    )
  except (OSError, subprocess.TimeoutExpired):
    out = ""
  return out or "unknown"


def slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_") or "unknown"


def today() -> str:
  return datetime.date.today().strftime("%Y%m%d")


def run_json_child(
  cmd: list[str], timeout: float, env: dict | None = None, *, partial: bool = False
) -> dict:
  """Runs ``cmd`` (environment: ``child_env(env)``); returns the last JSON object it printed on
  stdout, else ``{"error": ...}``. With ``partial``, a child that times out gives the last JSON
  object it printed before (a child that prints its results so far after each part keeps
  them), with the error. A child of several GPUs that ran out of device memory on one while
  the others wait for it in a collective's rendezvous (XLA logs "may be stuck") is stopped
  ``STUCK_AFTER_OOM_S`` seconds later instead of at ``timeout``: it does not fit."""
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(env)
  )
  out, err, stuck = [], [], threading.Event()

  def drain(stream, lines, watch):
    oom = False
    for line in stream:
      lines.append(line)
      if watch:
        oom = oom or "ran out of memory trying to allocate" in line
        if oom and "may be stuck" in line:
          stuck.set()

  readers = [
    threading.Thread(target=drain, args=(proc.stdout, out, False), daemon=True),
    threading.Thread(target=drain, args=(proc.stderr, err, True), daemon=True),
  ]
  for r in readers:
    r.start()
  deadline, stuck_at = time.monotonic() + timeout, None
  while proc.poll() is None:
    now = time.monotonic()
    if stuck.is_set() and stuck_at is None:
      stuck_at = now
    if now >= deadline or (stuck_at is not None and now - stuck_at >= STUCK_AFTER_OOM_S):
      proc.kill()
      proc.wait()
      for r in readers:
        r.join()
      why = (
        f"out of device memory on one GPU, the others stuck in a collective (stopped after "
        f"{STUCK_AFTER_OOM_S:.0f} s)"
        if stuck_at is not None
        else f"timed out after {timeout:.0f} s"
      )
      row = (partial and _last_json("".join(out))) or {}
      return row | {"error": why, "stderr_tail": tail("".join(err))}
    time.sleep(0.5)
  for r in readers:
    r.join()
  stdout, stderr = "".join(out), "".join(err)
  row = _last_json(stdout)
  if row is not None:
    if proc.returncode:
      row.setdefault("error", f"exit status {proc.returncode}")
      row["stderr_tail"] = tail(stderr)
    return row
  return {
    "error": f"exit status {proc.returncode}, no JSON line printed",
    "stderr_tail": tail(stderr) or tail(stdout),
  }


STUCK_AFTER_OOM_S = 60.0


def _last_json(stdout: str) -> dict | None:
  """The last line of ``stdout`` that is a JSON object, else None."""
  for line in reversed(stdout.splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue
  return None


# ---------------------------------------------------------------------------------------------
# Raw O_DIRECT probe of a store directory: shared/tools/storage_probe.py beside or inside the
# checkout (not part of this repository; optional), run as a subprocess

_PROBE_LINE = re.compile(
  r"threads=(\d+) block=(\d+)MiB O_DIRECT write ([\d.]+) GB/s "
  r"read ([\d.]+) GB/s"
)


def storage_probe_script() -> Path | None:
  """``<repo>/../shared/tools/storage_probe.py`` (or ``<repo>/shared/...`` on the GPU copy)."""
  for base in (REPO_ROOT.parent, REPO_ROOT):
    path = base / "shared" / "tools" / "storage_probe.py"
    if path.is_file():
      return path
  return None


def run_storage_probe(
  directory: str | os.PathLike, gb: float, timeout: float = 900, script: Path | None = None
) -> dict:
  """Raw O_DIRECT bandwidth of ``directory``: best write/read GB/s over the probe's settings."""
  script = script or storage_probe_script()
  if script is None or not Path(script).is_file():
    return {"note": f"storage_probe.py not found ({script or 'shared/tools'}); probe skipped"}
  cmd = [sys.executable, str(script), str(directory), str(gb)]
  out = {"cmd": " ".join(cmd), "dir": str(directory), "GB": gb}
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    return out | {"note": f"probe timed out after {timeout:.0f} s", "stderr_tail": tail(e.stderr)}
  rows = [
    {
      "threads": int(m[1]),
      "block_MiB": int(m[2]),
      "write_GBps": float(m[3]),
      "read_GBps": float(m[4]),
    }
    for m in _PROBE_LINE.finditer(proc.stdout)
  ]
  out["rows"] = rows
  if not rows:
    return out | {"note": f"probe failed (exit status {proc.returncode}): {tail(proc.stderr, 500)}"}
  out["write_GBps"] = max(r["write_GBps"] for r in rows)
  out["read_GBps"] = max(r["read_GBps"] for r in rows)
  return out


# ---------------------------------------------------------------------------------------------
# Environment of a run (parent side: no JAX backend is initialized)


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git(*args: str) -> str | None:
  try:
    return (
      subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
      ).stdout.strip()
      or None
    )
  except (OSError, subprocess.TimeoutExpired):
    return None


def host_env() -> dict:
  return {
    "python": platform.python_version(),
    "jax": _version("jax"),
    "jaxlib": _version("jaxlib"),
    "host": platform.node(),
    "cpu_count": os.cpu_count(),
    "git_commit": _git("rev-parse", "HEAD"),
    "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    "env": {
      k: v
      for k, v in os.environ.items()
      if k.startswith(("SSDTRAIN_", "XLA_", "JAX_", "CUDA_VISIBLE", "TF_CPP"))
    },
  }


def merge_rows(old: list[dict], new: list[dict], key) -> list[dict]:
  """``old`` rows not replaced by a ``new`` row with the same key, then ``new`` rows."""
  fresh = {key(r) for r in new}
  return [r for r in old if key(r) not in fresh] + list(new)


# ---------------------------------------------------------------------------------------------
# The GPT-like layer stack of bench_rok, bench_planner and bench_emulated: bf16, heads of 128,
# ``lax.scan`` over layers; tags ``layer_in``, ``qkv``, ``attn``, ``mlp_up``.

NAMES = ("layer_in", "qkv", "attn", "mlp_up")
WIDTH = {"layer_in": 1, "qkv": 3, "attn": 1, "mlp_up": 4}  # tensor elements per token, in H
# ssd_nvme_sweep_K: the first K of these tag sets to nvme, the rest saved on the device
SWEEP = (("layer_in",), ("layer_in", "attn"), ("layer_in", "attn", "qkv"), NAMES)
DEFAULT_SHAPES = ((4096, 2048, 4, 8), (8192, 2048, 2, 4))  # H, S, B, L
TINY_SHAPES = ((256, 128, 2, 2),)
HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Spec:
  """Where a policy puts the four tags. Untagged values are always recomputed."""

  offloaded: tuple[str, ...] = ()  # tags that leave the device
  saved: tuple[str, ...] = ()  # tags saved on the device
  via: str = "pinned_host"  # offload target: JAX's pinned_host, or ssd "host" / "nvme"
  remat: bool = True  # False: no jax.checkpoint at all
  small_cache: bool = False  # host cache of bench_rok's --sweep-host-cache

  @property
  def ssd(self) -> bool:
    return self.via in ("host", "nvme")

  def policy(self, min_bytes: int):
    import jax

    cp = jax.checkpoint_policies
    if not self.remat:
      return None
    if self.ssd:
      import jax_ssdtrain as ssd

      return ssd.offload_policy(self.offloaded, self.saved, min_bytes=min_bytes, location=self.via)
    if self.offloaded:
      return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=list(self.saved),
        names_which_can_be_offloaded=list(self.offloaded),
        offload_src="device",
        offload_dst="pinned_host",
      )
    return cp.save_only_these_names(*self.saved) if self.saved else cp.nothing_saveable


def _rest(names):
  return tuple(n for n in NAMES if n not in names)


POLICIES = {
  "keep": Spec(remat=False),
  "recompute": Spec(),
  "selective": Spec(saved=NAMES),
  "jax_host_layer_in": Spec(offloaded=("layer_in",)),
  "jax_host_named": Spec(offloaded=NAMES),
  "ssd_host_named": Spec(offloaded=NAMES, via="host"),
  "ssd_host_layer_in": Spec(offloaded=("layer_in",), via="host"),
  "ssd_nvme_named": Spec(offloaded=NAMES, via="nvme"),
  "ssd_nvme_layer_in": Spec(offloaded=("layer_in",), via="nvme"),
  **{
    f"ssd_nvme_sweep_{k}": Spec(offloaded=s, saved=_rest(s), via="nvme", small_cache=True)
    for k, s in enumerate(SWEEP, 1)
  },
}


def parse_shape(text: str) -> tuple[int, int, int, int]:
  """``"H,S,B,L"`` -> ``(H, S, B, L)``; an argparse type (H a multiple of HEAD_DIM)."""
  try:
    shape = tuple(int(v) for v in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 4 or min(shape) <= 0 or shape[0] % HEAD_DIM:
    raise argparse.ArgumentTypeError(
      f"expected H,S,B,L with H a multiple of {HEAD_DIM}, got {text!r}"
    )
  return shape


def model_flops(H, S, B, L):
  """Forward + backward FLOPs of the stack, causal attention."""
  return L * (24 * B * S * H * H + 2 * B * S * S * H) * 3


def offload_bytes(spec: Spec, H, S, B, L, min_bytes) -> int:
  """Bytes per step that the policy sends off the device, from the shapes."""
  sizes = [WIDTH[n] * B * S * H * 2 for n in spec.offloaded]  # bf16
  return L * sum(b for b in sizes if b >= min_bytes or not spec.ssd)


def make_layer(heads: int, attention_impl):
  """One block of the stack: ``layer(x, p) -> x`` with x (B, S, H) and p one layer's weights."""
  import jax
  import jax.numpy as jnp
  from jax.ad_checkpoint import checkpoint_name

  def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

  def layer(x, p):
    B, S, H = x.shape
    x = checkpoint_name(x, "layer_in")
    qkv = checkpoint_name(rms(x) @ p["wqkv"], "qkv")
    q, k, v = jnp.split(qkv.reshape(B, S, 3 * heads, H // heads), 3, axis=2)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_impl)
    a = checkpoint_name(a.reshape(B, S, H), "attn")
    x = x + a @ p["wo"]
    u = checkpoint_name(rms(x) @ p["w1"], "mlp_up")
    return x + jax.nn.gelu(u) @ p["w2"]

  return layer


def make_step(policy, heads: int, attention_impl):
  """jit(value_and_grad) of the whole stack, each layer under ``policy`` (None: no remat)."""
  import jax
  import jax.numpy as jnp

  layer = make_layer(heads, attention_impl)
  body = lambda x, p: (layer(x, p), None)  # noqa: E731
  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)

  def loss(params, x):
    y, _ = jax.lax.scan(body, x, params)
    return jnp.mean(y.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss))


def stack_params(H, S, B, L):
  """``(params, x)``: the stacked weights of L layers (leading axis L) and an input (B, S, H)."""
  import jax
  import jax.numpy as jnp

  k = jax.random.split(jax.random.key(0), 5)

  def w(kk, shape):
    return (jax.random.normal(kk, (L,) + shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

  params = {
    "wqkv": w(k[0], (H, 3 * H)),
    "wo": w(k[1], (H, H)),
    "w1": w(k[2], (H, 4 * H)),
    "w2": w(k[3], (4 * H, H)),
  }
  return params, jax.random.normal(k[4], (B, S, H), jnp.bfloat16)


def device_bytes(compiled) -> int | None:
  """The device bytes a compiled program takes while it runs: its arguments, outputs and
  temporaries, less the outputs that alias arguments (None where the backend gives no memory
  analysis)."""
  ma = compiled.memory_analysis()
  if ma is None:
    return None
  return int(
    ma.argument_size_in_bytes
    + ma.output_size_in_bytes
    + ma.temp_size_in_bytes
    - ma.alias_size_in_bytes
  )


# ---- the engine's counters and GPU copy timeline (ssd.stats(), ssd.timeline())


def engine_row(s: dict, steps: int) -> dict:
  per = lambda key: s.get(key, 0) / steps  # noqa: E731
  gb = lambda key: s.get(key, 0) / 1e9  # noqa: E731
  gpu = {}
  if "link_d2h_bytes" in s:  # CUDA handlers: copies timed with CUDA events
    gpu = {
      "link_d2h_GB_per_step": per("link_d2h_bytes") / 1e9,
      "link_h2d_GB_per_step": per("link_h2d_bytes") / 1e9,
      "link_d2h_busy_ms_per_step": per("link_d2h_busy_seconds") * 1e3,
      "link_h2d_busy_ms_per_step": per("link_h2d_busy_seconds") * 1e3,
      "link_overlap_ms_per_step": per("link_overlap_seconds") * 1e3,
      "link_d2h_GBps": s.get("link_d2h_GBps", 0.0),
      "link_h2d_GBps": s.get("link_h2d_GBps", 0.0),
      "compute_wait_ms_per_step": per("gpu_compute_wait_seconds") * 1e3,
      "load_host_ms_per_step": per("gpu_load_host_seconds") * 1e3,
      "stage_copies_ms_per_step": (per("gpu_stage_in_seconds") + per("gpu_load_staged_seconds"))
      * 1e3,
      "d2h_elided_GB_per_step": per("d2h_elided_bytes") / 1e9,
      # host time in loads' handle reads and last-load syncs (a stalled enqueue, not the GPU's)
      "handle_sync_ms_per_step": per("handle_sync_seconds") * 1e3,
    }
  return gpu | {
    "offload_GB_per_step": per("bytes_written") / 1e9,
    "loaded_GB_per_step": per("bytes_read") / 1e9,
    "disk_MB_written_per_step": per("disk_bytes_written") / 1e6,
    "disk_MB_read_per_step": per("disk_bytes_read") / 1e6,
    "write_skipped_MB_per_step": per("write_skipped_bytes") / 1e6,
    "host_tier_GB_peak": gb("host_tier_bytes_peak"),
    "host_cache_GB_peak": gb("host_cache_bytes_peak"),
    "staging_GB_peak": gb("staging_bytes_peak"),
    "file_GB_peak": gb("file_bytes_peak"),
    "stall_ms_per_step": per("stall_seconds") * 1e3,
    "prefetch_hits_per_step": per("prefetch_hits"),
    "prefetch_misses_per_step": per("prefetch_misses"),
    "forwarded_tensors_per_step": per("forwarded_tensors"),
    "write_GBps": s.get("write_GBps", 0.0),
    "read_GBps": s.get("read_GBps", 0.0),
    "engine": s,
  }


# The stream each of the timeline's operations runs on (docs: ssd.timeline()).
STREAM_OF = {
  "stage_in": "compute",
  "load_staged": "compute",
  "load_host": "compute",
  "compute_wait": "compute",
  "d2h": "copy (D2H)",
  "read_ahead": "read-ahead (H2D)",
}


def timeline_trace(groups) -> dict:
  """``(label, timeline)`` pairs as a Chrome trace (chrome://tracing, ui.perfetto.dev): a process
  per pair, a thread per stream."""
  events = []
  for pid, (label, records) in enumerate(groups):
    events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
    for rec in records:
      events.append(
        {
          "ph": "X",
          "pid": pid,
          "tid": STREAM_OF.get(rec["op"], rec["op"]),
          "name": f"{rec['op']} {rec['name']}",
          "cat": rec["op"],
          "ts": rec["start"] * 1e6,
          "dur": (rec["end"] - rec["start"]) * 1e6,
          "args": {"bytes": rec["bytes"], "device": rec["device"]},
        }
      )
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timelines(path: Path, rows: list[dict], label) -> None:
  """Writes the rows' one-step timelines (each row's ``"timeline"``) to ``path`` as a Chrome
  trace, a process per row named ``label(row)``, and prints its path; each row then keeps a
  per-operation summary (``"timeline_step"``) in place of every copy."""
  traced = [r for r in rows if r.get("timeline")]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(timeline_trace((label(r), r["timeline"]) for r in traced)) + "\n")
  print(f"wrote {path}")
  for r in rows:
    if "timeline" in r:
      r["timeline_step"] = timeline_summary(r.pop("timeline"))


def timeline_summary(records: list[dict]) -> dict:
  """Per operation of one step: count, bytes and busy ms."""
  out: dict = {}
  for rec in records:
    o = out.setdefault(rec["op"], {"count": 0, "bytes": 0, "ms": 0.0})
    o["count"] += 1
    o["bytes"] += rec["bytes"]
    o["ms"] += (rec["end"] - rec["start"]) * 1e3
  return out
