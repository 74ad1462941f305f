"""Helpers shared by the benchmark scripts: child processes, the storage probe, output files.

Nothing here imports JAX: a benchmark's parent process must not touch the accelerator (JAX
would reserve most of its memory); only its child processes do.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


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


def write_results(stem: Path, doc: dict, text: str, plot=None, *, quiet: bool = False) -> None:
  """STEM.json (``doc``) and STEM.md (``text``), and unless ``quiet``: the table printed and,
  with ``plot`` (a function of (pyplot, .png path) returning whether it drew) and matplotlib
  installed, STEM.png."""
  stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
  stem.with_suffix(".md").write_text(text + "\n")
  if quiet:
    return
  print(text)
  plt = pyplot() if plot is not None else None
  if plt is not None and plot(plt, stem.with_suffix(".png")):
    print(f"plot: {stem.with_suffix('.png')}")


def slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_") or "unknown"


def today() -> str:
  return datetime.date.today().strftime("%Y%m%d")


def run_json_child(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
  """Runs ``cmd``; returns the last JSON object it printed on stdout, else ``{"error": ...}``."""
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  except subprocess.TimeoutExpired as e:
    return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": tail(e.stderr)}
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if proc.returncode:
        row.setdefault("error", f"exit status {proc.returncode}")
        row["stderr_tail"] = tail(proc.stderr)
      return row
  return {
    "error": f"exit status {proc.returncode}, no JSON line printed",
    "stderr_tail": tail(proc.stderr) or tail(proc.stdout),
  }


# ---------------------------------------------------------------------------------------------
# Storage probe (/work/shared/tools/storage_probe.py, run as a subprocess, never copied here)

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
