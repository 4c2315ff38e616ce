"""Every script in examples/ runs unedited with ``--tiny`` and writes nothing where it runs; the README's usage block
is quickstart.py's code."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _body(path: Path) -> str:
    """The file's code below its module docstring."""
    source = path.read_text()
    assert source.startswith('"""'), f"{path.name} opens with a docstring"
    return source.split('"""', 2)[2].lstrip("\n")


def test_the_readme_shows_quickstart_unedited():
    readme = (ROOT / "README.md").read_text()
    assert "```python\n" + _body(ROOT / "examples" / "quickstart.py") + "```" in readme
    for path in EXAMPLES:
        assert f"examples/{path.name}" in readme, f"the README points at {path.name}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_tiny(path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models: threads only contend
    env.pop("TRITON_INTERPRET", None)  # CPU runs the PyTorch reference kernels; nothing to interpret
    before = _git_status()
    run = subprocess.run(
        [sys.executable, str(path), "--tiny"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sparse" in run.stdout or "identical before the first difference" in run.stdout
    assert list(tmp_path.iterdir()) == [], "an example writes nothing into its working directory"
    assert _git_status() == before, "an example leaves the checkout as it was"


def _git_status() -> str | None:
    """``git status --porcelain`` of the checkout (``None`` outside a git checkout, as in an sdist)."""
    try:
        run = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return None
    return run.stdout if run.returncode == 0 else None
