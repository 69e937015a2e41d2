"""Column slices on object stores: a box part's rows (:class:`~smpckpt.storage.read._plan.BoxRead`, whole
row groups) fetched in ranged requests of at most the reader's ``max_request_bytes``, verified, and copied
into the destination on the worker thread.

Rows share a request only where the planner's cost model streams them (``box.stream``: the unread gap
between neighbouring rows' runs costs less than one more request, the reader's ``request_cost_bytes``,
:func:`~smpckpt.storage.format._columns.streams`, as on local disk): a part whose span fits the cap is then
one request from its first row's first column to its last row's last, widened to whole check units. Rows
farther apart take a request each (:func:`runs`): the slice's columns of each row (its column groups, when
tiled; verified untiled, its run widened to the blocks it touches, which straddle rows, each checked), so a
column reshard requests the bytes it needs, not its enclosing rows (rev69b: 4x at TP=4). A
tiled row group past the cap (a fused QKV's rows of 128 MiB, one row a group) used to be one request of the
whole group, of which a TP rank uses its columns; it is read as runs of the slice's column groups instead:
rows that stream share a request, gaps read into scratch, and a run longer than the cap goes in pieces of
whole column groups. The runs land back to back, so each tile of the slice's columns is checked where it
landed once its row group is in, and only the slice's columns are held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from smpckpt.errors import CheckpointError
from smpckpt.storage.format._columns import Into
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.read._fetch import (
    BoxRows,
    BufferPool,
    Landing,
    check_complete,
    read_range,
    reading,
    reads_into,
    verify_blocks,
    verify_box,
)
from smpckpt.storage.read._plan import BoxRead

__all__ = ["fetch_rows", "runs"]


def runs(box: BoxRead, rows: tuple[int, int], cap: int) -> list[tuple[int, int, int, int]]:
    """The requests that read the box's columns of ``rows`` (whole row groups), each ``(first row, end
    row, first byte column, end byte column)`` of the record: rows that stream (``box.stream``) and whose
    span (first row's first column to last row's last, gaps included) fits ``cap`` share one; else a row is
    a request; a single row's run past ``cap`` is cut into pieces of whole column groups of at most
    ``cap`` (at least one group: the smallest unit a read can verify on its own; untiled: any bytes)."""
    a, b = rows
    w, rb = box.width, box.row_bytes
    if w > cap:
        seg = box.tiling.segment if box.tiling is not None else 1
        step = max(1, cap // seg) * seg
        return [(r, r + 1, c, min(c + step, box.col1)) for r in range(a, b) for c in range(box.col0, box.col1, step)]
    per = 1 + (cap - w) // rb if box.stream else 1  # rows one request holds
    return [(r, min(b, r + per), box.col0, box.col1) for r in range(a, b, per)]


def fetch_rows(
    fs: Any,
    path: str,
    box: BoxRead,
    rows: tuple[int, int],
    rec: FileRecord | None,
    pool: BufferPool,
    cap: int,
    dst: memoryview | None,
    into: Into | None,
    turn: AbstractContextManager[None] | None,
) -> BoxRows:
    """(worker thread) Rows ``rows`` of ``box`` (whole row groups), verified against ``rec`` (``None``: not
    verified), into ``dst`` (the destination's own rows, when it takes them as stored), through ``into``
    (the item's destination, whole), or handed back (``BoxRows.data``, rows ``pitch`` bytes apart from the
    box's first column) for the calling thread to deliver."""
    a, b = rows
    first = box.base + a * box.row_bytes + box.col0
    lo, hi = first, box.base + (b - 1) * box.row_bytes + box.col1
    if rec is not None:
        lo, hi = rec.widen(lo, hi)
    if not box.stream or (hi - lo > cap and box.tiling is not None and rec is not None):
        return _fetch_runs(fs, path, box, rows, rec, pool, cap, dst, into, turn)
    data = read_range(fs, path, lo, hi, [box.item], rec, pool, turn)
    into = Into(dst, a, box.width, box.col0) if dst is not None else into
    if into is None:
        return BoxRows(data[first - lo :], box.row_bytes, hi - lo, 1)
    into.copy(data[first - lo :], a, box.col0, rows, box.row_bytes)
    pool.give_back(data)
    return BoxRows(None, box.width, hi - lo, 1)


def _fetch_runs(
    fs: Any,
    path: str,
    box: BoxRead,
    rows: tuple[int, int],
    rec: FileRecord | None,
    pool: BufferPool,
    cap: int,
    dst: memoryview | None,
    into: Into | None,
    turn: AbstractContextManager[None] | None,
) -> BoxRows:
    """:func:`fetch_rows` of rows that do not stream, or of a tiled row group past ``cap``: the :func:`runs`
    land back to back (``width`` bytes a row) in ``dst`` or one buffer of the slice's columns; every tile in
    them verified after (``rec``: the file's record when verifying), or, untiled, every block each request
    touched (its run widened to them, :func:`_get_blocks`)."""
    a, b = rows
    w, rb = box.width, box.row_bytes
    # an untiled record's blocks straddle its rows: each request (a row's run, never several rows: such a
    # box does not stream) is widened to whole blocks, the widening read into scratch, every block checked
    blocks = rec if rec is not None and box.tiling is None else None
    get = _getter(fs, path)  # the backend's ranged read, chosen once for every run
    out = dst if dst is not None else memoryview(pool.take((b - a) * w))[: (b - a) * w]
    plan = runs(box, rows, cap)
    # the gap between two rows of one request: read, never used (a request of several rows only)
    sink = memoryview(bytearray(rb - w)) if any(r1 - r0 > 1 for r0, r1, _, _ in plan) else None
    nbytes = 0
    landed: list[tuple[int, int, Landing]] = []  # (untiled) the requests' widened ranges, verified after
    with reading(path, [box.item.fqn], turn):
        for r0, r1, c0, c1 in plan:
            views: list[memoryview] = []
            for r in range(r0, r1):
                at = (r - a) * w + c0 - box.col0
                views.append(out[at : at + c1 - c0])
                if r + 1 < r1 and sink is not None:
                    views.append(sink)
            start = box.base + r0 * rb + c0
            want = (r1 - r0 - 1) * rb + c1 - c0
            if blocks is not None and r1 == r0 + 1:
                landed.append(_get_blocks(get, path, box, blocks, start, views[0]))
                nbytes += landed[-1][1] - landed[-1][0]
                continue
            if blocks is not None:  # pragma: no cover - runs() gives such a box a request per row
                raise CheckpointError(f"{path}: internal: rows {r0}..{r1} of {box.item.fqn!r} in one request")
            check_complete(path, [box.item.fqn], start, start + want, get(start, want, views))
            nbytes += want
    if rec is not None and blocks is None:
        verify_box(path, box, rec, out, w, a, rows)
    if blocks is not None:  # untiled: every block each request touched, where it landed
        for lo, hi, land in landed:
            verify_blocks(path, blocks, lo, hi, [box.item], land.digest)
    if into is not None:
        into.copy(out, a, box.col0, rows, w)
    if dst is not None or into is not None:
        if dst is None:
            pool.give_back(out)
        return BoxRows(None, w, nbytes, len(plan))
    return BoxRows(out, w, nbytes, len(plan))


def _get_blocks(
    get: Callable[[int, int, Sequence[memoryview]], int],
    path: str,
    box: BoxRead,
    rec: FileRecord,
    start: int,
    view: memoryview,
) -> tuple[int, int, Landing]:
    """File bytes ``[start, start + len(view))`` (one row's run of an untiled record) into ``view``, read as
    one request widened to the whole blocks they touch, the widening into scratch: the range requested and
    where its bytes landed, for the caller to check every one of those blocks."""
    end = start + len(view)
    lo, hi = rec.widen(start, end)
    head, tail = memoryview(bytearray(start - lo)), memoryview(bytearray(hi - end))
    check_complete(path, [box.item.fqn], lo, hi, get(lo, hi - lo, [v for v in (head, view, tail) if len(v)]))
    return lo, hi, Landing([(lo, head), (start, view), (end, tail)])


def _getter(fs: Any, path: str) -> Callable[[int, int, Sequence[memoryview]], int]:
    """``get(start, n, views)``: file bytes ``[start, start + n)`` of ``path`` into ``views`` in order (S3:
    the GET body streamed in; else ``cat_file``, copied); the bytes got."""
    if reads_into(fs):
        from smpckpt.storage.backends._s3 import get_range_into

        return lambda start, n, views: get_range_into(fs, path, start, start + n, views)

    def get(start: int, n: int, views: Sequence[memoryview]) -> int:
        data = memoryview(fs.cat_file(path, start=start, end=start + n))
        pos = 0
        for v in views:
            k = min(len(v), len(data) - pos)
            v[:k] = data[pos : pos + k]
            pos += k
        return len(data)

    return get
