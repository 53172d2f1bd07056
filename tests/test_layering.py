"""The package's layering, read from its source with ast: no import cycle among jaxrl modules (a module-level or
function-local import, and the package __init__s an import runs, all count), and function-local imports of jaxrl
modules only where they guard an optional or heavy dependency (so a cycle cannot hide behind one)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (importing module, imported module): each a function-local import with its reason.
LOCAL_IMPORTS = {("jaxrl.assets", "jaxrl.models.gguf")}  # transformers' GGUF tables, only when converting a download


def _name(path: Path, root: Path) -> str:
  parts = path.relative_to(root).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
  """({module: the jaxrl modules it imports}, [(module, module it imports inside a function)])."""
  files = {_name(p, root): p for p in (root / "jaxrl").rglob("*.py")}
  edges = {m: set() for m in files}
  local = []

  def named(node, mod: str) -> list[str]:
    if isinstance(node, ast.Import):
      return [a.name for a in node.names]
    package = mod if files[mod].name == "__init__.py" else mod.rpartition(".")[0]
    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
    base = ".".join(p for p in (base, node.module or "") if p)
    subs = [f"{base}.{a.name}" for a in node.names]
    return subs if all(s in files for s in subs) else [base]  # `from package import module`: the module only

  def targets(names: list[str], mod: str) -> set[str]:
    # Importing a.b.c first runs the __init__ of every package above it that is not above `mod` already.
    above_mod = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
    above = {".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 1)} - above_mod
    return {n for n in (*names, *above) if n in files and n != mod}

  def visit(node, mod: str, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
        continue  # never runs
      inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        names = [n for n in named(child, mod) if n in files]
        edges[mod] |= targets(names, mod)
        local.extend((mod, n) for n in names if inside)
      visit(child, mod, inside)

  for mod, path in files.items():
    visit(ast.parse(path.read_text()), mod, False)
  return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges[v]:
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      connect(v)
  return out


def test_no_import_cycle_among_jaxrl_modules():
  assert cycles(import_graph()[0]) == []


def test_function_local_imports_of_jaxrl_only_where_listed():
  assert set(import_graph()[1]) == LOCAL_IMPORTS, "import it at the top of its module, or list it here with why"


def test_the_checks_see_a_cycle_through_a_package_init_and_a_function_local_import(tmp_path):
  for name, text in {"__init__.py": "", "a/__init__.py": "from jaxrl.a.x import X\n", "a/x.py": "X = 1\n",
                     "b.py": "def f():\n  from jaxrl.a.x import X\n", "a/y.py": "from jaxrl import b\n"}.items():
    (tmp_path / "jaxrl" / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "jaxrl" / name).write_text(text)
  edges, local = import_graph(tmp_path)
  assert local == [("jaxrl.b", "jaxrl.a.x")]
  assert edges["jaxrl.b"] == {"jaxrl.a", "jaxrl.a.x"}  # a.x's package __init__ runs first
  assert cycles(edges) == []  # a/__init__ -> a.x; b -> a, a.x; a.y -> b: no way back
  (tmp_path / "jaxrl" / "a" / "x.py").write_text("from jaxrl.a import y\nX = 1\n")
  assert cycles(import_graph(tmp_path)[0]) == [["jaxrl.a", "jaxrl.a.x", "jaxrl.a.y", "jaxrl.b"]]


@pytest.mark.parametrize("enum, owner", [
    ("TRAIN_ATTENTION", "jaxrl.kernels.train_attention"), ("WEIGHT_DTYPES", "jaxrl.models.quant"),
    ("KV_LAYOUTS", "jaxrl.sampler.engine"), ("ON_UPDATE", "jaxrl.sampler.sampler"), ("PEAK_MODES", "jaxrl.telemetry")])
def test_settings_import_the_values_a_module_owns(enum, owner):
  assert "jaxrl.settings" not in import_graph()[0][owner]
  assert any(isinstance(n, ast.ImportFrom) and n.module == owner
             for n in ast.parse((ROOT / "jaxrl" / "settings.py").read_text()).body), enum
