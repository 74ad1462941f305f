"""The package's import graph: module-level imports form layers, and no import of any kind
(module-level, for annotations under ``TYPE_CHECKING``, inside a function) closes a circle;
imports inside functions are only of optional dependencies, each with a comment saying why; no
module is missing from the layers. Read from the source with ``ast``: importing any module
imports the package's ``__init__`` (nearly all of it) first, which would hide an upward import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_ssdtrain"

# Bottom to top: a module imports (at module level) only from its own layer's earlier entries
# and from layers below it. (A package's modules count as one entry.)
LAYERS = [
  # leaves: JAX's internals, the tier enum, the option table
  [
    "_src.jax_internals",
    "_src.deprecations",
    "_src.attributes",
    "_src.location",
    "_src.options",
    "_src.options.__main__",
  ],
  ["_src.native"],  # the engine's C ABI and FFI handlers
  ["_src.lifetimes"],  # handed the primitives it counts (install_lowering_hook)
  ["_src.config"],  # the process-wide store: opened when a program that uses it first runs
  ["_src.store_space"],  # the store's room and its entries' rounding, for every class of state
  ["_src.sharded"],  # handed the primitives it partitions
  ["_src.primitives"],
  ["_src.stored_io"],  # one stored piece loaded and stored: a stack's layer, an optimizer chunk
  ["_src.policies", "_src.remat", "_src.measure"],
  # the planner places streamed stacks; the optimizer's location="auto" follows its rule (tiers)
  ["_src.layer_stream", "_src.planner", "_src.optimizer"],
  ["_src.accumulate", "_src.master_weights", "_src.stream_scan_passes", "_src.stream_scan"],
  ["_src.trainer"],  # the streamed model's training step, over the micro-step of stream_scan
  ["__init__"],
  ["checkpointing", "probe", "maxtext"],
]

# Imports allowed inside functions: optional dependencies, imported where they are needed.
OPTIONAL = {"optax", "orbax", "tensorstore", "libkvikio", "maxtext", "absl", "tqdm", "flax"}
# (module, imported) pairs allowed inside a function besides OPTIONAL, each for its reason.
ALLOWED_LOCAL = {
  # `python -m jax_ssdtrain.maxtext --help` answers before JAX and MaxText are imported.
  ("maxtext.__main__", "jax_ssdtrain"),
  ("maxtext.__main__", "jax_ssdtrain.maxtext"),
  # jax_ssdtrain.checkpointing needs orbax (optional): imported where MaxText saves or loads
  # a checkpoint with the optimizer state in our store.
  ("maxtext", "jax_ssdtrain.checkpointing"),
  # likewise where a StreamedTrainer saves or restores its state
  ("_src.trainer", "jax_ssdtrain.checkpointing"),
  # The stack's optimizer is decided by the optimizer's own analysis (one analysis for both),
  # while the optimizer package's api.py takes streamed stacks: imported where it is used until
  # the stack's update runs through the optimizer package.
  ("_src.layer_stream.spec", "jax_ssdtrain._src.optimizer.rows"),
  # The optimizer's init places its state by the planner's one rule (optimizer/layout.py imports
  # planner/tiers.py), so the planner reaches the optimizer's layout where choose_placement
  # weighs a dense model's state tier.
  ("_src.planner.placement", "jax_ssdtrain._src.optimizer.layout"),
}


def _module_name(path: Path) -> str:
  rel = path.relative_to(PACKAGE).with_suffix("")
  parts = rel.parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _modules() -> dict[str, Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _group(name: str) -> str:
  """The entry of LAYERS a module belongs to (a package's modules belong to the package's)."""
  entries = [e for layer in LAYERS for e in layer]
  matches = [e for e in entries if name == e or name.startswith(e + ".")]
  if not matches:
    raise AssertionError(f"jax_ssdtrain.{name} is in no layer of tests/test_layering.py")
  return max(matches, key=len)


def _resolve(node, module: str, modules) -> list[str]:
  """The package modules an import statement names (``from a import b, c``: ``a.b`` and ``a.c``
  where they are modules, else ``a``); parent packages imported implicitly are not counted."""

  def short(target):
    return "__init__" if target == "jax_ssdtrain" else target[len("jax_ssdtrain.") :]

  if isinstance(node, ast.Import):
    targets = [short(a.name) for a in node.names if a.name.split(".")[0] == "jax_ssdtrain"]
    return [t for t in targets if t in modules]
  assert not node.level, f"jax_ssdtrain.{module}:{node.lineno}: a relative import"
  if (node.module or "").split(".")[0] != "jax_ssdtrain":
    return []
  submodules = [short(f"{node.module}.{a.name}") for a in node.names]
  found = [t for t in submodules if t in modules]
  if len(found) != len(submodules) and short(node.module) in modules:
    found.append(short(node.module))  # names defined in node.module itself
  return found


def _imports(annotations: bool = False):
  """``{module: [(the import node, inside a function)]}``; with ``annotations``, the imports
  under ``if TYPE_CHECKING:`` too (never run, so no import order: counted as module-level)."""
  modules = _modules()
  found = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text(), str(path))
    rows = []

    def visit(node, local, name=name, rows=rows):
      for child in ast.iter_child_nodes(node):
        if _type_checking(child) and not annotations:
          continue
        inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
          rows.append((child, inner))
        visit(child, inner)

    visit(tree, False)
    found[name] = rows
  return modules, found


def _type_checking(node) -> bool:
  """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports for annotations only."""
  if not isinstance(node, ast.If):
    return False
  test = node.test
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def test_module_level_imports_follow_the_layers():
  modules, found = _imports()
  order = {e: i for i, layer in enumerate(LAYERS) for e in layer}
  wrong = []
  for name, rows in found.items():
    for node, local in rows:
      if local:
        continue
      for target in _resolve(node, name, modules):
        src, dst = _group(name), _group(target)
        if src == dst:
          continue
        same_layer = order[src] == order[dst]
        if order[dst] > order[src] or (same_layer and _index(dst) > _index(src)):
          wrong.append(f"jax_ssdtrain.{name} imports jax_ssdtrain.{target} (line {node.lineno})")
  assert not wrong, "upward imports:\n" + "\n".join(wrong)


def _index(entry: str) -> int:
  for layer in LAYERS:
    if entry in layer:
      return layer.index(entry)
  raise KeyError(entry)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A circle of ``graph`` (``{module: the modules it imports}``) as ``[a, b, ..., a]``, or None:
  a depth-first search."""
  state: dict[str, int] = {}  # 1: on the stack, 2: done

  def visit(name, stack):
    state[name] = 1
    for target in sorted(graph.get(name, ())):
      if state.get(target) == 1:
        return stack[stack.index(target) :] + [target]
      if target not in state:
        found = visit(target, stack + [target])
        if found:
          return found
    state[name] = 2
    return None

  for name in sorted(graph):
    if name not in state:
      found = visit(name, [name])
      if found:
        return found
  return None


