"""The package's layers import in one direction (read from the source with ``ast``; nothing is imported).

From the bottom up:

- ``dustin_hf.kernels``: pure tensor ops; they import nothing of dustin_hf outside ``kernels``;
- ``dustin_hf.runtime``: CUDA graphs, fused decode ops, launch settings; besides kernels and runtime it
  reads only the per-forward plan and the transformers compatibility names (``plan``, ``compat``);
- the library core (every other module of ``dustin_hf`` and ``dustin_hf.patches``);
- ``dustin_hf.research``: the research kit and the CLI; nothing outside it imports it.

Every import counts, also one inside a function (a lazy import is still a dependency), and no chain of
imports may come back to where it started.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_MAY_READ = {"dustin_hf.plan", "dustin_hf.compat"}


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "dustin_hf").rglob("*.py")) + sorted((ROOT / "patches").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "patches":  # installed as dustin_hf.patches (pyproject's package-dir)
            parts = ["dustin_hf"] + parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The dustin_hf modules ``name`` imports (``from pkg import submodule`` counts as the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
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
                return path[path.index(nxt):] + [nxt]
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
            research = target.startswith("dustin_hf.research")
            if name.startswith("dustin_hf.kernels") and not target.startswith("dustin_hf.kernels"):
                bad.append(f"{name} -> {target}: kernels import nothing of dustin_hf outside kernels")
            elif name.startswith("dustin_hf.runtime") and not (
                    target.startswith(("dustin_hf.kernels", "dustin_hf.runtime")) or target in RUNTIME_MAY_READ):
                bad.append(f"{name} -> {target}: the runtime reads only kernels, runtime, {sorted(RUNTIME_MAY_READ)}")
            elif research and not name.startswith("dustin_hf.research"):
                bad.append(f"{name} -> {target}: the library never imports the research kit")
    return bad


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_in_one_direction():
    assert layer_violations(import_graph()) == []


@pytest.mark.parametrize("module, line, expected", [
    ("dustin_hf.kernels.triton_score", "from ..plan import select_heads", "kernels import nothing"),
    ("dustin_hf.cache", "from .research import texts", "never imports the research kit"),
    ("dustin_hf.runtime.graphs", "from ..selection import Selection", "the runtime reads only"),
])
def test_a_wrong_import_is_caught(tmp_path, module, line, expected):
    """The checks above fail on the imports they forbid: the same source with one wrong line added."""
    files = _module_files()
    source = files[module].read_text() + f"\n{line}\n"
    copy = tmp_path / files[module].name
    copy.write_text(source)
    graph = import_graph({**files, module: copy})
    assert any(expected in v for v in layer_violations(graph))


def test_a_cycle_is_caught(tmp_path):
    files = _module_files()
    copy = tmp_path / "config.py"  # config is imported by the decoding loop; make it import the loop back
    copy.write_text(files["dustin_hf.config"].read_text() + "\nfrom .decoding import SpeculativeDecoder\n")
    assert _cycle(import_graph({**files, "dustin_hf.config": copy})) is not None
