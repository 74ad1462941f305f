"""The documentation in docs/ against the code: every ```python block of a page runs (the page's
blocks in order, in a fresh process per page, on CPU), every public name has an API entry and
every exception class of the library a troubleshooting entry; the docs build installs from
docs/requirements.txt and needs no native library.

Examples that cannot run on a CPU-only machine are written as ```console or ```text blocks.
"""

import ast
import builtins
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from _docs_common import code_blocks, run_python

import jax_ssdtrain

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def test_code_blocks_are_found():
  text = "a\n```python\nx = 1\n```\n```console\n$ ls\n```\n````python\ny = 2\n```\n````\n"
  assert code_blocks(text) == ["x = 1\n", "y = 2\n```\n"]
  assert code_blocks(text, "console") == ["$ ls\n"]
  assert any(code_blocks(p.read_text()) for p in PAGES)


@pytest.mark.parametrize(
  "page", [p for p in PAGES if code_blocks(p.read_text())], ids=lambda p: p.name
)
def test_page_examples_run(page, tmp_path):
  code = "\n".join(code_blocks(page.read_text()))
  proc = run_python(code, tmp_path, f"docs_{page.stem}.py")  # not flax.py: it would shadow flax
  assert proc.returncode == 0, (
    f"the examples of docs/{page.name} fail:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  )


def test_api_reference_lists_every_public_name():
  api = (DOCS / "api.md").read_text()
  missing = [n for n in jax_ssdtrain.__all__ if f"jax_ssdtrain.{n}\n" not in api]
  assert not missing, f"docs/api.md has no entry for jax_ssdtrain.{missing}"


def _exception_classes() -> dict[str, str]:
  """``{class name: file}`` of every class in jax_ssdtrain/ that derives from an exception."""
  found, bases_of = {}, {}
  for path in sorted((ROOT / "jax_ssdtrain").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef):
        bases_of[node.name] = (path, [ast.unparse(b).split(".")[-1] for b in node.bases])

  def is_exception(name, seen=()):
    if name in bases_of and name not in seen:
      return any(is_exception(b, seen + (name,)) for b in bases_of[name][1])
    builtin = getattr(builtins, name, None)
    return isinstance(builtin, type) and issubclass(builtin, BaseException)

  for name, (path, _) in bases_of.items():
    if is_exception(name):
      found[name] = str(path.relative_to(ROOT))
  return found


def test_every_exception_class_has_a_troubleshooting_entry():
  classes = _exception_classes()
  assert "HigherOrderOffloadError" in classes  # the scan itself works
  page = (DOCS / "troubleshooting.md").read_text()
  missing = {n: f for n, f in classes.items() if f"`{n}`" not in page}
  assert not missing, f"docs/troubleshooting.md names no entry for the exception classes {missing}"
  public = [
    n
    for n in jax_ssdtrain.__all__
    if isinstance(getattr(jax_ssdtrain, n), type)
    and issubclass(getattr(jax_ssdtrain, n), BaseException)
  ]
  assert public and all(n in classes for n in public), public


def test_docs_install_from_their_requirements_and_need_no_native_library():
  reqs = (DOCS / "requirements.txt").read_text().splitlines()
  reqs = [r.strip() for r in reqs if r.strip() and not r.startswith("#")]
  assert {"sphinx>=7.2.5", "myst-parser>=4", "sphinx-book-theme"} <= set(reqs), reqs
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  jax_req = [d for d in project["dependencies"] if re.match(r"jax\b(?!lib)", d)]
  assert jax_req and set(jax_req) <= set(reqs), (jax_req, reqs)  # autodoc imports jax_ssdtrain
  command = "pip install -r docs/requirements.txt && sphinx-build -W -b html docs docs/_build/html"
  assert command in " ".join((ROOT / "README.md").read_text().split()), "README's docs command"
  ci = (ROOT / ".ci" / "run").read_text()
  assert "pip install -q -r docs/requirements.txt" in ci and "extra docs" not in ci
  assert "docs" not in project["optional-dependencies"], "one list of the docs' requirements"
  # What docs/conf.py and autodoc import, with no libssdtrain.so to be found.
  env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
  env.update(SSDTRAIN_LIB=str(ROOT / "no-such-dir" / "libssdtrain.so"), JAX_PLATFORMS="cpu")
  env.pop("PYTHONPATH", None)
  code = (
    "import runpy, sys; runpy.run_path(sys.argv[1]); "
    "import jax_ssdtrain.checkpointing, jax_ssdtrain.probe, jax_ssdtrain.maxtext; "
    "from jax_ssdtrain._src import native; assert not native.available(); print('ok')"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code, str(DOCS / "conf.py")],
    cwd=DOCS,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
