"""Save planners kept across the API's saves, so an unchanged state is not planned again at every save.

A rank's local plan is a pure function of its state's structure, its rank and the layout; the planner
memoises it (``cache_scope="local"``) and checks the structure at every save, so reuse is correct
whatever happened to an earlier save. Nothing cached crosses ranks -- the coordinator plans afresh from
full local plans every time -- so a rank that builds a fresh planner (another configuration, a
background save holding the kept one) mixes safely with ranks that reuse theirs. Measured: the local
planning of a 2-rank save drops from 1.07x DCP's to about 0.45x (``benchmarks/RESULTS.md``).

One planner is kept per kind of save ("partial", "full") for the last configuration used; it holds
no tensors between saves (:meth:`~smpckpt.planners.ParallelSavePlanner.release_state`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from smpckpt._args import CommonRequest
from smpckpt.planners import ParallelSavePlanner

__all__ = ["kept_save_planner", "forget_save_planners"]

_LOCK = threading.Lock()
# kind -> (configuration, planner); a planner in use is taken out, so no two saves share one
_KEPT: dict[str, tuple[tuple[Any, ...], ParallelSavePlanner]] = {}


def _configuration(req: CommonRequest) -> tuple[Any, ...]:
    return (req.layout, req.rules, req.name_map, req.process_group)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    # the layout by value; rules, the user's name map and the process group by identity (the kept
    # planner references them, so an equal id cannot be a new object)
    return a[0] == b[0] and all(x is y for x, y in zip(a[1:], b[1:]))


@contextlib.contextmanager
def kept_save_planner(kind: str, req: CommonRequest) -> Iterator[ParallelSavePlanner]:
    """(all ranks) The kept planner for ``kind`` when ``req`` configures it alike, else a new one; kept
    again (without this save's tensors) once the save returns or raises."""
    config = _configuration(req)
    with _LOCK:
        held = _KEPT.pop(kind, None)
    if held is not None and _same(held[0], config):
        planner = held[1]
    else:
        planner = ParallelSavePlanner(**req.planner_args(), cache_scope="local")
    try:
        yield planner
    finally:
        planner.release_state()
        with _LOCK:
            _KEPT[kind] = (config, planner)


def forget_save_planners() -> None:
    """Drop every kept planner (tests; a process that will not save again)."""
    with _LOCK:
        _KEPT.clear()
