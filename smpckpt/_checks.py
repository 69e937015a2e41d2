"""Argument checks every public entry point shares: options refused by name, up front, before anything
runs -- never a truthy string taken for ``True`` or a negative count failing deep inside ``dcp.save``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["check_flag", "check_int", "check_process_group", "refuse_unflattenable"]


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
    tensors, numbers and dicts (LBFGS's lists) naming neither optimizer nor key: named here, before any I/O."""
    import torch

    for i, opt in enumerate(optimizers):
        if _first_odd(opt.state, (torch.Tensor, int, float)) is None:  # the common case: no state_dict() built twice
            continue
        odd = _first_odd(opt.state_dict()["state"], (torch.Tensor, int, float))
        if odd is not None:
            (index, *key), value = odd  # state_dict() keys state by the parameter's index in its groups
            p = dict(enumerate(q for group in opt.param_groups for q in group["params"])).get(index)
            name, at = next((n for n, q in model.named_parameters() if q is p), index), ".".join(map(str, key))
            raise TypeError(
                f"optimizer {i} ({type(opt).__name__}) holds a {type(value).__name__} under state key {at!r} of "
                f"parameter {name!r}: torch.distributed.checkpoint keeps only tensor, int, float and dict optimizer "
                "state; leave it out of optimizer= and put its state_dict() in user_content"
            )


def _first_odd(tree: Mapping[Any, Any], kinds: tuple[type, ...]) -> tuple[list[Any], Any] | None:
    """The keys down to the first value of nested dicts that is none of ``kinds``, and that value."""
    for key, value in tree.items():
        found = (
            _first_odd(value, kinds) if isinstance(value, dict) else None if isinstance(value, kinds) else ([], value)
        )
        if found is not None:
            return [key, *found[0]], found[1]
    return None
