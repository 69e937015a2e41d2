"""Pausing Python's cyclic garbage collector around bulk work (one job, shared by planners, readers and writers)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (also a decorator: ``@gc_paused()``).

    Bulk work -- a plan's items, every rank's plans or results, a Metadata unpickled, a full
    artifact's check units -- makes objects by the ten thousand, and the collections that triggers
    each walk every object of a process with torch loaded: they cost 5-15x a parse itself (0.13 s
    against 0.01 s for 16,600 units), and a save of 2,700 tensors per rank at 4 ranks spent 0.75 of
    its 2 s in four full collections. Paused, the same allocations count once when the collector
    resumes instead of once per 700, so far fewer full collections follow. Pauses wrap CPU-bound work
    only, never I/O: the collector is off for tens of milliseconds at most, also when a hook runs on
    an async save's thread beside training. What is made inside holds no cycles, so nothing is left
    for the collector to find. The switch is process-wide: two threads inside at once only lose the
    pause early (a speed loss, nothing else), and a ``gc.disable()`` another thread makes inside a
    pause is undone when the pause ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
