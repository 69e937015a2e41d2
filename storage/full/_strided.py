"""Column (strided) boxes of full artifacts on local files, read by the partial reader's cost model.

A column box is one run per row. Where the rows' unread gap costs less than a request
(:func:`~smpckpt.storage.format._columns.streams`), the rows are read as sequential spans of whole rows
in pieces of about :data:`~smpckpt.storage.format._columns.STREAM_PIECE_BYTES` that never cut a check
unit, each through a reused buffer where its units are verified and the box's columns copied out; wider
gaps keep a request per row. Either way a box is work for several threads (:func:`share`): its pieces,
or its rows' requests in groups of about :data:`PART_BYTES` (:func:`row_groups`), drawn one at a time by
the reading thread and the reader's free threads (one thread alone left the device idle between small
requests: ``benchmarks/RESULTS.md``). Each part writes only its own rows; memory stays one piece buffer
per reader thread.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from smpckpt.storage.format._checksum import hash_rows
from smpckpt.storage.format._columns import STREAM_PIECE_BYTES, Into, streams
from smpckpt.storage.full._files import RunFiles
from smpckpt.storage.full._units import UnitIndex

__all__ = ["PART_BYTES", "Spread", "StreamPlan", "row_groups", "serially", "share", "stream_plan", "read_streamed"]

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
    digests: Sequence[int],
    mismatch: Callable[[int], Exception],
    spread: Spread = serially,
) -> int:
    """(local files) The box of ``plan`` from the tensor at byte ``start`` of ``name`` into ``out``, a piece at
    a time through a buffer per thread: read in one request, its units hashed against ``digests``
    (``mismatch(position)``: the error), its rows' columns copied out. Returns the bytes requested."""
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
                    raise mismatch(int(plan.units[j]))
            into.copy(buf, p0, c0, (p0, p1), rb)  # only verified bytes are copied: the piece's units all passed
        return requested

    return spread(len(plan.pieces), work)
