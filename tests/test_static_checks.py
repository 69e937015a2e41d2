"""Lint, format and type checks over all three package folders, run by the test suite (so CI runs them).

mypy cannot follow setuptools' editable-install import hook, so ``smpckpt.planners`` and
``smpckpt.storage`` would resolve to nothing (``Any``) when checked in place. The type check therefore
runs on a staged tree in which ``smpckpt/planners`` and ``smpckpt/storage`` are links to the mapped
folders: every import of the subpackages is resolved and checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("smpckpt", "planners", "storage")
LINTED = (*FOLDERS, "tests", "benchmarks", "examples", "setup.py")


def _run(*args: str, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_ruff_check_is_clean() -> None:
    proc = _run("ruff", "check", "--no-cache", *LINTED)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean() -> None:
    proc = _run("ruff", "format", "--check", "--no-cache", *LINTED)
    assert proc.returncode == 0, "run `ruff format` on:\n" + proc.stdout + proc.stderr


@pytest.mark.timeout(900)
def test_mypy_with_the_mapped_subpackages_resolved(tmp_path: Path) -> None:
    stage = tmp_path / "stage" / "smpckpt"
    stage.mkdir(parents=True)
    for entry in (ROOT / "smpckpt").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, stage / entry.name)
    os.symlink(ROOT / "planners", stage / "planners")
    os.symlink(ROOT / "storage", stage / "storage")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "stage" / "pyproject.toml")
    cache = ROOT / ".mypy_cache"  # reused between runs (git-ignored); a fresh clone builds it once
    proc = _run(
        "mypy",
        "--config-file",
        str(tmp_path / "stage" / "pyproject.toml"),
        "--cache-dir",
        str(cache),
        "-p",
        "smpckpt",
        cwd=tmp_path / "stage",
    )
    out = proc.stdout.replace(str(tmp_path / "stage") + os.sep, "")
    assert proc.returncode == 0, out + proc.stderr
    assert "Success" in out, out
