"""Argument checks every public entry point shares: options refused by name, up front, before anything
runs -- never a truthy string taken for ``True`` or a negative count failing deep inside ``dcp.save``."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any

__all__ = ["check_flag", "check_int", "check_process_group", "refuse_unflattenable", "check_globs", "compile_globs"]
__all__ += ["validate_tag", "is_valid_tag", "PARTIAL_SUFFIX", "validate_keep"]  # (re-exported by smpckpt.catalog.root)


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


def check_globs(name: str, patterns: Any) -> tuple[str, ...]:
    """A list of key globs, as a tuple. A lone string is refused: it would be a glob per character, its ``*``
    any key. So is anything not an iterable of ``str`` (rev73d 2: ``[1]`` failed later, naming no option)."""
    if isinstance(patterns, (str, bytes)):
        raise TypeError(f"{name} must be a list of globs, not a single string: [{patterns!r}]?")
    listed = tuple(patterns) if isinstance(patterns, Iterable) else None
    if listed is None or not all(isinstance(p, str) for p in listed):
        raise TypeError(f"{name} must be a list of key globs (str), got {patterns!r}")
    return listed


def compile_globs(patterns: Any, name: str) -> re.Pattern[str] | None:
    """``patterns`` (checked by :func:`check_globs` as option ``name``) as one regex; ``None`` for none."""
    listed = check_globs(name, patterns)
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in listed)) if listed else None


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
    for i, opt in enumerate(optimizers):
        _refuse_stray_keys(i, opt)
        # what DCP flattens is state_dict()["state"] (keyed by the parameter's index): built only when it may differ
        # from opt.state (an override or a state_dict hook: rev72i) or opt.state holds an odd value (rare)
        walked = opt.state if _plain_state_dict(opt) else opt.state_dict()["state"]
        _refuse_states(model, i, opt, walked, walked)


def _refuse_stray_keys(i: int, opt: Any) -> None:
    """State under a key of ``opt.state`` that is none of its parameters (a count of its own, as some LAMB and
    Shampoo ports keep; a parameter taken out of its groups): DCP's ``get_state_dict`` (and, for a tensor, the
    optimizer's own ``state_dict()``) fails on it with a bare ``KeyError``. One pass over the groups and the keys."""
    import torch

    stray = next((k for k in opt.state if not isinstance(k, torch.Tensor)), None)
    if stray is not None:
        raise ValueError(
            f"optimizer {i} ({type(opt).__name__}) holds state under the key {stray!r}, which is not one of its "
            "parameters: torch.distributed.checkpoint keeps optimizer state per parameter and fails on it; leave "
            "it out of optimizer= and put its state_dict() in user_content, or keep that state under a parameter"
        )
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    t = next((k for k in opt.state if id(k) not in held), None)
    if t is not None:
        raise ValueError(
            f"optimizer {i} ({type(opt).__name__}) holds state under a tensor of shape {tuple(t.shape)} that is in "
            "none of its param_groups (a parameter taken out of them?): its state_dict() and "
            "torch.distributed.checkpoint fail on it; drop that state (del optimizer.state[tensor]) before saving"
        )


def _refuse_states(model: Any, i: int, opt: Any, walked: Mapping[Any, Any], tree: Mapping[Any, Any]) -> None:
    """:func:`refuse_unflattenable`'s judgement of optimizer ``i``'s states ``tree`` (``walked``'s, or some of them:
    the state a resume just gave some parameters, fix72m): a value DCP does not keep, an inner key not a dot-free
    ``str``, two values flattening into one key. ``walked``: ``opt.state`` or ``opt.state_dict()["state"]``."""
    import torch

    kinds = (torch.Tensor, int, float)
    nested: list[Any] = []  # each parameter's state the walk saw nested state in
    odd = _first_odd(tree, kinds, 0, nested)
    if odd is not None and walked is opt.state and tree is walked:
        walked = tree = opt.state_dict()["state"]
        nested = []
        odd = _first_odd(walked, kinds, 0, nested)
    if odd is not None:
        (index, *key), value = odd
        name, at = _param_name(model, opt, walked, index), ".".join(map(str, key))
        if isinstance(value, _BadKey):
            raise ValueError(
                f"optimizer {i} ({type(opt).__name__}) holds a dict under state key {at!r} of parameter "
                f"{name!r} with the inner key {value.key!r}: torch.distributed.checkpoint joins nested "
                "optimizer state keys with '.' and splits them again at the load, so it would come back "
                "restructured; use str inner keys without '.', or leave the optimizer out of optimizer= "
                "and put its state_dict() in user_content"
            )
        raise TypeError(
            f"optimizer {i} ({type(opt).__name__}) holds a {type(value).__name__} under state key {at!r} "
            f"of parameter {name!r}: torch.distributed.checkpoint keeps only tensor, int, float and dict "
            "optimizer state; leave it out of optimizer= and put its state_dict() in user_content"
        )
    odd_names = _odd_names(nested) if nested else None
    if odd_names:
        _refuse_clashing(model, i, opt, walked, nested, all_str=odd_names == "dotted")
    if _odd_names(list(tree.values())) == "any":  # names alike once str()-ed need no nested state: {0: t, "0": u}
        plain = [st for st in tree.values() if not all(isinstance(k, str) for k in st)]  # (rev72n M1)
        _refuse_clashing(model, i, opt, walked, plain)


