"""Read I/O of column slices on local disk (:class:`~smpckpt.storage.read._plan.BoxRead`): rows read a
request each, merged runs of rows, or sequential spans of whole rows (the planner's cost model), each row
group's tiles inside the slice's columns verified before its bytes are used.

The functions here run on the reader's worker threads (``_run``); the rest of the read I/O is ``_fetch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from smpckpt.errors import CheckpointError
from smpckpt.storage.backends._fs import advise_random, pread_into
from smpckpt.storage.format._checksum import hash_rows
from smpckpt.storage.format._columns import STREAM_PIECE_BYTES, Into
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.read._fetch import BufferPool, Turn, check_complete, reading, unit_rows, verify_blocks
from smpckpt.storage.read._plan import ROWS_PER_CALL, BoxRead

__all__ = ["BoxRows", "Into", "STREAM_PIECE_BYTES", "read_box"]


@dataclasses.dataclass(frozen=True)
class BoxRows:
    """What :func:`read_box` read: rows of a box from the part's first row and the box's first column
    on, ``pitch`` bytes apart in ``data`` (``None``: they landed in the destination given), and the
    bytes and requests it asked storage for."""

    data: memoryview | None
    pitch: int
    nbytes: int
    requests: int


def _prefetch(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading file bytes ``[offset, offset + length)`` now (``WILLNEED``): exactly
    the span a streamed part reads, so its later pieces arrive while the first is verified and copied
    (the descriptor has no read-ahead, which would read past the part)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # advice only
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def read_box(
    path: str,
    box: BoxRead,
    rows: tuple[int, int],
    rec: FileRecord | None,
    dst: memoryview | None,
    pool: BufferPool,
    turn: Turn | None = None,
    into: Into | None = None,
) -> BoxRows:
    """(worker thread, local files) Rows ``[a, b)`` of the box (whole row groups), verified against
    ``rec`` (when the box is tiled and ``rec`` is given: every tile inside the box's columns), into
    ``dst`` (the destination's own rows, ``width`` bytes each) or a pooled buffer.

    Read a row group at a time: its rows read (one request each, or ``box.merge``: up to
    :data:`~._plan.ROWS_PER_CALL` rows per request, gaps into a scratch buffer), then its tiles verified
    while their bytes are in cache; no read-ahead on these descriptors (it would fetch the gaps).

    ``box.stream`` (:func:`~._plan.streams`): sequential requests of whole rows, gaps included
    (:func:`_stream_into`: pieces of about :data:`STREAM_PIECE_BYTES` through one reused buffer, each
    verified, then its columns copied into ``dst`` or ``into``, the item's whole destination; without
    either, or under a ``turn``: one request into a pooled buffer, ``pitch`` ``row_bytes``).
    Returns where the rows are and the bytes and requests asked of storage."""
    with reading(path, [box.item.fqn], turn):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            advise_random(fd, random=not box.merge)
            if box.stream:
                if dst is not None:
                    into = Into(dst, rows[0], box.width, box.col0)
                if into is not None and turn is None:
                    return _stream_into(fd, path, box, rows, rec, into, pool)
                got = _read_span(fd, path, box, rows, dst, pool)
                if turn is None:
                    _verify_rows(path, box, rec, got, dst, rows)
            else:
                got = _read_groups(fd, path, box, rows, rec, dst, pool, verify=turn is None)
        finally:
            os.close(fd)
    if turn is not None:  # a turn at the device covers the reads only
        _verify_rows(path, box, rec, got, dst, rows)
    return got


def _verify_rows(
    path: str, box: BoxRead, rec: FileRecord | None, got: BoxRows, dst: memoryview | None, rows: tuple[int, int]
) -> None:
    """Every tile of ``rows`` inside the box's columns (a tiled box, ``rec`` given), where ``got`` says
    the rows are (``dst`` when they landed there)."""
    if box.tiling is not None and rec is not None:
        _verify_box(path, box, rec, got.data if got.data is not None else dst, got.pitch, rows[0], rows)


def _read_groups(
    fd: int,
    path: str,
    box: BoxRead,
    rows: tuple[int, int],
    rec: FileRecord | None,
    dst: memoryview | None,
    pool: BufferPool,
    *,
    verify: bool,
) -> BoxRows:
    """Rows ``rows`` a row group at a time into ``dst`` or a pooled buffer, each group verified after
    its rows are in (``verify``)."""
    a, b = rows
    out = dst if dst is not None else memoryview(pool.take((b - a) * box.width))
    sink = memoryview(bytearray(box.row_bytes - box.width)) if box.merge else None
    check = rec if box.tiling is not None and verify else None
    asked = [0, 0]
    for g0 in range(a, b, box.group_rows):
        g1 = min(b, g0 + box.group_rows)
        _read_rows(fd, path, box, out, a, (g0, g1), sink, asked)
        if check is not None:
            _verify_box(path, box, check, out, box.width, a, (g0, g1))
    return BoxRows(None if dst is not None else out, box.width, asked[0], asked[1])


def _read_rows(
    fd: int,
    path: str,
    box: BoxRead,
    out: memoryview,
    a: int,
    rows: tuple[int, int],
    sink: memoryview | None,
    asked: list[int],
) -> None:
    """Rows ``rows`` of ``box`` into ``out`` (which starts at row ``a``); ``asked`` gets the bytes and
    requests issued."""
    w, rb = box.width, box.row_bytes
    g0, g1 = rows
    at = box.base + g0 * rb + box.col0
    if sink is None:
        for r in range(g0, g1):
            dst = out[(r - a) * w : (r - a + 1) * w]
            got = os.preadv(fd, [dst], at)
            if got != w:  # a short read: finish it (or find the file cut short)
                got += pread_into(fd, [dst[got:]], at + got, w - got)
                check_complete(path, [box.item.fqn], at, at + w, got)
            at += rb
        asked[0] += (g1 - g0) * w
        asked[1] += g1 - g0
        return
    for r0 in range(g0, g1, ROWS_PER_CALL):
        r1 = min(g1, r0 + ROWS_PER_CALL)
        views = []
        for r in range(r0, r1):
            views += [out[(r - a) * w : (r - a + 1) * w], sink]
        want = (r1 - r0 - 1) * rb + w
        start = box.base + r0 * rb + box.col0
        check_complete(path, [box.item.fqn], start, start + want, pread_into(fd, views[:-1], start, want))
        asked[0] += want
        asked[1] += 1


def _stream_into(
    fd: int, path: str, box: BoxRead, rows: tuple[int, int], rec: FileRecord | None, into: Into, pool: BufferPool
) -> BoxRows:
    """Rows ``rows`` of ``box`` in sequential requests of whole row groups (about
    :data:`STREAM_PIECE_BYTES` each, gaps included) into one reused buffer, each piece's tiles verified
    (a tiled box, ``rec`` given) and then its rows copied into ``into``."""
    rb, w = box.row_bytes, box.width
    a, b = rows
    step = max(1, STREAM_PIECE_BYTES // (rb * box.unit_rows)) * box.unit_rows
    buf = memoryview(pool.take(min(b - a, step) * rb))
    check = rec if box.tiling is not None else None
    nbytes = requests = 0
    if b - a > step:  # more than one piece
        _prefetch(fd, box.base + a * rb + box.col0, (b - a - 1) * rb + w)
    for p0 in range(a, b, step):
        p1 = min(b, p0 + step)
        start = box.base + p0 * rb + box.col0
        want = (p1 - p0 - 1) * rb + w
        check_complete(path, [box.item.fqn], start, start + want, pread_into(fd, [buf[:want]], start, want))
        nbytes, requests = nbytes + want, requests + 1
        if check is not None:
            _verify_box(path, box, check, buf, rb, p0, (p0, p1))
        into.copy(buf, p0, box.col0, (p0, p1), rb)
    pool.give_back(buf)
    return BoxRows(None, w, nbytes, requests)


def _read_span(
    fd: int, path: str, box: BoxRead, rows: tuple[int, int], dst: memoryview | None, pool: BufferPool
) -> BoxRows:
    """Rows ``rows`` of ``box`` as one sequential request -- from the box's first column of the first row
    to its last column of the last, gaps included -- into a pooled buffer; with a ``dst``, the box's
    columns of each row are then copied into it with one strided copy (numpy: no GIL)."""
    w, rb = box.width, box.row_bytes
    r0, r1 = rows
    start = box.base + r0 * rb + box.col0
    want = (r1 - r0 - 1) * rb + w
    buf = memoryview(pool.take(want))
    check_complete(path, [box.item.fqn], start, start + want, pread_into(fd, [buf[:want]], start, want))
    if dst is None:
        return BoxRows(buf, rb, want, 1)
    np.copyto(
        np.ndarray((r1 - r0, w), np.uint8, buffer=dst),
        np.ndarray((r1 - r0, w), np.uint8, buffer=buf, strides=(rb, 1)),
    )
    pool.give_back(buf)  # the arrays over it are gone with the statement above
    return BoxRows(None, w, want, 1)


def _verify_box(
    path: str, box: BoxRead, rec: FileRecord, out: memoryview | None, pitch: int, a: int, rows: tuple[int, int]
) -> None:
    """Every tile of rows ``rows`` (whole row groups) inside the box's columns, from ``out`` (rows from row
    ``a`` and the box's first column on, ``pitch`` bytes apart)."""
    if out is None:  # pragma: no cover - callers pass the destination's rows then
        raise CheckpointError(f"{path}: internal: no bytes to verify for {box.item.fqn!r}")
    first = box.base + rows[0] * box.row_bytes
    last = box.base + rows[1] * box.row_bytes
    base, rb = box.base, box.row_bytes

    def digest(start: int, nrows: int, run: int, stride: int) -> int:
        row, col = divmod(start - base, rb)
        return hash_rows(out, (row - a) * pitch + col - box.col0, nrows, run, pitch)

    def in_box(i: int) -> bool:
        return box.col0 <= (unit_rows(rec, i)[0] - base) % rb < box.col1

    verify_blocks(path, rec, first, last, [box.item], digest, blocks=filter(in_box, rec.blocks_covering(first, last)))
