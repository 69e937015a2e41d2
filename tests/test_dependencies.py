"""Every third-party import is declared in pyproject.toml, and the constraints file pins what we install.

A static scan (AST, so imports inside functions count too) of the package, the tests and the benchmarks.
Package code may import the run-time dependencies and the optional extras (imported lazily, with an
install hint); tests and benchmarks may also import the extras they are run with. The fresh virtual
environment of `.ci/run` proves the same at run time; this test names the offending file and import.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("smpckpt", "planners", "storage")
# Extras package code may import lazily (behind a clear "install smpckpt[...]" hint).
PACKAGE_EXTRAS = ("s3",)
TEST_EXTRAS = ("s3", "test")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(extras: tuple[str, ...]) -> set[str]:
    """Distribution names smpckpt declares: its run-time requirements plus those of ``extras``."""
    names = set()
    for req in md.requires("smpckpt") or ():
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        if extra is None or extra.group(1) in extras:
            names.add(_canon(name))
    return names


def _local_names(folder: Path) -> set[str]:
    """Modules importable by bare name from a test folder (conftest puts tests/ on sys.path)."""
    return {p.stem for p in folder.rglob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _undeclared(files: list[Path], allowed: set[str], local: set[str]) -> list[str]:
    providers = md.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    problems = []
    for path in files:
        for name in sorted(_imports(path)):
            if name in stdlib or name in local or name == "smpckpt":
                continue
            dists = {_canon(d) for d in providers.get(name, ())}
            if not dists & allowed:
                where = ", ".join(sorted(dists)) or "no installed distribution"
                problems.append(
                    f"{os.path.relpath(path, ROOT)}: imports {name!r} ({where}), not declared in pyproject.toml"
                )
    return problems


def test_package_imports_are_declared():
    files = [p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20, "the scan found too few package modules: is ROOT right?"
    problems = _undeclared(files, _declared(PACKAGE_EXTRAS), local=set())
    assert not problems, "\n".join(problems)


def test_example_imports_need_only_the_runtime_dependencies():
    # the demo is the README's first command, run after `pip install -e .` with no extras
    files = list((ROOT / "examples").rglob("*.py"))
    assert files, "no python files under examples/"
    problems = _undeclared(files, _declared(()), local=_local_names(ROOT / "examples"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("folder", ["tests", "benchmarks"])
def test_test_and_benchmark_imports_are_declared(folder):
    files = list((ROOT / folder).rglob("*.py"))
    assert files, f"no python files under {folder}/"
    local = _local_names(ROOT / "tests") | _local_names(ROOT / "benchmarks") | _local_names(ROOT / "examples")
    problems = _undeclared(files, _declared(TEST_EXTRAS), local=local)
    assert not problems, "\n".join(problems)


def test_the_scan_catches_an_undeclared_import(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("def f():\n    import not_a_declared_module\n    import torch\n    from os import path\n")
    problems = _undeclared([bad], _declared(TEST_EXTRAS), local=set())
    assert [p.split(": ", 1)[1] for p in problems] == [
        "imports 'not_a_declared_module' (no installed distribution), not declared in pyproject.toml"
    ]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise AssertionError(f"constraints.txt: {line!r} is not an exact pin (name==version)")
            pins[_canon(name)] = version
    return pins


def test_every_declared_dependency_is_pinned_and_installed_at_its_pin():
    pins = _pins()
    for name in sorted(_declared(TEST_EXTRAS)):
        assert name in pins, f"{name} is declared in pyproject.toml but not pinned in constraints.txt"
        installed = md.version(name).split("+")[0]
        assert installed == pins[name], f"{name}: installed {installed}, constraints.txt pins {pins[name]}"
