"""The package's rooms (README "Architecture"): what each subpackage may import, and the size rules.

Read from the source with ``ast`` (no imports run): a module importing a room it may not, a folder with
more than 20 modules side by side, a module over 600 lines, or a module importing the package root fails
here, naming the file.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"smpckpt": "smpckpt", "planners": "smpckpt.planners", "storage": "smpckpt.storage"}
#: the helpers every room may use: errors, typed argument checks, the GC pause, the version, format tags
SHARED = {"smpckpt.errors", "smpckpt._checks", "smpckpt._gc", "smpckpt._version", "smpckpt._formats"}
STORAGE = {f"smpckpt.storage.{r}" for r in ("format", "backends", "write", "read", "full", "tier")} | {
    "smpckpt.storage"
}
#: room -> the rooms it may import (besides itself and SHARED); README "Architecture" says the same
MAY_IMPORT: dict[str, set[str]] = {
    "smpckpt.shared": set(),
    "smpckpt.model": set(),
    "smpckpt.hf": {"smpckpt.model"},
    "smpckpt.storage.backends": set(),
    "smpckpt.storage.format": {"smpckpt.model", "smpckpt.storage.backends"},
    "smpckpt.storage.write": {"smpckpt.model", "smpckpt.storage.backends", "smpckpt.storage.format"},
    "smpckpt.storage.full": {
        "smpckpt.model",
        "smpckpt.hf",
        "smpckpt.storage.backends",
        "smpckpt.storage.format",
        "smpckpt.storage.write",
    },
    "smpckpt.storage.read": {
        "smpckpt.model",
        "smpckpt.storage.backends",
        "smpckpt.storage.format",
        "smpckpt.storage.full",
    },
    "smpckpt.storage.tier": {
        "smpckpt.storage.backends",
        "smpckpt.storage.format",
        "smpckpt.storage.write",
        "smpckpt.storage.read",
    },
    "smpckpt.storage": STORAGE,
    "smpckpt.planners": {"smpckpt.model", "smpckpt.storage.format"},
    "smpckpt.catalog": STORAGE,
    "smpckpt.api": {"smpckpt.model", "smpckpt.hf", "smpckpt.catalog", "smpckpt.planners"} | STORAGE,
    "smpckpt.tools": {"smpckpt.model", "smpckpt.hf", "smpckpt.catalog", "smpckpt.planners", "smpckpt.api"} | STORAGE,
    "smpckpt": {"smpckpt.model", "smpckpt.api", "smpckpt.tools"},  # the package's __init__ and __main__
}
#: (module file, imported module) -> why this one arrow against the rooms' order is allowed
BACK_EDGES = {
    ("storage/write/writer.py", "smpckpt.storage.full.writer"): "the deprecated mode='full' spelling hands off",
    ("smpckpt/api/checkpointer.py", "smpckpt.tools.consolidate"): (
        "Checkpointer.export of a committed checkpoint (no model=) is the offline consolidation"
    ),
}
MAX_MODULES_PER_FOLDER = 20
MAX_LINES = 600  # issue 44 lifted the earlier 450 cap: a module may be up to ~600 lines when it is one job


def _modules() -> list[tuple[str, str]]:
    out = []
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                    name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    out.append((os.path.relpath(path, ROOT), name))
    return sorted(out)


def _room(module: str) -> str:
    if module in SHARED or module == "smpckpt._moved":
        return "smpckpt.shared"
    if module in ("smpckpt", "smpckpt.__main__"):
        return "smpckpt"
    parts = module.split(".")
    if parts[:2] == ["smpckpt", "storage"]:
        return ".".join(parts[:3]) if len(parts) > 3 or (len(parts) == 3 and parts[2] != "tools") else "smpckpt.storage"
    return ".".join(parts[:2])


def _imports(path: str) -> list[tuple[int, str]]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return [(line, m) for line, m in found if m == "smpckpt" or m.startswith("smpckpt.")]


MODULES = _modules()


@pytest.mark.parametrize("path,module", MODULES, ids=[p for p, _ in MODULES])
def test_module_imports_only_what_its_room_may(path: str, module: str) -> None:
    room = _room(module)
    allowed = MAY_IMPORT[room] | {"smpckpt.shared", room}
    for line, target in _imports(path):
        if target == "smpckpt" and module not in ("smpckpt", "smpckpt.__main__"):
            pytest.fail(f"{path}:{line} imports the package root 'smpckpt' (import the module that owns the name)")
        if target == "smpckpt":
            continue
        if _room(target) not in allowed and (path, target) not in BACK_EDGES:
            pytest.fail(f"{path}:{line}: room {room} may not import {target} (room {_room(target)})")


def test_no_folder_holds_more_than_20_modules() -> None:
    per_folder: dict[str, int] = {}
    for path, _ in MODULES:
        per_folder[os.path.dirname(path)] = per_folder.get(os.path.dirname(path), 0) + 1
    crowded = {d: n for d, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_no_module_is_over_600_lines() -> None:
    long = {p: n for p, _ in MODULES if (n := sum(1 for _ in open(os.path.join(ROOT, p)))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split by job): {long}"


def test_room_names_are_not_prefix_families() -> None:
    """Three or more modules sharing a ``_word_`` prefix in one folder are a subpackage in disguise."""
    by_prefix: dict[tuple[str, str], list[str]] = {}
    for path, _ in MODULES:
        stem = os.path.basename(path)[:-3].lstrip("_")
        if "_" in stem:
            by_prefix.setdefault((os.path.dirname(path), stem.split("_")[0]), []).append(path)
    families = {f"{d}/_{p}_*": v for (d, p), v in by_prefix.items() if len(v) >= 3}
    assert not families, f"name-prefixed module families (make them a subpackage): {families}"
