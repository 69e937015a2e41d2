"""What ``pip install`` gives: a wheel built from this tree ships every module of ``smpckpt/``,
``planners/`` and ``storage/`` under its installed name, and each one imports from an installed,
non-editable copy.

Editable installs (the README's, CI's and fresh-check's) read the source tree, so they cannot notice a
module the wheel leaves out: a hand-written package list once dropped ``smpckpt.hf`` from every wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: repository folder -> its import name
FOLDERS = {"smpckpt": "smpckpt", "planners": "smpckpt.planners", "storage": "smpckpt.storage"}
#: what building needs from the tree (a copy, so no build/ folder of an earlier build can leak stale files)
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", *FOLDERS)


def _source_modules() -> dict[str, str]:
    """Every ``.py`` file of the three folders: path inside the wheel -> module name."""
    found = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            parts = [*name.split("."), *rel.with_suffix("").parts]
            in_wheel = "/".join([*name.split("."), *rel.parts])
            found[in_wheel] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, src / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(work / "dist"),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (work / "dist").glob("smpckpt-*.whl")
    return built


def test_the_wheel_ships_every_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _source_modules()
    missing = sorted(set(expected) - names)
    assert not missing, f"the wheel leaves out {missing}"
    assert "smpckpt/py.typed" in names
    # the mapped folders exist only under their installed names
    top = {n.split("/")[0] for n in names}
    assert top == {"smpckpt", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, top


def test_every_module_imports_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = sorted(m for m in _source_modules().values() if not m.endswith(".__main__"))
    code = (
        "import importlib, sys\n"
        f"site = {str(site)!r}\n"
        "bad = []\n"
        f"for name in {modules!r}:\n"
        "    mod = importlib.import_module(name)\n"
        "    if not mod.__file__.startswith(site):\n"
        "        bad.append((name, mod.__file__))\n"
        "print(len(sys.modules), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    # outside the repository and with the wheel's copy first on the path: the editable install's
    # finder comes after the path, so every module must come from the wheel
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # and the package root exposes the Hugging Face families without importing them first
    lazy = subprocess.run(
        [sys.executable, "-c", "import smpckpt; print(sorted(smpckpt.hf.TRANSLATIONS))"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert lazy.returncode == 0 and "gpt2" in lazy.stdout, lazy.stdout + lazy.stderr
