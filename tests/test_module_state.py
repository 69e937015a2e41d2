"""The package keeps no state between calls outside the objects that own it (a ``Checkpointer`` and its
parts): no ``global`` statement, and no module-level (or class-level) value that can change -- read from
the source with ``ast``, naming the file and line.

Mutable means: a list, dict or set (literal, comprehension or constructor), a ``bytearray``, a
``collections``, ``queue`` or ``weakref`` container, a lock, event, condition or thread-local
(``threading``), a counter (``itertools.count``), or an instance of one of the package's own classes
that is not a frozen dataclass. Constants stay: tuples, frozensets, ``types.MappingProxyType`` views,
compiled patterns, loggers, frozen dataclasses. ``__all__`` is a list by convention.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("smpckpt", "planners", "storage")
#: (file, name) -> why this module-level value may change
ALLOWED = {
    ("smpckpt/api/checkpointer.py", "_last_resume"): "a ContextVar: each thread's own last_resume_info()",
    (
        "smpckpt/api/checkpointer.py",
        "_resuming",
    ): "a ContextVar: the resume this thread is inside (its signal handlers' too)",
    ("storage/format/_checksum.py", "_scratch"): "a thread's scratch memory for one hash call, never read across calls",
    ("smpckpt/api/_staging.py", "_REGISTERING"): (
        "the registration of the process's one optimizer step hook: as wide as torch's registry of them"
    ),
    ("storage/backends/_folder.py", "_MEMORY_LOCK"): (
        "create-if-absent on fsspec's memory filesystem, whose store is one per process (class-level): "
        "the lock must be as wide as that store"
    ),
}
#: the package's classes whose module-level instances are constants: set up once, only read after
CONSTANT_CLASSES = {"Translation"}
MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "bytearray",
    "deque",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "ChainMap",
    "Queue",
    "SimpleQueue",
    "LifoQueue",
    "PriorityQueue",
    "Lock",
    "RLock",
    "Event",
    "Condition",
    "Semaphore",
    "BoundedSemaphore",
    "Barrier",
    "local",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "count",
    "ContextVar",
}
MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _files() -> list[str]:
    out = []
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def _trees() -> dict[str, ast.Module]:
    trees = {}
    for rel in _files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            trees[rel] = ast.parse(f.read(), rel)
    return trees


def _is_frozen(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        if isinstance(dec, ast.Call) and any(
            k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in dec.keywords
        ):
            return True
    bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases}
    return bool(bases & {"Enum", "IntEnum", "NamedTuple", "Exception"}) or any(b.endswith("Error") for b in bases)


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _mutable(value: ast.expr | None, unfrozen: set[str]) -> str | None:
    """What makes ``value`` mutable, or ``None``."""
    if isinstance(value, MUTABLE_NODES):
        return type(value).__name__.lower()
    if isinstance(value, ast.Call):
        name = _name(value.func)
        if name in MUTABLE_CALLS or name in unfrozen:
            return f"{name}()"
    return None


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's or class's own statements, those under ``if``/``try``/``with`` at that level included."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                out += _top_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                out += _top_level(handler.body)
    return out


def _findings() -> list[str]:
    trees = _trees()
    unfrozen = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and not _is_frozen(node) and node.name not in CONSTANT_CLASSES
    }
    found = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{rel}:{node.lineno}: global {', '.join(node.names)}")
        scopes: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
        scopes += [
            (f"{n.name}.", n.body) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and not _is_dataclass(n)
        ]
        for owner, body in scopes:
            for node in _top_level(body):
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets, value = [node.target], node.value
                else:
                    continue
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if not names or names == ["__all__"] or (rel, f"{owner}{names[0]}") in ALLOWED:
                    continue
                why = _mutable(value, unfrozen)
                if why:
                    found.append(f"{rel}:{node.lineno}: {owner}{', '.join(names)} = {why}")
    return found


def _is_dataclass(cls: ast.ClassDef) -> bool:
    """Dataclass fields are per instance (``default_factory``), not shared class state."""
    return any(_name(d.func if isinstance(d, ast.Call) else d) == "dataclass" for d in cls.decorator_list)


def test_no_global_statement_and_no_mutable_module_state() -> None:
    found = _findings()
    assert not found, "state kept outside its owner (move it into the object that owns it):\n" + "\n".join(found)


def test_the_check_sees_what_it_forbids() -> None:
    """The patterns the package had before the Checkpointer owned them are each found."""
    source = """
import threading, collections
_STATE = _State()
_LOCK = threading.Lock()
_KEPT: dict[str, int] = {}
_listed: set[str] = set()
_q = collections.deque()
def f():
    global _x
class C:
    registry = {}
class _State:
    pass
"""
    tree = ast.parse(source)
    unfrozen = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and not _is_frozen(n)}
    flagged = [
        n.targets[0].id if isinstance(n, ast.Assign) else n.target.id
        for n in _top_level(tree.body)
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and _mutable(n.value, unfrozen)
    ]
    assert flagged == ["_STATE", "_LOCK", "_KEPT", "_listed", "_q"]
    assert [n for n in ast.walk(tree) if isinstance(n, ast.Global)]
    assert _mutable(ast.parse("x = {}").body[0].value, set())  # type: ignore[attr-defined]