def _plain_state_dict(opt: Any) -> bool:
    """``opt.state_dict()["state"]`` holds ``opt.state``'s values as they are (by each parameter's index): torch's
    own ``state_dict``, not overridden, and no ``register_state_dict_pre_hook``/``_post_hook`` hook on it."""
    import torch

    return (
        getattr(type(opt), "state_dict", None) is torch.optim.Optimizer.state_dict
        and not getattr(opt, "_optimizer_state_dict_pre_hooks", None)
        and not getattr(opt, "_optimizer_state_dict_post_hooks", None)
    )


def refuse_clashing_new_state(model: Any, i: int, opt: Any, params: Sequence[Any]) -> None:
    """The checks of :func:`refuse_unflattenable` on the state a resume's step at lr 0 just gave ``params`` of
    optimizer ``i`` (a fresh one was checked while it had none: from a checkpoint written before the checks, its
    clashing state loaded silently wrong, fix72j, and so did a dotted or non-str inner key, fix72m). Refused,
    ``params`` are left without state, as they came."""
    walked, keys = opt.state, list(params)
    if not _plain_state_dict(opt):  # judged on what DCP loads into, as at the save (rev72i)
        index = {id(q): k for k, q in enumerate(q for g in opt.param_groups for q in g["params"])}
        walked, keys = opt.state_dict()["state"], [index.get(id(p)) for p in params]
    try:
        _refuse_states(model, i, opt, walked, {k: st for k in keys if (st := walked.get(k)) is not None})
    except (ValueError, TypeError):
        for p in params:
            opt.state.pop(p, None)
        raise


def _odd_names(states: list[Any]) -> str | None:
    """Whether some of ``states`` holds a name not a ``str`` (``"any"``), else one with a ``.`` (``"dotted"``), else
    ``None`` (one join over all their names, in C)."""
    try:
        return "dotted" if "." in "".join(chain.from_iterable(states)) else None
    except TypeError:
        return "any"


def _refuse_clashing(
    model: Any, i: int, opt: Any, walked: Mapping[Any, Any], nested: list[Any], *, all_str: bool = False
) -> None:
    """Two state values of one parameter DCP's flattening makes one key (``state.<fqn>.<path joined by '.'>``): a
    dotted state name beside nested state (``{"b.c": t, "b": {"c": u}}``), one written over the other; or a key
    under a nested state's (``{"nest": {...}, "nest.w": t}``), which the load reads back into that nested state.
    ``nested``: the states of ``walked`` holding nested state, which any clash needs, beside a name not a ``str``
    or with a ``.`` (inner keys are dot-free ``str``s, else refused). Across parameters none can be: no two names
    of a module tree's parameters are one the other's dotted prefix, and no parameter is in two optimizers.
    ``all_str``: every name is a ``str`` (no two alike once ``str()``-ed): only a dotted name whose prefix names
    nested state can clash: those pairs are found over all the names at once, and only a state holding one is
    given to :func:`state_clash` (rev72i: it ran for every state, 5x the cost at 100k)."""
    states = {id(st): st for st in nested}.values()
    pairs = _prefix_pairs(list(states)) if all_str else None
    by: dict[str, list[str]] = {}  # each dotted name's prefixes that are names too: looked up per name of a state
    for d, p in pairs or ():
        by.setdefault(d, []).append(p)
    for st in states if pairs is None or pairs else ():
        if pairs is not None and not any(isinstance(st.get(p), dict) for d in st if d in by for p in by[d]):
            continue  # (each pair against each state was quadratic: 78 s at 16k distinct dotted names, rev72n M2)
        clash = state_clash(st)
        if clash is None:
            continue
        key, path, path2, inside = clash
        index = next(k for k, v in walked.items() if v is st)
        fqn = _param_name(model, opt, walked, index, dcp=True)
        one = f"optimizer {i} ({type(opt).__name__}) holds state {_show_path(path)} of parameter {fqn!r}"
        two = f"state {_show_path(path2)} of parameter {fqn!r}"
        if inside:
            how = f"the load reads every key under 'optim.state.{fqn}.{key}.' back into the nested state, so the "
            how += "first would come back inside the second"
        else:
            how = f"torch.distributed.checkpoint flattens both to the key 'optim.state.{fqn}.{key}', so one would "
            how += "be saved over the other"
        raise ValueError(
            f"{one} and {two}: {how}; rename one of those state keys, or leave the optimizer out of optimizer= and "
            "put its state_dict() in user_content"
        )


