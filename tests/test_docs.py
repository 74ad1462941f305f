"""The documentation in docs/ against the code: every ```python block of a page runs (the page's
blocks in order, in a fresh process per page, on CPU), every public name has an API entry and
every exception class of the library a troubleshooting entry.

Examples that cannot run on a CPU-only machine are written as ```console or ```text blocks.
"""

import ast
import builtins
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
