"""The order in which a read's requests reach the device.

Some devices punish concurrent streams at scattered offsets (a disk that seeks); verification is CPU
work that needs no device and should overlap the next read rather than sit between reads.
:class:`InOrder` lets the reader keep several worker threads (hashing, copying) while only ``depth``
of them are inside a read at a time, and those start in planned (file, offset) order. It is opt-in
(``FsspecStorageReader(reads_in_flight=...)``; ``benchmarks/RESULTS.md``, "cold loads").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["InOrder", "ReadAborted"]


class ReadAborted(RuntimeError):
    """A read waiting for its turn was given up because an earlier one failed."""


class InOrder:
    """Admits reads in ticket order (0, 1, 2, ...), at most ``depth`` at once. Thread-safe.

    Tickets are handed out on the calling thread in submission order and tasks run FIFO on the pool,
    so the lowest waiting ticket is always held by a running worker: no wait can block forever unless a
    ticket is never used -- :meth:`abort` (on any failure) releases every waiter with
    :class:`ReadAborted`.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"reads in flight must be >= 1, got {depth}")
        self.depth = depth
        self._next = 0
        self._active = 0
        self._aborted = False
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def turn(self, ticket: int) -> Iterator[None]:
        with self._cv:
            while not self._aborted and (self._next != ticket or self._active >= self.depth):
                self._cv.wait()
            if self._aborted:
                raise ReadAborted("an earlier read of this load failed")
            self._next += 1
            self._active += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()
