"""Argument checks every public entry point shares: options refused by name, up front, before anything
runs -- never a truthy string taken for ``True`` or a negative count failing deep inside ``dcp.save``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["check_flag", "check_int", "check_process_group", "refuse_unflattenable"]
__all__ += ["validate_tag", "is_valid_tag", "PARTIAL_SUFFIX"]  # (re-exported by smpckpt.catalog.root)


def check_flag(name: str, value: Any) -> bool:
    """A boolean option: ``True`` or ``False``, nothing else (``"no"`` would otherwise mean yes)."""
    if value is not True and value is not False:
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> Any:
    """A count: an ``int`` (not a bool) of at least ``minimum``; ``None`` too when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {kind}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_process_group(process_group: Any, name: str = "process_group") -> None:
    """``None`` (the default group) or a ``torch.distributed`` ``ProcessGroup``: anything else would be
    ignored without a process group (every rank a world of one, each saving alone) or fail deep inside
    a collective."""
    if process_group is None:
        return
    import torch.distributed as dist

    group_type = getattr(dist, "ProcessGroup", None)
    if group_type is None or not isinstance(process_group, group_type):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup (dist.new_group(...)) or None for the default "
            f"group, got {type(process_group).__name__}"
        )


def refuse_unflattenable(model: Any, optimizers: Sequence[Any]) -> None:
    """DCP's ``get_state_dict`` flattens each optimizer's ``state_dict()["state"]`` and refuses values other than
    tensors, numbers and dicts (LBFGS's lists) naming neither optimizer nor key: named here, before any I/O.
    It joins nested keys with ``.`` and splits them on ``.`` again at the load: an inner key (below a state
    name) holding a ``.`` or not a ``str`` would come back restructured (``{"x.y": t}`` as ``{"x": {"y": t}}``,
    ``{0: t}`` as ``{"0": t}``), so it is refused too. A top-level state name is looked up whole: any is fine,
    unless it flattens onto another value (:func:`_refuse_clashing`)."""
    import torch

    kinds = (torch.Tensor, int, float)
    prone: list[Any] = []  # the walk saw a dotted state name or nested state
    for i, opt in enumerate(optimizers):
        if _first_odd(opt.state, kinds, 0, prone) is None:  # the common case: no state_dict() built twice
            continue
        prone.append(None)  # the walk stopped early: its state_dict() may still hold any state
        odd = _first_odd(opt.state_dict()["state"], kinds, 0)
        if odd is not None:
            (index, *key), value = odd  # state_dict() keys state by the parameter's index in its groups
            p = dict(enumerate(q for group in opt.param_groups for q in group["params"])).get(index)
            name, at = next((n for n, q in model.named_parameters() if q is p), index), ".".join(map(str, key))
            if isinstance(value, _BadKey):
                raise ValueError(
                    f"optimizer {i} ({type(opt).__name__}) holds a dict under state key {at!r} of parameter "
                    f"{name!r} with the inner key {value.key!r}: torch.distributed.checkpoint joins nested optimizer "
                    "state keys with '.' and splits them again at the load, so it would come back restructured; "
                    "use str inner keys without '.', or leave the optimizer out of optimizer= and put its "
                    "state_dict() in user_content"
                )
            raise TypeError(
                f"optimizer {i} ({type(opt).__name__}) holds a {type(value).__name__} under state key {at!r} of "
                f"parameter {name!r}: torch.distributed.checkpoint keeps only tensor, int, float and dict optimizer "
                "state; leave it out of optimizer= and put its state_dict() in user_content"
            )
    if prone:
        _refuse_clashing(model, optimizers)


def _refuse_clashing(model: Any, optimizers: Sequence[Any]) -> None:
    """Two state values DCP's flattening makes one key (``state.<fqn>.<path joined by '.'>``): a dotted state name
    beside nested state (``{"b.c": t, "b": {"c": u}}``; or a parameter ``a``'s ``b.c`` and a parameter ``a.b``'s
    ``c``), one written over the other; or a key under a nested state's (``{"nest": {...}, "nest.w": t}``), which
    the load reads back into that nested state. Only a dotted state name or nested state can: called only then."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: dict[int, str] = {}  # DCP's name of each parameter: a tied one's first (named_parameters dedups)
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) == 1:  # FSDP1's flat parameters: DCP names their state itself
            names.setdefault(id(p), next(iter(fqns)))
    # what DCP flattens: state_dict()'s state, keyed by the parameter's index in the groups
    states: list[tuple[str, Mapping[Any, Any], int]] = []
    for i, opt in enumerate(optimizers):
        params = [q for group in opt.param_groups for q in group["params"]]
        for index, st in opt.state_dict()["state"].items():
            p = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
            if p is not None and id(p) in names and isinstance(st, Mapping):
                states.append((names[id(p)], st, i))
    clash = flat_state_clash(states)
    if clash is None:
        return
    key, (fqn, path, i), (fqn2, path2, i2), nested = clash
    cls = [type(optimizers[j]).__name__ for j in (i, i2)]
    one = f"optimizer {i} ({cls[0]}) holds state {_show_path(path)} of parameter {fqn!r}"
    other = f"optimizer {i2} ({cls[1]}) holds " if i2 != i else ""
    two = f"{other}state {_show_path(path2)} of parameter {fqn2!r}"
    if nested:
        how = f"the load reads every key under 'optim.state.{key}.' back into the nested state, so the first would "
        how += "come back inside the second"
    else:
        how = f"torch.distributed.checkpoint flattens both to the key 'optim.state.{key}', so one would be saved "
        how += "over the other"
    raise ValueError(
        f"{one} and {two}: {how}; rename one of those state keys, or leave the optimizer out of optimizer= and "
        "put its state_dict() in user_content"
    )


def flat_state_clash(
    states: Sequence[tuple[str, Mapping[Any, Any], int]],
) -> tuple[str, tuple[str, tuple[Any, ...], int], tuple[str, tuple[Any, ...], int], bool] | None:
    """The first clash among ``states`` ((parameter name, its optimizer state, optimizer index) each) once
    flattened as DCP does: ``(key, first value's (name, path, index), second's, nested)``; ``nested``: the first
    value's flat key is, or lies under, ``key``, the flat key of the second, a nested state of another name
    (its load gathers every key under it). ``None``: none."""
    leaves: dict[str, tuple[str, tuple[Any, ...], int]] = {}
    roots: dict[str, tuple[str, tuple[Any, ...], int]] = {}  # a nested state's flat key -> (name, (its state name,), i)
    for fqn, st, i in states:
        for path in _paths(st, ()):
            key = ".".join((fqn, *map(str, path)))
            if key in leaves:
                return key, leaves[key], (fqn, path, i), False
            leaves[key] = (fqn, path, i)
        roots.update({f"{fqn}.{name}": (fqn, (name,), i) for name, v in st.items() if isinstance(v, dict)})
    if roots:
        for key, (fqn, path, i) in leaves.items():
            parts = key.split(".")
            for n in range(1, len(parts) + 1):
                root = roots.get(".".join(parts[:n]))
                if root is not None and (root[0], root[1][0]) != (fqn, path[0]):
                    return ".".join(parts[:n]), (fqn, path, i), root, True
    return None


def _paths(tree: Mapping[Any, Any], at: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """The key paths down to every value of nested dicts that is not a dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _paths(value, (*at, key))
        else:
            yield (*at, key)


