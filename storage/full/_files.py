"""Byte runs of full artifacts: ``pread`` on local files, ranged GETs on object stores, where bytes are
fetched in enclosing spans of at most :data:`SPAN_BYTES` shared by a column box's rows and by
neighbouring tensors (:func:`plan_spans`, :class:`SpanFetcher`) and the runs cut out of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage.backends._fs import is_local, join, pread_into, translate_errors
from smpckpt.storage.full._units import intervals

__all__ = ["RunFiles", "SpanFetcher", "plan_spans", "SPAN_BYTES", "SPAN_WASTE"]

#: a fetched span (file name, first byte, bytes)
Held = tuple[str, int, bytes]


class RunFiles:
    """Open files of one read call: ``pread`` on local paths, ranged GETs elsewhere."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = is_local(fs)
        self.fds: dict[str, int] = {}
        self._lock = threading.Lock()  # fds and the request count, from several worker threads
        #: requests issued: ``preadv`` calls on local files, GETs on object stores
        self.requests = 0
        # object stores: spans fetched ahead, served to the worker thread that holds them
        # (per thread: the units of a box are held and read by the thread reading that box)
        self._tls = threading.local()

    def fetch(self, name: str, lo: int, hi: int) -> bytes:
        """(object stores) File bytes ``[lo, hi)`` in one GET."""
        path = join(self.path, name)
        with translate_errors(path):
            blob = self.fs.cat_file(path, start=lo, end=hi)
        self._count(1)
        if len(blob) != hi - lo:
            raise CheckpointCorrupt(f"{path}: short read at offset {lo} ({len(blob)} of {hi - lo} bytes)")
        return bytes(blob)

    def hold(self, name: str, lo: int, hi: int) -> int:
        """(object stores) Fetch bytes ``[lo, hi)`` in one GET, serving runs from them; the bytes fetched."""
        self._tls.held = ()
        if self.local or hi <= lo:
            return 0
        self._tls.held = ((name, lo, self.fetch(name, lo, hi)),)
        return hi - lo

    def serve(self, held: Sequence[Held]) -> None:
        """(object stores) Serve this thread's runs from ``held`` spans until the next call; ``()`` lets go."""
        self._tls.held = tuple(held)

    def _count(self, n: int) -> None:
        with self._lock:
            self.requests += n

    def __enter__(self) -> RunFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def _fd(self, name: str) -> int:
        """(local files) The descriptor of ``name``, opened once per read call."""
        with self._lock:
            fd = self.fds.get(name)
            if fd is None:
                with translate_errors(join(self.path, name)):
                    fd = self.fds[name] = os.open(join(self.path, name), os.O_RDONLY)
            return fd

    def prefetch(self, name: str, lo: int, n: int) -> None:
        """(local files) Advise the kernel to read bytes ``[lo, lo + n)`` of ``name`` now (``WILLNEED``), so a
        streamed box's later pieces arrive while the first is checked. Nothing on object stores."""
        if self.local and n > 0 and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # advice only: a filesystem that refuses it reads as before
                os.posix_fadvise(self._fd(name), lo, n, os.POSIX_FADV_WILLNEED)

    def read_runs(self, name: str, starts: np.ndarray, run: int, out: memoryview) -> int:
        """Runs of ``run`` bytes at ``starts`` (ascending) back to back into ``out``; the bytes fetched."""
        path = join(self.path, name)
        if self.local:
            fd = self._fd(name)
            los, his, at = intervals(starts, run)  # adjacent runs merge into one request
            self._count(len(los))
            for lo, n, pos in zip(los.tolist(), (his - los).tolist(), at.tolist()):
                got = pread_into(fd, [out[pos : pos + n]], lo, n)
                if got != n:
                    raise CheckpointCorrupt(f"{path}: truncated ({got} of {n} bytes at offset {lo})")
            return len(starts) * run
        # Object stores: a GET costs far more than the bytes between strided runs (a column shard's
        # rows), so runs are fetched in enclosing spans of up to SPAN_BYTES and cut out here.
        groups = _span_groups(starts, run)
        spans = [(int(starts[a]), int(starts[b - 1]) + run - int(starts[a])) for a, b in groups]
        first, end = spans[0][0], spans[-1][0] + spans[-1][1]
        held = [h for h in getattr(self._tls, "held", ()) if h[0] == name and h[1] <= first and end <= h[1] + len(h[2])]
        if held:
            base, whole = held[0][1], memoryview(held[0][2])
            blobs: list[Any] = [whole[lo - base : lo - base + n] for lo, n in spans]
            fetched = 0
        else:
            with translate_errors(path):
                blobs = self.fs.cat_ranges([path] * len(spans), [lo for lo, _ in spans], [lo + n for lo, n in spans])
            self._count(len(spans))
            fetched = sum(n for _, n in spans)
        pos = 0
        for (lo, n), (a, b), blob in zip(spans, groups, blobs):
            if isinstance(blob, Exception) or len(blob) != n:
                raise CheckpointCorrupt(f"{path}: short read at offset {lo}") from (
                    blob if isinstance(blob, Exception) else None
                )
            src = np.frombuffer(blob, dtype=np.uint8)
            dst = np.frombuffer(out, dtype=np.uint8)
            rel = starts[a:b].astype(np.int64) - lo
            steps = np.diff(rel)
            if len(rel) > 1 and (steps == steps[0]).all() and steps[0] >= run:
                # evenly spaced rows (the usual column box): one strided copy
                rows = np.lib.stride_tricks.as_strided(src, (len(rel), run), (int(steps[0]), 1))
                dst[pos : pos + len(rel) * run].reshape(len(rel), run)[:] = rows
                pos += len(rel) * run
                continue
            for s in rel.tolist():
                dst[pos : pos + run] = src[s : s + run]
                pos += run
        return fetched


