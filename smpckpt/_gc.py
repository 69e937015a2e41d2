"""Keeping Python's cyclic garbage collector off bulk work: paused around CPU-bound bursts (planners,
readers, writers), and kept off the objects a process already holds while a save or load runs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_frozen", "gc_paused"]


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


@contextlib.contextmanager
def gc_frozen(enabled: bool = True) -> Iterator[None]:
    """The objects that exist on entry sit out every cyclic collection until exit (``gc.freeze``).

    Why: a save or load of thousands of tensors per rank keeps tens of thousands of objects alive
    (plans, metadata, results) long enough to reach the oldest generation, which sets off full
    collections, and each walks every object of the process: ~280,000 with torch loaded, more with a
    training job's own. At 4 ranks x 2,723 tensors a partial save spent a quarter of its time in them.
    Frozen, those collections walk only what was made since entry. The collector keeps running, so
    garbage made inside is still collected. Entry first collects the young generations (~0.03 ms), so
    no young garbage is frozen (unfreezing puts every frozen object in the oldest generation, where
    it would wait for a full collection); older garbage waits for the next full one, as it would anyway.

    A full collection run while frozen leaves the collector counting only the objects it saw, so it
    would start a full one over the whole process soon after: in the caller's next training step. When
    one ran, exit runs that full collection itself, once (an unfrozen save would have run at least one
    by then), so the cost stays inside the save and nothing is left to the code that follows.

    Only a caller that finds nothing frozen freezes, and only it unfreezes, at its exit: not used when
    the collector is off or when objects are frozen already (``gc.get_freeze_count() > 0``) -- by the
    process itself, whose freeze exit would otherwise lift, or by an enclosing ``gc_frozen``, which
    keeps its freeze until it leaves. Of two threads inside at once, the one that froze lifts the freeze
    when it leaves, and the other loses it early: a speed loss, nothing else (it keeps no state, so the
    process holds none). The API wraps synchronous saves and loads; async saves not at all, since their
    write runs beside training, whose garbage must not wait for it."""
    froze = False
    full_at_freeze = 0
    try:
        if enabled and gc.isenabled() and gc.get_freeze_count() == 0:  # enabled: the caller's freeze_gc
            gc.collect(1)  # finalizers it runs may enter here too (and freeze: then this caller does not)
            if gc.get_freeze_count() == 0:
                full_at_freeze = _full_collections()
                gc.freeze()
                froze = True
        yield
    finally:
        if froze:
            gc.unfreeze()
            if _full_collections() > full_at_freeze:
                gc.collect()


def _full_collections() -> int:
    return int(gc.get_stats()[-1]["collections"])
