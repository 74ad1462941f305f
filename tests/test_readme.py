"""The README is the front page: its two commands come first, exactly, and its example runs as
written and shows that it offloaded something and saved device memory."""

import re
import tomllib
from pathlib import Path

from _docs_common import code_blocks, run_python

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

DEMO = (
  'pip install ".[demo]" && python -m scripts.train --model gpt --preset tiny --steps 30 '
  "--locations layer_in=nvme,qkv=nvme,attn=nvme,mlp_up=nvme"
)
TESTS = 'pip install ".[test]" && python -m pytest -q -ra -n 2'


def test_the_two_commands_are_the_first_code_lines():
  first = re.search(r"^```[^\n]*\n(.*?)^```", README, re.S | re.M).group(1)
  assert [ln for ln in first.splitlines() if ln.strip()] == [DEMO, TESTS]
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert {"demo", "test"} <= set(extras["optional-dependencies"])
  assert (ROOT / "scripts" / "train.py").is_file()


def test_readme_example_runs_as_written(tmp_path):
  blocks = code_blocks(README)
  assert blocks, "README.md has no ```python example"
  proc = run_python(blocks[0], tmp_path, "readme_example.py")
  assert proc.returncode == 0, f"README example failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
  out = proc.stdout
  offloaded = re.search(r"offloaded (\d+) tensors, (\d+) MiB", out)
  assert offloaded and int(offloaded.group(1)) > 0 and int(offloaded.group(2)) > 0, out
  loaded = re.search(r"loaded (\d+) tensors", out)
  assert loaded and loaded.group(1) == offloaded.group(1), out
  memory = dict(re.findall(r"(keep|offload): device memory for the step (\d+) MiB", out))
  assert set(memory) == {"keep", "offload"}, out
  assert int(memory["offload"]) < int(memory["keep"]), out


def test_readme_links_reach_files():
  targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
  local = [t for t in targets if "://" not in t]
  assert any(t.startswith("docs/") for t in local), local
  missing = [t for t in local if not (ROOT / t).exists()]
  assert not missing, f"README.md links to missing files {missing}"