#: object stores: strided runs within one enclosing span of at most this many bytes share one GET
SPAN_BYTES = 32 << 20
#: object stores: neighbouring boxes share a span while at most this fraction of it is unwanted bytes
SPAN_WASTE = 1 / 20


def plan_spans(
    extents: Sequence[Sequence[tuple[str, int, int]]], *, limit: int | None = None, waste: float = SPAN_WASTE
) -> tuple[list[tuple[str, int, int]], list[tuple[int, ...]]]:
    """Spans ``(file, lo, hi)`` that fetch the items' byte extents (a box's runs and their check units) in
    few GETs, and each item's span indices (``()``: an empty extent or one over ``limit``, fetched alone;
    ``limit`` default: :data:`SPAN_BYTES`). A file's extents merge in order while the span stays within
    ``limit`` with at most ``waste`` of it outside every extent."""
    limit = SPAN_BYTES if limit is None else limit
    eligible = [all(0 < hi - lo <= limit for _, lo, hi in ext) and bool(ext) for ext in extents]
    flat = sorted((name, lo, hi, i) for i, ext in enumerate(extents) if eligible[i] for name, lo, hi in ext)
    spans: list[tuple[str, int, int]] = []
    of: list[set[int]] = [set() for _ in extents]
    covered = 0  # bytes of the current span inside some extent
    for name, lo, hi, i in flat:
        if spans:
            s_name, s_lo, s_hi = spans[-1]
            grown, add = max(s_hi, hi), max(0, hi - max(lo, s_hi))
            if s_name == name and grown - s_lo <= limit and grown - s_lo <= (covered + add) * (1 + waste):
                spans[-1] = (name, s_lo, grown)
                covered += add
                of[i].add(len(spans) - 1)
                continue
        spans.append((name, lo, hi))
        covered = hi - lo
        of[i].add(len(spans) - 1)
    return spans, [tuple(sorted(s)) for s in of]


class SpanFetcher:
    """(object stores) The spans of :func:`plan_spans` fetched on their own threads, in order, at most
    ``ahead`` not yet released; a span goes when its last item is released. Called from one thread:
    ``need`` before an item goes to a worker (returns the futures to wait on), ``top_up`` after,
    ``release`` when the item is done, ``close`` at the end."""

    def __init__(
        self,
        files: RunFiles,
        spans: Sequence[tuple[str, int, int]],
        item_spans: Sequence[tuple[int, ...]],
        *,
        ahead: int,
        on_fetch: Callable[[str, int], None],
    ) -> None:
        self.files, self.spans, self.ahead, self.on_fetch = files, list(spans), ahead, on_fetch
        self.uses = Counter(i for idx in item_spans for i in idx)
        self.futures: dict[int, concurrent.futures.Future[Held]] = {}
        self.next = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(ahead, thread_name_prefix="smpckpt-span-get")

    def _fetch(self, i: int) -> Held:
        name, lo, hi = self.spans[i]
        blob = self.files.fetch(name, lo, hi)
        self.on_fetch(name, hi - lo)
        return name, lo, blob

    def _start(self) -> None:
        self.futures[self.next] = self._pool.submit(self._fetch, self.next)
        self.next += 1

    def need(self, idx: tuple[int, ...], make_room: Callable[[], bool]) -> list[concurrent.futures.Future[Held]]:
        """Start every span up to the last of ``idx``; while ``ahead`` are held, ``make_room`` first."""
        while idx and self.next <= idx[-1]:
            if len(self.futures) >= self.ahead and make_room():
                continue
            self._start()
        return [self.futures[i] for i in idx]

    def top_up(self) -> None:
        while len(self.futures) < self.ahead and self.next < len(self.spans):
            self._start()

    def release(self, idx: tuple[int, ...]) -> None:
        for i in idx:
            self.uses[i] -= 1
            if self.uses[i] <= 0:
                self.futures.pop(i, None)

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.futures.clear()
        self._pool.shutdown(wait=True)


def _span_groups(starts: np.ndarray, run: int) -> list[tuple[int, int]]:
    """Index ranges ``[a, b)`` of ``starts`` whose runs fit one span of at most ``SPAN_BYTES``."""
    out: list[tuple[int, int]] = []
    a = 0
    for i in range(1, len(starts) + 1):
        if i == len(starts) or int(starts[i]) + run - int(starts[a]) > SPAN_BYTES:
            out.append((a, i))
            a = i
    return out
