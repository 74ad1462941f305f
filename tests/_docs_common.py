"""Helpers of the documentation tests: Markdown code blocks, and running one as a user would."""

import os
import re
import subprocess
import sys
from pathlib import Path

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")


def code_blocks(text: str, language: str = "python") -> list[str]:
  """The fenced code blocks of a Markdown text in ``language``, in order."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, lang = m.groups()
    body, i = [], i + 1
    while i < len(lines) and not (
      lines[i].startswith(fence[0] * len(fence)) and not lines[i].strip(fence[0]).strip()
    ):
      body.append(lines[i])
      i += 1
    i += 1
    if lang == language:
      blocks.append("\n".join(body) + "\n")
  return blocks


def run_python(code: str, workdir: Path, name: str, timeout: float = 600):
  """Runs ``code`` as ``workdir/name`` in a fresh interpreter on JAX's CPU backend, as a user's
  script would run (the installed packages only), with no store settings from the environment."""
  script = workdir / name
  script.write_text(code)
  env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
  env.update(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(workdir / "cache"))  # probe caches
  env.pop("PYTHONPATH", None)
  return subprocess.run(
    [sys.executable, str(script)],
    cwd=workdir,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
