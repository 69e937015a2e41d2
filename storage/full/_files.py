"""Byte runs of full artifacts: ``pread`` on local files, ranged GETs on object stores, where bytes are
fetched in enclosing spans of at most :data:`SPAN_BYTES` shared by a column box's rows and by
neighbouring tensors (:func:`plan_spans`, :class:`SpanFetcher`) and the runs cut out of them, except
where runs lie farther apart than a request costs: a GET each (:func:`stream_groups`, the partial reader's
cost model).

Column (strided) boxes on local files take the partial reader's cost model (README, "Storage": streamed
spans of whole rows, :func:`stream_plan`, or a request per row), their parts shared by the reader's free
threads (:func:`share`: one thread alone left the device idle between small requests).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage.backends._fs import is_local, is_s3, join, pread_into, translate, translate_errors
from smpckpt.storage.format._checksum import hash_rows
from smpckpt.storage.format._columns import STREAM_PIECE_BYTES, Into, streams
from smpckpt.storage.full._units import Unit, UnitIndex, intervals

__all__ = ["RunFiles", "SpanFetcher", "plan_spans", "SPAN_BYTES", "SPAN_WASTE", "PART_BYTES", "Spread", "StreamPlan"]
__all__ += ["row_groups", "serially", "share", "stream_plan", "read_streamed", "stream_groups"]

#: a fetched span (file name, first byte, bytes)
Held = tuple[str, int, bytes]


@contextlib.contextmanager
def data_file(path: str, keys: Sequence[str] = ()) -> Iterator[None]:
    """Around I/O on data file ``path``: errors translated, and a file the metadata names but storage lacks
    reported as corrupt, naming ``keys`` (the reader then tells one replaced or removed meanwhile: load again)."""
    try:
        with translate_errors(path):
            yield
    except FileNotFoundError as exc:
        raise CheckpointCorrupt(
            f"{path}: data file is missing" + (f" (needed for keys {list(keys)[:5]})" if keys else "")
        ) from exc


class RunFiles:
    """Open files of one read call: ``pread`` on local paths, ranged GETs elsewhere."""

    def __init__(self, fs: Any, path: str, request_cost: int | None = None) -> None:
        self.fs, self.path = fs, path
        self.local = is_local(fs)
        #: (object stores) runs share a GET only where the unread gap between them costs less than one more
        #: request, this many bytes (:func:`stream_groups`); ``None``: whatever the gap (``smpckpt verify``)
        self.request_cost = request_cost
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
        with data_file(path):
            blob = self.fs.cat_file(path, start=lo, end=hi)
        self._count(1)
        if len(blob) != hi - lo:
            raise CheckpointCorrupt(f"{path}: short read at offset {lo} ({len(blob)} of {hi - lo} bytes)")
        return bytes(blob)

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
                with data_file(join(self.path, name)):
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
        if not len(starts):
            return 0
        first, end = int(starts[0]), int(starts[-1]) + run
        held = any(h[0] == name and h[1] <= first and end <= h[1] + len(h[2]) for h in getattr(self._tls, "held", ()))
        if not held and is_s3(self.fs) and end - first == len(starts) * run:
            # S3, runs back to back (a row box, a whole tensor: sizes past a span): the GET body streams
            # into ``out`` as a partial checkpoint's reads do; through a ``bytes`` blob per box, a resume held
            # a copy of every large tensor in flight (one per thread) above the state
            from smpckpt.storage.backends._s3 import get_range_into

            flat = out if out.format == "B" and out.ndim == 1 else out.cast("B")
            with data_file(path):
                got = get_range_into(self.fs, path, first, end, [flat[: end - first]])
            self._count(1)
            if got != end - first:
                raise CheckpointCorrupt(f"{path}: short read at offset {first} ({got} of {end - first} bytes)")
            return end - first
        # Object stores: runs are fetched in enclosing spans of up to SPAN_BYTES, cut out here, where the
        # gaps between them cost less than one more GET (a column box's close rows); rows farther apart
        # take a GET each (stream_groups: the partial reader's cost model), so a column reshard fetches
        # its rows' runs, not the other ranks' columns between them.
        lo = np.asarray(starts, dtype=np.int64)
        groups = stream_groups(lo, lo + run, self.request_cost, SPAN_BYTES)
        spans = [(int(starts[a]), int(starts[b - 1]) + run - int(starts[a])) for a, b in groups]
        blobs, gets = self._spans(name, spans)
        fetched = sum(spans[k][1] for k in gets)
        pos = 0
        for (lo, n), (a, b), blob in zip(spans, groups, blobs):
            _check_span(path, lo, n, blob)
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

    def _spans(self, name: str, spans: Sequence[tuple[int, int]]) -> tuple[list[Any], list[int]]:
        """(object stores) File bytes ``(lo, n)`` of each span: from a span this thread holds where one
        covers it, the rest in one batch of GETs (a failed one as its exception); and which were fetched."""
        held = [h for h in getattr(self._tls, "held", ()) if h[0] == name]
        blobs: list[Any] = [None] * len(spans)
        for k, (lo, n) in enumerate(spans):
            for _, base, data in held:
                if base <= lo and lo + n <= base + len(data):
                    blobs[k] = memoryview(data)[lo - base : lo - base + n]
                    break
        missing = [k for k, b in enumerate(blobs) if b is None]
        if missing:
            path = join(self.path, name)
            with data_file(path):
                got = self.fs.cat_ranges(
                    [path] * len(missing), [spans[k][0] for k in missing], [sum(spans[k]) for k in missing]
                )
            self._count(len(missing))
            for k, blob in zip(missing, got):
                blobs[k] = blob
        return blobs, missing

    @contextlib.contextmanager
    def holding(self, name: str, lo: np.ndarray, hi: np.ndarray) -> Iterator[int]:
        """(object stores) Fetch the byte intervals ``[lo, hi)`` of ``name`` (sorted, disjoint) in GETs as
        :meth:`read_runs` groups runs, and serve this thread's runs from them too inside the block (those this
        thread holds already are not fetched). Gives the bytes fetched; nothing on local files."""
        before = getattr(self._tls, "held", ())
        if self.local or not len(lo):
            yield 0
            return
        groups = stream_groups(lo, hi, self.request_cost, SPAN_BYTES)
        spans = [(int(lo[a]), int(hi[b - 1]) - int(lo[a])) for a, b in groups]
        blobs, fetched = self._spans(name, spans)
        path = join(self.path, name)
        for k in fetched:
            _check_span(path, *spans[k], blobs[k])
        self._tls.held = (*before, *((name, spans[k][0], blobs[k]) for k in fetched))
        try:
            yield sum(spans[k][1] for k in fetched)
        finally:
            self._tls.held = before


def _check_span(path: str, lo: int, n: int, blob: Any) -> None:
    """A span's GET came back whole: a failed one (its exception, a timeout past s3fs's retries) is raised as
    itself, translated (a ``TimeoutError`` naming the file: transient, not a damaged checkpoint, rev72i); a body
    of another length as :class:`CheckpointCorrupt`."""
    if isinstance(blob, FileNotFoundError):  # as data_file() says it on every other path (rev72n L2)
        raise CheckpointCorrupt(f"{path}: data file is missing") from blob
    if isinstance(blob, Exception):
        new = translate(blob, path)
        if new is blob:
            raise blob
        raise new from blob
    if len(blob) != n:
        raise CheckpointCorrupt(f"{path}: short read at offset {lo}")


def stream_groups(lo: np.ndarray, hi: np.ndarray, request_cost: int | None, limit: int) -> list[tuple[int, int]]:
    """Index ranges ``[a, b)`` of the byte intervals ``[lo, hi)`` (sorted by ``lo``, disjoint) that one GET
    each fetches, gaps included: neighbours share one while it spans at most ``limit`` bytes and, with a
    ``request_cost``, the unread gap between them costs less than one more request
    (:func:`~smpckpt.storage.format._columns.streams`, the partial reader's cost model; touching ones always)."""
    n = len(lo)
    if not n:
        return []
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    far = np.zeros(n - 1, dtype=bool)
    if request_cost is not None:  # streams(row bytes, width): the gap next.lo - hi below the cost
        far = (lo[1:] > hi[:-1]) & ~streams(lo[1:] - lo[:-1], hi[:-1] - lo[:-1], request_cost)
    los, his, cut = lo.tolist(), hi.tolist(), far.tolist()
    groups: list[tuple[int, int]] = []
    a = 0
    for i in range(1, n + 1):
        if i == n or cut[i - 1] or his[i] - los[a] > limit:
            groups.append((a, i))
            a = i
    return groups


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


#: bytes of rows (requested) one thread reads as one part of a column box read a request per row: small
#: enough that the reader's threads share a box of a few parts, large enough that drawing one is noise
PART_BYTES = STREAM_PIECE_BYTES

#: how a box's parts run: ``spread(count, work)`` has ``work`` draw part numbers ``0..count-1`` from the
#: iterator it is given and return the bytes it requested; returns their sum
Spread = Callable[[int, Callable[[Iterator[int]], int]], int]


def serially(count: int, work: Callable[[Iterator[int]], int]) -> int:
    """Every part on this thread, in order (object stores: spans are held per thread)."""
    return work(iter(range(count)))


class _Parts:
    """The parts of one box, drawn in order by the threads working on it; after a failure no more are
    drawn (those drawn finish: no thread is left writing into the destination when the box fails)."""

    def __init__(self, count: int, work: Callable[[Iterator[int]], int]) -> None:
        self.count, self.work = count, work
        self.next = 0  # the next part to draw
        self.active = 0  # threads inside work()
        self.requested = 0
        self.failed: BaseException | None = None
        self.cv = threading.Condition()

    def _draw(self) -> Iterator[int]:
        while True:
            with self.cv:
                if self.failed is not None or self.next >= self.count:
                    return
                i, self.next = self.next, self.next + 1
            yield i

    def join(self) -> None:
        """Draw and work on parts until none is left (a helper that starts late returns at once)."""
        with self.cv:
            if self.failed is not None or self.next >= self.count:
                return
            self.active += 1
        got = 0
        try:
            got = self.work(self._draw())
        except BaseException as exc:  # noqa: BLE001 - handed to the box's own thread, which raises it
            with self.cv:
                if self.failed is None:
                    self.failed = exc
        finally:
            with self.cv:
                self.requested += got
                self.active -= 1
                self.cv.notify_all()


def share(
    count: int, work: Callable[[Iterator[int]], int], submit: Callable[[Callable[[], None]], object], helpers: int
) -> int:
    """Parts ``0..count-1`` of one box worked on by this thread and up to ``helpers`` more started with
    ``submit``. Returns the bytes requested; raises the first failure once every part drawn is done. This
    thread draws parts itself and waits only for parts being worked on: waiting on helper futures could
    deadlock when every pool thread is a box's own thread."""
    parts = _Parts(count, work)
    for _ in range(min(helpers, count - 1)):
        submit(parts.join)
    parts.join()
    with parts.cv:
        parts.cv.wait_for(lambda: parts.active == 0)
        if parts.failed is not None:
            raise parts.failed
        return parts.requested


def row_groups(rows: int, urows: np.ndarray, row_bytes: int) -> list[tuple[int, int]]:
    """A box's ``rows`` (``row_bytes`` each) as row ranges of about :data:`PART_BYTES`, cut only where no
    check unit (rows ``urows``, box-relative) spans the cut: each part verifies its own units."""
    if rows <= 0:
        return []
    step = PART_BYTES // max(1, row_bytes)
    return _pieces(0, rows, urows, max(1, step))


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How a column box is streamed: the tensor as rows of ``row_bytes``, rows ``[rows)`` and byte columns
    ``[cols)`` read, in ``pieces`` (row ranges cut where no unit spans the cut). ``units``: the units to
    verify (index positions) with their rows ``urows`` and byte columns ``ucols`` (``(m, 2)``);
    ``box_rows``/``box_cols``: the box's own; ``covered``: the box's elements those units hold."""

    row_bytes: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    box_rows: tuple[int, int]
    box_cols: tuple[int, int]
    pieces: list[tuple[int, int]]
    units: np.ndarray
    urows: np.ndarray
    ucols: np.ndarray
    covered: int = 0

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]

    def span(self, p0: int, p1: int) -> tuple[int, int]:
        """``(offset in the tensor, bytes)`` of the request reading rows ``[p0, p1)``."""
        return p0 * self.row_bytes + self.cols[0], (p1 - p0 - 1) * self.row_bytes + self.width

    @property
    def requested(self) -> int:
        return sum(self.span(a, b)[1] for a, b in self.pieces)


def stream_plan(
    view: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    itemsize: int,
    units: UnitIndex | None,
    request_cost: int,
) -> StreamPlan | None:
    """The streamed read of box ``(offsets, sizes)`` of a row-major tensor of shape ``view``, verified by the
    ``units`` it overlaps (``None``: unverified), when the cost model says streaming costs less; else
    ``None`` (not a column box of whole inner dims, units not rows x columns, or gaps too wide)."""
    nd = len(view)
    if nd < 2 or math.prod(sizes) == 0 or sizes[0] < 2:
        return None
    if tuple(offsets[2:]) != (0,) * (nd - 2) or tuple(sizes[2:]) != tuple(view[2:]):
        return None  # strided below dim 1: runs shorter than a dim-1 entry, not this model's rows
    col_bytes = math.prod(view[2:]) * itemsize  # bytes of one dim-1 entry
    row_bytes = view[1] * col_bytes
    box_rows = (int(offsets[0]), int(offsets[0]) + int(sizes[0]))
    box_cols = (int(offsets[1]) * col_bytes, (int(offsets[1]) + int(sizes[1])) * col_bytes)
    idx = np.zeros(0, dtype=np.int64)
    lo = hi = np.zeros((0, nd), dtype=np.int64)
    if units is not None:
        if units.view is None or tuple(units.view) != tuple(view):
            return None
        idx, lo, hi = units.meeting(offsets, sizes)
        if len(idx) and ((lo[:, 2:] != 0).any() or (hi[:, 2:] != np.asarray(view[2:], dtype=np.int64)).any()):
            return None  # a unit cut below dim 1 (not written by our writers): read as before
    urows = np.stack([lo[:, 0], hi[:, 0]], axis=1) if len(idx) else np.zeros((0, 2), dtype=np.int64)
    ucols = np.stack([lo[:, 1], hi[:, 1]], axis=1) * col_bytes if len(idx) else np.zeros((0, 2), dtype=np.int64)
    r0 = min([box_rows[0], *([int(urows[:, 0].min())] if len(idx) else [])])
    r1 = max([box_rows[1], *([int(urows[:, 1].max())] if len(idx) else [])])
    c0 = min([box_cols[0], *([int(ucols[:, 0].min())] if len(idx) else [])])
    c1 = max([box_cols[1], *([int(ucols[:, 1].max())] if len(idx) else [])])
    if c1 - c0 >= row_bytes or not streams(row_bytes, c1 - c0, request_cost):
        return None  # one run per request already, or rows far enough apart to read a request each
    step = STREAM_PIECE_BYTES // row_bytes
    pieces = _pieces(r0, r1, urows, max(1, step))
    box_lo = np.asarray(offsets, dtype=np.int64)
    box_hi = box_lo + np.asarray(sizes, dtype=np.int64)
    covered = int((np.minimum(hi, box_hi) - np.maximum(lo, box_lo)).prod(axis=1).sum()) if len(idx) else 0
    return StreamPlan(row_bytes, (r0, r1), (c0, c1), box_rows, box_cols, pieces, idx, urows, ucols, covered)


def _pieces(r0: int, r1: int, urows: np.ndarray, step: int) -> list[tuple[int, int]]:
    """Rows ``[r0, r1)`` as ranges of about ``step`` rows, cut only where no unit (``urows``) spans the cut."""
    if not len(urows):
        return [(a, min(r1, a + step)) for a in range(r0, r1, step)]
    order = np.argsort(urows[:, 0], kind="stable")
    starts = urows[order, 0]
    reach = np.maximum.accumulate(urows[order, 1])  # the furthest row a unit starting so far reaches
    cand = np.unique(np.concatenate([np.array([r0, r1], dtype=np.int64), urows[:, 0], urows[:, 1]]))
    k = np.searchsorted(starts, cand, side="left")  # units starting before each candidate
    ok = (k == 0) | (reach[np.maximum(k - 1, 0)] <= cand)
    cuts = cand[ok & (cand >= r0) & (cand <= r1)]
    out: list[tuple[int, int]] = []
    p = r0
    while p < r1:
        i = int(np.searchsorted(cuts, p + step, side="right")) - 1
        c = int(cuts[i])
        if c <= p:  # a unit taller than a piece: the piece takes it whole
            c = int(cuts[int(np.searchsorted(cuts, p, side="right"))])
        out.append((p, c))
        p = c
    return out


def read_streamed(
    files: RunFiles,
    name: str,
    start: int,
    plan: StreamPlan,
    out: memoryview,
    units: UnitIndex | None,
    mismatch: Callable[[Unit], Exception],
    spread: Spread = serially,
) -> int:
    """(local files) The box of ``plan`` from the tensor at byte ``start`` of ``name`` into ``out``, a piece at
    a time through a buffer per thread: read in one request, its ``units`` verified (``mismatch(unit)``: the
    error), its rows' columns copied out. Returns the bytes requested."""
    digests = [units.digest(i) for i in plan.units.tolist()] if units is not None else []
    rb, (c0, _) = plan.row_bytes, plan.cols
    longest = max(plan.span(a, b)[1] for a, b in plan.pieces)
    first, total = plan.span(plan.rows[0], plan.rows[1])
    if len(plan.pieces) > 1:
        files.prefetch(name, start + first, total)
    into = Into(out, plan.box_rows[0], plan.box_cols[1] - plan.box_cols[0], plan.box_cols[0])
    order = np.argsort(plan.urows[:, 0], kind="stable")
    ustart = plan.urows[order, 0]

    def work(drawn: Iterator[int]) -> int:
        buf: memoryview | None = None  # one per thread, made when it draws its first piece
        requested = 0
        for k in drawn:
            p0, p1 = plan.pieces[k]
            at, n = plan.span(p0, p1)
            if buf is None:
                buf = memoryview(bytearray(longest))
            requested += files.read_runs(name, np.array([start + at], dtype=np.int64), n, buf[:n])
            a, b = np.searchsorted(ustart, [p0, p1], side="left").tolist()
            for j in order[a:b].tolist():
                (u0, u1), (uc0, uc1) = plan.urows[j].tolist(), plan.ucols[j].tolist()
                if hash_rows(buf, (u0 - p0) * rb + uc0 - c0, u1 - u0, uc1 - uc0, rb) != digests[j]:
                    raise mismatch(cast(UnitIndex, units).unit(int(plan.units[j])))
            into.copy(buf, p0, c0, (p0, p1), rb)  # only verified bytes are copied: the piece's units all passed
        return requested

    return spread(len(plan.pieces), work)
