"""Argument checks every public entry point shares: options refused by name, up front, before anything
runs -- never a truthy string taken for ``True`` or a negative count failing deep inside ``dcp.save``."""

from __future__ import annotations

from typing import Any

__all__ = ["check_flag", "check_int", "check_process_group"]


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