def _graph(*, annotations: bool, local: bool) -> dict[str, set[str]]:
  modules, found = _imports(annotations=annotations)
  return {
    name: {t for node, inner in rows if local or not inner for t in _resolve(node, name, modules)}
    - {name}
    for name, rows in found.items()
  }


def test_module_level_import_graph_has_no_cycle():
  # Independent of LAYERS: the imports that run when a module is imported.
  cycle = _cycle(_graph(annotations=False, local=False))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_of_any_kind_closes_a_circle():
  # The dependency graph a reader follows: every import, those for annotations only
  # (TYPE_CHECKING) and those inside functions included. A circle there (two modules each
  # needing the other's types) is a tangle even where no import order breaks.
  cycle = _cycle(_graph(annotations=True, local=True))
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_search_finds_a_circle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
  assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_function_level_imports_are_optional_dependencies_with_a_reason():
  modules, found = _imports()
  wrong = []
  for name, rows in found.items():
    lines = modules[name].read_text().splitlines()
    for node, local in rows:
      if not local:
        continue
      names = (
        [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
      )
      for imported in names:
        top = (imported or "").split(".")[0]
        pair = (name, imported)
        if top not in OPTIONAL and pair not in ALLOWED_LOCAL:
          wrong.append(f"jax_ssdtrain.{name}:{node.lineno}: import of {imported} in a function")
          continue
        if not _commented(lines, node.lineno):
          wrong.append(f"jax_ssdtrain.{name}:{node.lineno}: no comment says why {imported} is here")
  assert not wrong, "\n".join(wrong)


def _commented(lines: list[str], lineno: int) -> bool:
  """A comment on the import's line, on another line of its block of imports, or just above."""
  i = lineno - 1
  while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
    i -= 1  # the block's first import
  block = lines[i:lineno]
  return any("#" in line for line in block) or (i > 0 and lines[i - 1].strip().startswith("#"))


def test_the_layers_list_every_module():
  modules = _modules()
  for name in modules:
    _group(name)  # raises for a module in no layer
  entries = [e for layer in LAYERS for e in layer]
  assert len(entries) == len(set(entries))
