"""Where ``dustin_hf.patches`` comes from: the top-level ``patches/`` of the checkout whose ``dustin_hf`` runs (a
second checkout or a git worktree on ``PYTHONPATH`` runs its own, whatever checkout an editable install points at),
and in a wheel the ``dustin_hf/patches/`` inside the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _patches_file(path_entry: Path) -> str:
    """``dustin_hf.patches.__file__`` in a fresh interpreter with ``path_entry`` first on its path."""
    env = {**os.environ, "PYTHONPATH": str(path_entry)}
    code = "import dustin_hf.patches; print(dustin_hf.patches.__file__)"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=path_entry, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_second_checkout_imports_its_own_patches(tmp_path):
    checkout = tmp_path / "second"
    (checkout / "dustin_hf").mkdir(parents=True)
    (checkout / "patches").mkdir()
    shutil.copy(ROOT / "dustin_hf" / "__init__.py", checkout / "dustin_hf")  # its other modules load on first use
    (checkout / "patches" / "__init__.py").write_text("")
    assert _patches_file(checkout) == str(checkout / "patches" / "__init__.py")


def test_an_installed_package_imports_the_patches_inside_it(tmp_path):
    """As a wheel installs it: ``dustin_hf/patches/`` inside; a top-level ``patches`` beside it is another package."""
    site = tmp_path / "site"
    (site / "dustin_hf" / "patches").mkdir(parents=True)
    (site / "patches").mkdir()
    shutil.copy(ROOT / "dustin_hf" / "__init__.py", site / "dustin_hf")
    for folder in (site / "dustin_hf" / "patches", site / "patches"):
        (folder / "__init__.py").write_text("")
    assert _patches_file(site) == str(site / "dustin_hf" / "patches" / "__init__.py")
