"""Keeping Python's cyclic garbage collector off bulk work: paused around CPU-bound bursts (planners,
readers, writers), and kept off the objects a process already holds while a save or load runs. And the
objects owning threads or locks reset in a forked child (:func:`forget_at_fork`)."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["gc_frozen", "gc_paused", "forget_at_fork"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (also a decorator: ``@gc_paused()``).

    Bulk work makes objects by the ten thousand, and each collection that sets off walks every object
    of the process (README, "Many tensors"). Pauses wrap CPU-bound work only, never I/O, and what is
    made inside holds no cycles. The switch is process-wide: two threads inside at once only lose the
    pause early, and a ``gc.disable()`` another thread makes inside a pause is undone when it ends."""
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

    Full collections set off by a save's objects then walk only what was made since entry (README,
    "Garbage collection"); the collector keeps running. Entry first collects the young generations, so
    no young garbage is frozen. When a full collection ran while frozen, exit runs one itself, so the
    collector does not start one over the whole process in the caller's next step.

    Only a caller that finds nothing frozen (and the collector on) freezes, and only it unfreezes: a
    freeze by the process or an enclosing ``gc_frozen`` is never lifted. Of two threads inside at once,
    the other loses the freeze early (a speed loss only). Async saves are not wrapped: their write runs
    beside training, whose garbage must not wait for it."""
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


def forget_at_fork(obj: Any) -> None:
    """In a child forked while ``obj`` lives, call ``obj._forget()``: the parent's threads, and the locks
    they held at the fork, are not the child's (a DataLoader worker)."""
    if hasattr(os, "register_at_fork"):
        ref = weakref.ref(obj)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))


def _forget_in_child(ref: weakref.ref[Any]) -> None:
    obj = ref()
    if obj is not None:
        obj._forget()
