"""Sphinx configuration of the jax_ssdtrain documentation: MyST Markdown pages, API pages from
docstrings (autodoc), the results page included from the repository's BENCHMARKS.md.

Build (warnings are errors, as in CI): ``pip install -r docs/requirements.txt`` then
``sphinx-build -W -b html docs docs/_build/html``. jax_ssdtrain is imported from this checkout
and its native library is not needed: the package loads it on first use, which autodoc never
makes, so the build compiles nothing.
"""

import posixpath
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jax_ssdtrain

import jax_ssdtrain  # noqa: E402

project = "jax_ssdtrain"
author = "the jax_ssdtrain authors"
release = version = jax_ssdtrain.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-section-title) links to a section of another page

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "sphinx_book_theme"
html_title = "jax_ssdtrain"
html_theme_options = {"show_toc_level": 2}

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# Pages of the repository root that have a counterpart in the docs.
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "results.md"}
_LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


def _rebase_links(text: str, included: Path) -> str:
  """Links of a file included from outside ``docs/`` (BENCHMARKS.md) made relative to
  ``docs/``: a data file or plot becomes a download or an image, a root page its docs page."""
  base = posixpath.relpath(included.parent.as_posix(), DOCS.as_posix())

  def rebase(m: re.Match) -> str:
    label, target = m.groups()
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # URL, anchor, absolute
      return m.group(0)
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(base, path))
    if resolved.startswith("../"):
      resolved = ROOT_PAGES.get(resolved[3:], resolved)
    return f"{label}({resolved}{'#' + anchor if anchor else ''})"

  return _LINK.sub(rebase, text)


def _on_include_read(app, relative_path, parent_docname, content):
  included = (DOCS / relative_path).resolve()
  if DOCS not in included.parents:
    content[0] = _rebase_links(content[0], included)


def setup(app):
  app.connect("include-read", _on_include_read)