def state_clash(st: Mapping[Any, Any]) -> tuple[str, tuple[Any, ...], tuple[Any, ...], bool] | None:
    """The first clash in one parameter's optimizer state ``st`` once flattened as DCP does (its path's keys
    joined by ``.``): ``(key, first value's path, second's, nested)``, ``key`` relative to the parameter;
    ``nested``: the first value's flat key is, or lies under, ``key``, the flat key of the second, a nested state of
    another name (its load gathers every key under it). ``None``: none."""
    roots = {str(name): name for name, v in st.items() if isinstance(v, dict)}
    names = [str(name) for name in st]
    if len(set(names)) == len(names) and not any(
        ".".join(parts[:n]) in roots
        for parts in (s.split(".") for s in names if "." in s)
        for n in range(1, len(parts))
    ):
        return None  # (a clash needs two names of one str, or one's dotted prefix a nested state's name)
    leaves: dict[str, tuple[Any, ...]] = {}
    for path in _paths(st, ()):
        key = ".".join(map(str, path))
        if key in leaves:
            return key, leaves[key], path, False
        leaves[key] = path
    for key, path in leaves.items():
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            root = roots.get(".".join(parts[:n]))
            if root is not None and root is not path[0]:
                return ".".join(parts[:n]), path, (root,), True
    return None


def _prefix_pairs(states: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Each dotted name of ``states`` (all ``str``) beside each of its dotted prefixes that some state of ``states``
    has as a name too: the pairs a clash needs in one state, the prefix naming nested state (a set of all names, in
    C, then a loop over the distinct names alone)."""
    names = set(chain.from_iterable(states))
    pairs = []
    for name in names:
        if "." in name:
            parts = name.split(".")
            pairs += [(name, p) for n in range(1, len(parts)) if (p := ".".join(parts[:n])) in names]
    return pairs


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
    tree: Mapping[Any, Any], kinds: tuple[type, ...], depth: int, nested: list[Any]
) -> tuple[list[Any], Any] | None:
    """The keys down to the first value of nested dicts that is none of ``kinds``, and that value; or down to
    the dict holding the first key below a state name (``depth`` 2 on: ``state[param][name][key]``) that is
    not a ``str`` without ``.``, and that key as a :class:`_BadKey`. ``nested``: gets each parameter's state
    (``depth`` 1) holding nested state, once for each nested state in it, on the way (noted in the dict branch
    alone: plain state such as Adam's costs no more than before, nested state one append)."""
    for key, value in tree.items():
        if depth >= 2 and not (isinstance(key, str) and "." not in key):
            return [], _BadKey(key)
        if isinstance(value, dict):
            if depth == 1:
                nested.append(tree)
            found = _first_odd(value, kinds, depth + 1, nested)
        else:
            found = None if isinstance(value, kinds) else ([], value)
        if found is not None:
            return [key, *found[0]], found[1]
    return None


def _param_name(model: Any, opt: Any, walked: Mapping[Any, Any], key: Any, dcp: bool = False) -> Any:
    """The name of the parameter whose state ``walked`` keys by ``key`` (``opt.state``: the parameter;
    ``state_dict()["state"]``: its index in the groups); ``dcp``: as DCP names its state (one, else as is)."""
    p = key if walked is opt.state else dict(enumerate(q for g in opt.param_groups for q in g["params"])).get(key)
    name = next((n for n, q in model.named_parameters() if q is p), key)
    if dcp and isinstance(name, str):
        from torch.distributed.checkpoint.state_dict import _get_fqns

        fqns = _get_fqns(model, name)
        name = next(iter(fqns)) if len(fqns) == 1 else name  # FSDP1's flat parameters: DCP names them itself
    return name


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


def validate_keep(keep: Any, what: str = "num_kept_partial_checkpoints") -> int | None:
    """``None`` (keep everything) or a positive int; anything else raises :class:`ValueError`."""
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise ValueError(f"{what} must be a positive int or None, got {keep!r}")
    if keep < 1:
        raise ValueError(f"{what} must be >= 1 (it counts the checkpoints kept, the new one included), got {keep}")
    return keep
