"""The lab (``lab/``, its tests too) and the benchmarks (``benchmarks/``) use the library through its declared
surface only (read from the source with ``ast``; nothing of theirs is imported):

- ``dustin_hf``: the names in its ``__all__`` (and ``__version__``, ``__file__``);
- ``dustin_hf.experimental``: the names in its ``__all__``, declared for them (unstable, but declared);
- ``dustin_hf.kernels``: the dispatcher, the names in its ``__all__``;
- ``dustin_hf.patches``: its ``__file__`` only, which a benchmark records to say which patches ran.

Every other library module is private to the library, imported or read as an attribute, also inside a function. They
subclass none of the library's classes (a plan takes its hooks instead), and nothing in the library imports
``dustin_hf.experimental``: it is the surface for code outside the library, never a layer inside it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from test_layers import _module_files, import_graph

ROOT = Path(__file__).resolve().parents[1]
# each module outside the library may import, and the names it may read there besides the module's __all__
SURFACE = {
    "dustin_hf": {"__version__", "__file__"},
    "dustin_hf.experimental": set(),
    "dustin_hf.kernels": set(),
    "dustin_hf.patches": {"__file__"},
}
SURFACE_FILES = {
    "dustin_hf": ROOT / "dustin_hf" / "__init__.py",
    "dustin_hf.experimental": ROOT / "dustin_hf" / "experimental.py",
    "dustin_hf.kernels": ROOT / "dustin_hf" / "kernels" / "__init__.py",
}


def _outside_files() -> list[Path]:
    """The lab's and the benchmarks' Python files."""
    return (
        sorted((ROOT / "lab" / "dustin_lab").rglob("*.py"))
        + sorted((ROOT / "lab" / "tests").glob("*.py"))
        + sorted((ROOT / "benchmarks").glob("*.py"))
    )


@functools.cache
def _library_modules() -> frozenset[str]:
    return frozenset(_module_files())


@functools.cache
def _declared(module: str) -> frozenset[str]:
    """The names ``module`` declares: its ``__all__`` (read from its source) and the extras of :data:`SURFACE`."""
    if module not in SURFACE_FILES:
        return frozenset(SURFACE[module])
    for node in ast.parse(SURFACE_FILES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value)) | SURFACE[module]
    raise AssertionError(f"{module} has no literal __all__")


def _check(where: str, module: str, name: str | None, bad: list[str]) -> None:
    """``module`` (a dustin_hf module) imported at ``where``, and its attribute ``name`` read if given."""
    if module not in SURFACE:
        bad.append(f"{where}: {module} is private to the library (use dustin_hf.experimental)")
    elif name is not None and name not in _declared(module):
        bad.append(f"{where}: {module}.{name} is not declared (declare it in dustin_hf.experimental, documented)")


def _dotted(node: ast.Attribute, modules: dict[str, str]) -> list[str] | None:
    """``a.b.c`` as ``[module parts..., "b", "c"]`` when ``a`` is bound to a library module, else ``None``."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in modules:
        return None
    return modules[node.id].split(".") + names[::-1]


def surface_violations(path: Path, source: str | None = None) -> list[str]:
    """Every use of the library in ``path`` (or in ``source`` read as that file) outside its declared surface."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    bad: list[str] = []
    modules = {}  # a local name bound to a library module -> that module
    classes = set()  # local names bound to a library name, which a class must not derive from
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dustin_hf":
                    _check(where, alias.name, None, bad)
                    local = alias.asname or "dustin_hf"  # `import a.b` binds `a`
                    modules[local] = alias.name if alias.asname else "dustin_hf"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "dustin_hf":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in _library_modules():
                    _check(where, submodule, None, bad)
                    modules[alias.asname or alias.name] = submodule
                else:
                    _check(where, node.module, alias.name, bad)
                    classes.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and (parts := _dotted(node, modules)):
            # the longest library module the chain names, then what it reads there (`a.b.c.d`: module a.b, name c)
            cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in _library_modules())
            _check(where, ".".join(parts[:cut]), parts[cut] if cut < len(parts) else None, bad)
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                named = base.id if isinstance(base, ast.Name) else None
                via_module = isinstance(base, ast.Attribute) and getattr(base.value, "id", None) in modules
                if named in classes or via_module:
                    bad.append(f"{where}: class {node.name} subclasses the library's {ast.unparse(base)} (use a hook)")
    return list(dict.fromkeys(bad))  # `from m import a, b` of a private m: once


def test_the_lab_and_the_benchmarks_use_only_the_declared_surface():
    assert [v for path in _outside_files() for v in surface_violations(path)] == []


def test_the_check_reads_the_lab_and_the_benchmarks():
    """The files are there and do import the surface (no files would pass vacuously)."""
    names = {path.relative_to(ROOT).as_posix() for path in _outside_files()}
    assert {
        "lab/dustin_lab/walk.py",
        "lab/tests/test_walk.py",
        "benchmarks/e2e.py",
        "benchmarks/attention.py",
    } <= names
    assert any("dustin_hf.experimental" in path.read_text() for path in _outside_files())


def test_nothing_in_the_library_imports_the_surface():
    graph = import_graph()
    library = [name for name in graph if name.startswith("dustin_hf")]
    assert [name for name in library if "dustin_hf.experimental" in graph[name]] == []
    assert any("dustin_hf.experimental" in targets for targets in graph.values())  # the graph does see its users


def test_every_declared_name_loads():
    """Each name of ``dustin_hf.experimental.__all__`` is there (a name moved inside the library moves here too)."""
    import dustin_hf.experimental as surface

    for name in _declared("dustin_hf.experimental"):
        if name in surface._TRITON:
            pytest.importorskip("triton")
        assert getattr(surface, name) is not None, name


@pytest.mark.parametrize(
    "file, line, expected",
    [
        ("lab/dustin_lab/walk.py", "from dustin_hf.selection.fill import select_positions", "private to the library"),
        ("lab/dustin_lab/walk.py", "from dustin_hf.runtime import plan", "private to the library"),
        ("lab/tests/test_walk.py", "import dustin_hf.decode.runner", "private to the library"),
        ("benchmarks/e2e.py", "x = dustin_hf.config", "private to the library"),
        ("benchmarks/e2e.py", "x = dustin_hf.profiles.read_profile", "private to the library"),
        ("benchmarks/replay.py", "from dustin_hf.experimental import Undeclared", "is not declared"),
        ("benchmarks/replay.py", "from dustin_hf import experimental as ex\nx = ex.Undeclared", "is not declared"),
        ("benchmarks/attention.py", "from dustin_hf.kernels import varlen", "private to the library"),
        ("benchmarks/attention.py", "from dustin_hf.kernels import _device", "private to the library"),
        ("benchmarks/e2e.py", "from dustin_hf.patches import generation", "private to the library"),
        ("benchmarks/e2e.py", "from dustin_hf.patches import patched_class", "is not declared"),
        ("benchmarks/e2e.py", "import dustin_hf.patches\nx = dustin_hf.patches.patched_class", "is not declared"),
        ("lab/dustin_lab/oracle.py", "class P(ForwardPlan):\n    pass", "subclasses the library's ForwardPlan"),
        (
            "lab/dustin_lab/oracle.py",
            "import dustin_hf.experimental as ex\nclass P(ex.ForwardPlan):\n    pass",
            "subclasses the library's ex.ForwardPlan",
        ),
    ],
)
def test_a_use_outside_the_surface_is_caught(file, line, expected):
    """The check fails on what it forbids: the same source with one wrong line added."""
    path = ROOT / file
    assert any(expected in v for v in surface_violations(path, path.read_text() + f"\n{line}\n"))