def _show_path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path)


class _BadKey:
    """What :func:`_first_odd` finds at an inner key that would not come back as it is (``key``)."""

    def __init__(self, key: Any) -> None:
        self.key = key


def _first_odd(
    tree: Mapping[Any, Any], kinds: tuple[type, ...], depth: int, prone: list[Any] | None = None
) -> tuple[list[Any], Any] | None:
    """The keys down to the first value of nested dicts that is none of ``kinds``, and that value; or down to
    the dict holding the first key below a state name (``depth`` 2 on: ``state[param][name][key]``) that is
    not a ``str`` without ``.``, and that key as a :class:`_BadKey`. ``prone``: gets each state name (``depth``
    1) that holds a ``.`` or nested state, on the way (in one walk: it costs a large model's save little)."""
    for key, value in tree.items():
        if depth >= 2 and not (isinstance(key, str) and "." not in key):
            return [], _BadKey(key)
        if prone is not None and depth == 1 and (isinstance(value, dict) or (isinstance(key, str) and "." in key)):
            prone.append(key)
        found = (
            _first_odd(value, kinds, depth + 1, prone)
            if isinstance(value, dict)
            else None
            if isinstance(value, kinds)
            else ([], value)
        )
        if found is not None:
            return [key, *found[0]], found[1]
    return None


#: the suffix of partial checkpoint folders: no tag may end in it
PARTIAL_SUFFIX = "_partial"
#: Longest tag in UTF-8 bytes: ``{tag}_partial`` must fit one path component (255 bytes on common
#: filesystems) with room to spare; checked up front so a long tag never fails half-way through a save.
_MAX_TAG_BYTES = 200
#: Characters a tag may hold besides letters and digits. Deliberately no glob characters (``* ? [ ] { } !``),
#: no separators, no spaces: a tag ends up in fsspec calls and S3 keys, and some backends expand globs.
_TAG_PUNCTUATION = frozenset("._-+=@,")


def validate_tag(tag: Any) -> str:
    """Return ``tag`` if it is usable as a checkpoint tag (the README's rules: letters, digits and
    ``. _ - + = @ ,``, starting with a letter or digit, no ``..``, not ending in ``_partial``, at most 200
    bytes in UTF-8), else raise :class:`ValueError`, on every backend alike, before anything is written."""
    if not isinstance(tag, str):
        raise ValueError(f"checkpoint tag must be a str, got {type(tag).__name__}")
    problem = _tag_problem(tag)
    if problem:
        raise ValueError(f"invalid checkpoint tag {tag[:80]!r}: {problem}")
    return tag


def _tag_problem(tag: str) -> str | None:
    if not tag:
        return "it is empty"
    bad = sorted({c for c in tag if not (c.isalnum() or c in _TAG_PUNCTUATION)})
    if bad:
        shown = "".join(bad[:10])
        return (
            f"it contains {shown!r}; a tag may hold only letters, digits and "
            f"{''.join(sorted(_TAG_PUNCTUATION))!r} (no path separators, whitespace, control or glob characters)"
        )
    if not tag[0].isalnum():
        return "it must start with a letter or digit"
    if ".." in tag:
        return "it contains '..'"
    if tag.endswith(PARTIAL_SUFFIX):
        return f"it ends in {PARTIAL_SUFFIX!r}, the suffix of partial checkpoint folders"
    size = len(tag.encode("utf-8"))
    if size > _MAX_TAG_BYTES:
        return f"it is {size} bytes long in UTF-8; at most {_MAX_TAG_BYTES} are allowed"
    return None


def is_valid_tag(tag: Any) -> bool:
    return isinstance(tag, str) and _tag_problem(tag) is None
