"""The library and the lab import in one direction (read from the source with ``ast``; nothing is imported).

From the bottom up:

- ``dustin_hf.kernels``: pure tensor ops; they import nothing of dustin_hf outside ``kernels``;
- ``dustin_hf.runtime``: the per-forward plan, CUDA graphs, fused decode ops, launch settings; besides kernels
  and runtime it reads only the transformers compatibility names (``compat``);
- the library core (``adapter``, ``decode``, ``selection``, ``calibration``, the top-level modules and
  ``dustin_hf.patches``); within it, the decode loop (``dustin_hf.decode``) sits below the calibration search
  (``dustin_hf.calibration``): no module of the loop reaches it, directly or through another module, and the
  loop runs the search it is handed (``adapter.assisted`` passes it);
- ``dustin_lab`` (the folder ``lab/``, a project of its own): the CLI, demo, calibration and evaluation.
  Nothing in the library imports it, and it reads the library through its declared surface only
  (``tests/test_surface.py``).

Every import counts, also one inside a function (a lazy import is still a dependency), and no chain of
imports may come back to where it started.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_MAY_READ = {"dustin_hf.compat"}
LOOP = "dustin_hf.decode"  # the package: every module of the loop
CALIBRATION = "dustin_hf.calibration"
LAB = ROOT / "lab"


def _module_files() -> dict[str, Path]:
    files = {}
    folders = [(ROOT / "dustin_hf", ROOT), (ROOT / "patches", ROOT), (LAB / "dustin_lab", LAB)]
    for path, base in [(path, base) for folder, base in folders for path in sorted(folder.rglob("*.py"))]:
        rel = path.relative_to(base).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "patches":  # installed as dustin_hf.patches (pyproject's package-dir)
            parts = ["dustin_hf"] + parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _origin(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in module ``name`` reads from."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The dustin_hf / dustin_lab modules ``name`` imports (``from pkg import submodule`` counts as the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = _origin(name, path, node)
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import dustin_hf.kernels.x as y` -> its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    files = files or _module_files()
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that ends where it starts), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs against the layers of the module docstring."""
    bad = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if name.startswith("dustin_hf.kernels") and not target.startswith("dustin_hf.kernels"):
                bad.append(f"{name} -> {target}: kernels import nothing of dustin_hf outside kernels")
            elif name.startswith("dustin_hf.runtime") and not (
                target.startswith(("dustin_hf.kernels", "dustin_hf.runtime")) or target in RUNTIME_MAY_READ
            ):
                bad.append(f"{name} -> {target}: the runtime reads only kernels, runtime, {sorted(RUNTIME_MAY_READ)}")
            elif target.startswith("dustin_lab") and not name.startswith("dustin_lab"):
                bad.append(f"{name} -> {target}: the library never imports the lab")
    for name in sorted(n for n in graph if n.startswith(LOOP + ".")):
        for target in sorted(t for t in _reached(graph, name) if t.startswith(CALIBRATION)):
            bad.append(
                f"{name} -> ... -> {target}: the decode loop sits below the calibration search (pass the "
                "search in as SpeculativeDecoder(calibrate=...))"
            )
    return bad


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_in_one_direction():
    assert layer_violations(import_graph()) == []


def test_the_lab_is_checked():
    """The lab's modules are in the graph and do read the library (an empty lab would pass vacuously)."""
    graph = import_graph()
    lab = {name for name in graph if name.startswith("dustin_lab")}
    assert {"dustin_lab.cli", "dustin_lab.walk", "dustin_lab.texts"} <= lab
    assert any(target.startswith("dustin_hf") for name in lab for target in graph[name])


@pytest.mark.parametrize(
    "module, line, expected",
    [
        ("dustin_hf.kernels.triton_score", "from ..runtime.plan import select_heads", "kernels import nothing"),
        ("dustin_hf.decode.cache", "from dustin_lab import texts", "the library never imports the lab"),
        ("dustin_hf.decode.decoder", "import dustin_lab.cli", "the library never imports the lab"),
        (
            "dustin_hf.decode.decoder",
            "from ..calibration.prompt import calibrate_on_prompts",
            "below the calibration search",
        ),
        ("dustin_hf.decode.exact", "from ..calibration.search import search", "below the calibration search"),
        ("dustin_hf.selection.selector", "from ..calibration import search", "below the calibration search"),
        ("dustin_hf.runtime.graphs", "from ..selection import Selection", "the runtime reads only"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path, module, line, expected):
    """The checks above fail on the imports they forbid: the same source with one wrong line added."""
    files = _module_files()
    source = files[module].read_text() + f"\n{line}\n"
    copy = tmp_path / files[module].name
    copy.write_text(source)
    files = {**files, module: copy}
    assert any(expected in v for v in layer_violations(import_graph(files)))


def test_a_cycle_is_caught(tmp_path):
    files = _module_files()
    copy = tmp_path / "config.py"  # config is imported by the decoding loop; make it import the loop back
    copy.write_text(files["dustin_hf.config"].read_text() + "\nfrom .decoding import SpeculativeDecoder\n")
    assert _cycle(import_graph({**files, "dustin_hf.config": copy})) is not None
