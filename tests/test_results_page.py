"""BENCHMARKS.md against what backs it: every file in benchmarks/ is linked from the page and
every link resolves, each table shows the numbers of its JSON, and every stage the page names
is one that scripts/gpu.sh runs."""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "BENCHMARKS.md").read_text()
RESULTS = ROOT / "benchmarks"
GPU_SH = ROOT / "scripts" / "gpu.sh"


def section(bench: str) -> str:
  """The page's text from the link to benchmarks/BENCH.json to the next heading."""
  start = PAGE.index(f"(benchmarks/{bench}.json)")
  end = PAGE.find("\n## ", start)
  return PAGE[start : end if end >= 0 else None]


def ms(value) -> str:
  return f"{value:.1f}"


def shown(doc: dict, bench: str) -> list[str]:
  """The numbers of BENCH's JSON that its table shows, formatted as the table does."""
  if bench in ("rok", "rok_128k", "host_tier", "emulated"):
    return [ms(r["step_ms_median"]) for r in doc["rows"]]
  if bench == "link":
    return [f"{r[k]:.1f}" for r in doc["rows"] for k in ("d2h_GBps", "h2d_GBps")]
  if bench in ("planner", "planner_nvme"):
    return [ms(r[k]) for p in doc["parts"] for r in p["rows"] for k in ("predicted_ms", "step_ms")]
  if bench == "planner_cap":
    autos = [r for c in doc["parts"][0]["caps"] for r in c["rows"] if r["policy"] == "auto"]
    return [ms(r[k]) for r in autos for k in ("predicted_ms", "step_ms")]
  if bench == "train":
    return [f"{r['tokens_per_s']:,}" for r in doc["rows"]]
  if bench in ("maxtext", "maxtext_fsdp", "maxtext_fsdp_qkv"):  # failed or skipped rows: why
    return [ms(r["step_s_median"] * 1e3) for r in doc["rows"] if r.get("step_s_median")]
  if bench in ("optimizer", "optimizer_fsdp"):
    return [ms(r["step_s"] * 1e3) for r in doc["rows"]]
  if bench == "accumulate":  # each row: update and accumulate ms, then x device at each k
    times = [ms(r[k] * 1e3) for r in doc["rows"] for k in ("update_s", "accumulate_s")]
    return times + [f"{r[f'x_device_k{k}']:.3f}" for r in doc["rows"] for k in doc["accum"]]
  if bench == "multigpu":
    return [ms(r[k]) for r in doc["rows"] for k in ("step_ms_1", "step_ms_n")]
  if bench == "checkpoint":
    return [f"{r[k]:.2f}" for r in doc["rows"] for k in ("save_s", "restore_s")]
  if bench in ("layerstream", "layerstream_h200"):  # the streamed run and its ideal
    return [f"{doc[k]['step_s']:.2f}" for k in ("streamed", "ideal")]
  if bench.startswith("longctx"):  # rows that ran, and the ideal's runs that did
    return [f"{r['step_s']:.3f}" for r in doc["rows"] + doc["ideal_runs"] if r.get("step_s")]
  if bench in ("fit", "fit_node"):  # rows that do not fit show why; the node's its ideal too
    fits = [f"{r['tokens_per_s']:,.0f}" for r in doc["rows"] if r["fits"]]
    ideal = [f"{r['ideal']['tokens_per_s']:,.0f}" for r in doc["rows"] if r.get("ideal")]
    return fits + (ideal if bench == "fit_node" else [])
  raise AssertionError(f"benchmarks/{bench}.json: no rule for what its table shows")


def test_every_result_file_is_on_the_page_and_every_link_resolves():
  files = {p.name for p in RESULTS.iterdir()}
  linked = set(re.findall(r"\(benchmarks/([^)]+)\)", PAGE))
  assert files - linked == set(), "files in benchmarks/ that the page does not link"
  assert linked - files == set(), "links on the page to files not in benchmarks/"
  for name in files:
    assert name.endswith((".json", ".png")), name


@pytest.mark.parametrize("bench", sorted(p.stem for p in RESULTS.glob("*.json")))
def test_each_table_shows_its_json(bench):
  doc = json.loads((RESULTS / f"{bench}.json").read_text())
  assert re.fullmatch(r"2\d{7}", doc["date"]), doc.get("date")
  text = section(bench)
  date = f"{doc['date'][:4]}-{doc['date'][4:6]}-{doc['date'][6:]}"
  assert date in text, f"{bench}: the page does not give the run's date {date}"
  missing = [v for v in shown(doc, bench) if v not in text]
  assert not missing, f"{bench}: numbers of the JSON missing from its table: {missing}"


def test_stages_named_on_the_page_are_gpu_sh_stages():
  script = GPU_SH.read_text()
  subprocess.run(["bash", "-n", str(GPU_SH)], check=True)
  known = re.search(r"^KNOWN=\(([^)]*)\)", script, re.M)[1].split()
  branches = re.findall(r"^    (\w+)\)", script, re.M)
  header = re.findall(r"^#   (\w+)  ", script, re.M)  # "#   STAGE   what it runs"
  assert known == branches == header
  reproducing = PAGE[PAGE.index("## Reproducing") :]
  named = set(re.findall(r"`(\w+)`", reproducing.split("| table | stages |")[1].split("\n\n")[0]))
  assert named and named <= set(known), named - set(known)
  proc = subprocess.run(["bash", str(GPU_SH), "no-such-stage"], capture_output=True, text=True)
  assert proc.returncode == 2 and "unknown stage 'no-such-stage'" in proc.stderr
